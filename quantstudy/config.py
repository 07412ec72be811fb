"""The run and study configuration: validated once, turned into typed objects.

Every check that can fail on bad input runs here, when the Snakefile is read, so a bad
config is a sentence on the terminal before any job starts.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import hashlib
import importlib.metadata
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from quantstudy import lockfile, paths
from quantstudy.artifacts import atomic_write
from quantstudy.families.base import QualityColumns, Setting

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "config" / "schemas"
ARCHITECTURES = ROOT / "config" / "architectures"
# A setting's keys that are not its shape.
SETTING_KEYS = ("batch", "quality", "engine")
# One empty file per study config that passed the checks against the code (see _code_check_key).
CODE_CHECKS = ROOT / ".snakemake" / "quantstudy" / "checked-against-code"

# The keys of a published number's row in tables.json, and what a column's value is multiplied by to
# be in the units the write-up prints (a fraction as %, bytes as MiB).
PUBLISHED_KEYS = ("target", "model", "setting", "variant", "graph")
UNIT_SCALE = {"%": 100.0, "MiB": 2.0 ** -20}

# Bumped whenever the tiny-fixture generators change what they write: it is part of the
# content hash that serves as the tiny checkpoints' and datasets' pinned revision.
TINY_GENERATOR_VERSION = 1


class ConfigError(ValueError):
    """A configuration problem, worded for the person who wrote the config."""


@dataclass(frozen=True)
class Model:
    name: str
    repo: str
    revision: str
    architecture_name: str
    architecture: dict[str, Any]
    settings: tuple[str, ...]
    tiny: dict[str, Any] | None = None
    timed: bool = True  # False: quality only (`timing: false`), no time or profile jobs


@dataclass(frozen=True)
class Configured:
    """A value of the study config that crosses into a rule's params: `entry` is its config entry as
    written (after defaults and the lock), which a rule passes and provenance records. Kept as written,
    key order included: Snakemake reruns a job whose params' repr changes, and every JSON records them."""

    entry: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    def as_params(self) -> dict[str, Any]:
        """The config entry as plain values: a rule's params."""
        return copy.deepcopy(self.entry)


@dataclass(frozen=True)
class Dataset(Configured):
    name: str
    repo: str
    revision: str
    files: dict[str, str]
    tiny: dict[str, Any] | None = None
    box_format: str | None = None  # a detection dataset's layout of its boxes (metrics.BOX_FORMATS)


@dataclass(frozen=True)
class SampleSpec(Configured):
    """A sample set (`samples.<name>`): drawn from a split of a dataset by the family's rule. The family's
    own draw options (min_tokens, offset ...) stay in `entry`, which the family reads."""

    name: str
    dataset: str
    split: str
    kind: str
    count: int
    seed: int | None = None

    @classmethod
    def from_params(cls, name: str, params: dict[str, Any]) -> "SampleSpec":
        return cls(name, params["dataset"], params["split"], params["kind"], params["count"], params.get("seed"),
                   entry=dict(params))


@dataclass(frozen=True)
class Recipe(Configured):
    """The FP8 recipe (`recipe`): the layers it quantizes and how their scales are calibrated."""

    quantize: tuple[str, ...]
    weight_scale: str
    activation_calibration: dict[str, Any]
    dequantize_dtype: str
    outlier_ratio: float
    exclude_calls: tuple[str, ...] = ()

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Recipe":
        return cls(tuple(params["quantize"]), params["weight_scale"], dict(params["activation_calibration"]),
                   params["dequantize_dtype"], params["outlier_ratio"], tuple(params.get("exclude_calls", ())),
                   entry=dict(params))

    @property
    def calibration_samples(self) -> list[str]:
        """The sample sets it calibrates on, in order (`activation_calibration.samples`: one or a list)."""
        return calibration_sample_sets(self.entry)

    @property
    def calibration_dtype(self) -> str:
        """The dtype the module is calibrated in (default float32; bf16 where the write-up calibrated the bf16 model)."""
        return self.activation_calibration.get("dtype", "float32")


@dataclass(frozen=True)
class Baseline:
    """The variant a setting's speed-ups are measured against: `default`, or its `by_setting` entry."""

    default: str
    by_setting: dict[str, str] = field(default_factory=dict)

    def of(self, setting: str) -> str:
        """The one place a setting's baseline is decided."""
        return self.by_setting.get(setting, self.default)


@dataclass(frozen=True)
class Condition:
    """One condition of the decision: `reduce` of `column` over the candidate's rows of `table`,
    compared with `threshold` (config/schemas/study.schema.yaml says what each key means)."""

    name: str
    table: str
    column: str
    reduce: str
    compare: str
    threshold: float
    basis: str
    rows: dict[str, Any] = field(default_factory=dict)
    units: str | None = None
    samples: tuple[str, ...] = ()
    n: str | None = None
    relative_to: str | None = None

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> "Condition":
        return cls(c["name"], c["table"], c["column"], c["reduce"], c["compare"], c["threshold"], c["basis"],
                   dict(c.get("rows") or {}), c.get("units"), tuple(c.get("samples", ())), c.get("n"),
                   c.get("relative_to"))


@dataclass(frozen=True)
class Decision:
    """FP8 ships only if every condition holds on the candidate's rows."""

    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class Timing:
    """How a study times (`timing`): each job's warm-up, rounds and calls per round, how many separate
    jobs per timed variant (`repeats`), and the smallest change that counts (`min_effect`: x and ms, shares)."""

    warmup: int
    rounds: int
    calls_per_round: int
    repeats: int
    min_effect: dict[str, float]
    min_round_ms: float | None = None

    def job_params(self) -> dict[str, Any]:
        """How each timing job times, as a rule's params: not `repeats` (raising it adds jobs, reruns none)."""
        rounds = {"warmup": self.warmup, "rounds": self.rounds, "calls_per_round": self.calls_per_round}
        return rounds if self.min_round_ms is None else {**rounds, "min_round_ms": self.min_round_ms}


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str
    transforms: tuple[tuple[str, dict[str, Any]], ...] = ()
    # False: a quality-only variant (built and evaluated; no time, profile or gemm job measures it).
    timed: bool = True

    def transforms_at(self, setting: Setting) -> list[tuple[str, dict[str, Any]]]:
        """The transforms that apply at this setting: `when: {window: [512]}` limits a transform
        to the settings whose shape has one of those values."""
        return [(name, {k: v for k, v in params.items() if k != "when"}) for name, params in self.transforms
                if all(setting.shape.get(k) in values for k, values in params.get("when", {}).items())]

    def spec(self, setting: Setting) -> dict[str, Any]:
        """What the build of this variant at this setting depends on: a rule's params."""
        return {"precision": self.precision,
                "transforms": [{name: params} for name, params in self.transforms_at(setting)]}

    def has_fp8(self, setting: Setting) -> bool:
        return any(name == "fp8" for name, _ in self.transforms_at(setting))


def is_card(gpu: str, name: str) -> bool:
    """Whether a GPU named `name` (torch.cuda.get_device_name, e.g. "NVIDIA H200") is the card a target
    declares (`gpu: h200`): that word in the name, so "NVIDIA H100 80GB HBM3" is no h200."""
    return re.search(rf"(?<![a-z0-9]){re.escape(gpu.lower())}(?![a-z0-9])", name.lower()) is not None


def on_its_card(target: Target, gpu_name: str | None) -> bool:
    """Whether a job of `target` may record numbers on the GPU named `gpu_name` (None: the job sees
    none): a CPU target anywhere, a GPU target on the card it declares (`gpu:`), since its README
    says they are that card's. The audit asks it of every recorded job; each job before it starts."""
    return target.device == "cpu" or (gpu_name is not None and is_card(target.gpu, gpu_name))


@dataclass(frozen=True)
class Target:
    name: str
    backend: str
    device: str
    gpu: str = "cpu"
    version: str = ""
    env: str = ""
    compile: bool = False
    builder: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Target":
        """A target as rules pass it (plain values under `target`: its name, so that Snakemake sees a change)."""
        return cls(**{"name": params["target"], **{k: v for k, v in params.items() if k != "target"}})

    def as_params(self) -> dict[str, Any]:
        """The target as plain values: a rule's params (from_params reads them back)."""
        return {"target": self.name, **vars(self)}


@dataclass(frozen=True)
class Study:
    """One study, built and checked once at load (load_study): what the rules and steps read."""

    name: str
    family: str
    title: str
    models: dict[str, Model]
    settings: dict[str, Setting]
    datasets: dict[str, Dataset]
    samples: dict[str, SampleSpec]
    variants: dict[str, Variant]
    recipe: Recipe
    baseline: Baseline
    candidate: str  # the variant the decision is about
    timing: Timing
    decision: Decision
    metrics: dict[str, Any]  # the family's metric parameters, checked against its schema at load
    seeds: dict[str, int]  # each seed the family draws with, by name
    evaluation_samples: tuple[str, ...]  # the sample sets every evaluation and reference job measures
    # the variants whose engines every other variant's evaluation is also compared with
    quality_against: tuple[str, ...] = ()
    reference_dtype: str = "float32"  # the dtype the PyTorch reference runs in
    evaluation_repeats: int = 1  # separate evaluation jobs per engine (`evaluation.repeats`)
    calibrate_by: tuple[str, ...] | None = None  # the shape keys an amax file depends on (None: all)
    # setting -> the setting whose dynamic-shape engine it runs on (its `engine:`); absent: its own
    setting_engines: dict[str, str] = field(default_factory=dict)

    # target -> {"settings": [...], "variants": [...]} (a missing key: all); empty: every target, all of it
    targets: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    published: str | None = None  # config/published/<study>.yaml, checked against the study when loaded
    # The study as configured (defaults filled in, revisions locked): what tables.json records of it and
    # the audit compares (Run.aggregate_arguments); nothing else reads it.
    document: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def repeats(self) -> int:
        """Separate timing jobs per timed variant (`timing.repeats`, the run's where it sets one)."""
        return self.timing.repeats

    def sample_dataset(self, name: str) -> Dataset:
        """The dataset that sample set `name` is drawn from."""
        return self.datasets[self.samples[name].dataset]

    def setting(self, name: str) -> Setting:
        return self.settings[name]

    def baselines(self) -> dict[str, str]:
        return {s: self.baseline.of(s) for s in self.settings}

    def local_hub_specs(self) -> dict[str, list[dict[str, Any]]]:
        """What the local_hub rule generates: the models and datasets that have a tiny spec."""
        return {"models": [{"repo": m.repo, "revision": m.revision, "architecture": m.architecture, "tiny": m.tiny}
                           for m in self.models.values() if m.tiny],
                "datasets": [{"repo": d.repo, "revision": d.revision, "files": d.files, "tiny": tiny_dataset_spec(d)["tiny"]}
                             for d in self.datasets.values() if d.tiny]}

    def model_settings(self, quality_only: bool = False, timed_only: bool = False):
        for model in self.models.values():
            if timed_only and not model.timed:
                continue
            for s in model.settings:
                if not quality_only or self.settings[s].quality:
                    yield model.name, s

    def engines(self, run_targets, quality_only: bool = False, timed_only: bool = False):
        """(target, model, setting, variant) of every engine the study measures on the run's targets
        (`quality_only`: that it evaluates; `timed_only`: that it times and profiles)."""
        for t in run_targets:
            if self.targets and t not in self.targets:
                continue
            only = self.targets.get(t) or {}
            for m, s in self.model_settings(quality_only, timed_only):
                if s in only.get("settings", [s]):
                    for v in self.variants:
                        if v in only.get("variants", [v]) and (self.variants[v].timed or not timed_only):
                            yield t, m, s, v

    def engine_setting(self, setting: str) -> str:
        """The setting whose engines this one is timed and evaluated on: itself, or the one its
        `engine:` names (one dynamic-shape engine serving several settings)."""
        return self.setting_engines.get(setting, setting)

    def build_json(self, target: str, model: str, setting: str, variant: str) -> str:
        """The build record (paths.BUILD) of the engine a variant is timed and evaluated on at `setting`:
        built at that setting, or at the one whose dynamic-shape engine serves it (`engine:`)."""
        return paths.BUILD.format(study=self.name, target=target, model=model, setting=self.engine_setting(setting),
                                  variant=variant)

    def served_settings(self, target: str, model: str, setting: str, variant: str) -> list[str]:
        """The settings whose jobs open the engine built at `setting`: itself first, then those whose
        `engine:` names it. The engine is built for each of their shapes."""
        served = [s for t, m, s, v in self.engines([target])
                  if (m, v) == (model, variant) and self.engine_setting(s) == setting]
        return list(dict.fromkeys([setting, *served]))

    def builds(self, run_targets):
        """(target, model, setting, variant) of every engine built: those the study measures, each
        shared engine once, under the setting that builds it."""
        return list(dict.fromkeys((t, m, self.engine_setting(s), v) for t, m, s, v in self.engines(run_targets)))

    def calibration_setting(self, model: str, setting: str) -> str:
        """The setting whose amax file this one uses: the model's first quality setting that agrees
        on the shape keys calibration depends on (`calibrate_by`, default all of them; never the
        batch). A model with a KV cache may calibrate by prefill alone, a shared dynamic engine by none."""
        return _calibration_setting(self.calibrate_by, setting, self.settings, self.models[model].settings)

    def calibration_settings(self, model: str) -> list[str]:
        return sorted({self.calibration_setting(model, s) for s in self.models[model].settings})


@dataclass(frozen=True)
class Run:
    name: str
    weights: str
    hf_cache: str
    offline: bool
    studies: dict[str, Study]
    targets: dict[str, Target]
    note: str = ""

    def study_targets(self, study: Study) -> list[str]:
        """The run's targets a study uses (its `targets:`, or all of them)."""
        return [t for t in self.targets if not study.targets or t in study.targets]

    def aggregate_arguments(self, name: str) -> dict[str, Any]:
        """What rule aggregate makes a study's tables.json from, beside its input files: the study as
        configured, its baselines, the run, its targets. The audit compares tables.json's record of them
        with these (a threshold edited in the record, and the decision with it, would agree with itself)."""
        study = self.studies[name]
        return {"study": study.document, "baselines": study.baselines(),
                "run": {"name": self.name, "weights": self.weights, "note": self.note},
                "targets": {t: vars(self.targets[t]) for t in self.study_targets(study)}}


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None


def _validate(doc: Any, schema_file: str, where: str) -> None:
    schema = _load_yaml(SCHEMAS / schema_file)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        lines = []
        for e in errors:
            path = ".".join(str(p) for p in e.absolute_path) or "(top level)"
            if e.validator == "pattern" and "revision" in path:
                msg = (f"revision {e.instance!r} is not pinned: give the full 40-hex commit (or, as a write-up "
                       "gives it, a short hash of at least 7 lower-case hex digits, which the lock step resolves), "
                       "not a branch or tag")
            elif e.validator == "oneOf" and "description" in e.schema:  # "not valid under any of the given schemas"
                msg = f"{e.instance!r}: expected {e.schema['description']}"
            elif path.endswith(("timing.repeats", "timing_repeats")):
                msg = (f"{e.instance!r} is not a number of timing jobs: repeats is how many separate timing jobs "
                       "each timed variant gets, a whole number of at least 1 (the default, 1: one job)")
            else:
                msg = e.message
            lines.append(f"  {where}: {path}: {msg}")
        raise ConfigError("invalid configuration:\n" + "\n".join(lines))


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`, recursively for mappings; a null value removes the key."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def shape_of(setting: dict[str, Any]) -> dict[str, int]:
    """A setting's shape keys (window; height and width; prefill and cache) from its config entry."""
    return {k: v for k, v in setting.items() if k not in SETTING_KEYS}


def load_architecture(name: str) -> dict[str, Any]:
    path = ARCHITECTURES / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in ARCHITECTURES.glob("*.json"))
        raise ConfigError(f"unknown architecture {name!r}; recorded ones: {', '.join(known)}")
    return json.loads(path.read_text())


def tiny_revision(spec: dict[str, Any]) -> str:
    """Content hash that pins a generated tiny checkpoint or dataset (40 hex, like a git commit)."""
    canonical = json.dumps({"generator": TINY_GENERATOR_VERSION, **spec}, sort_keys=True)
    return hashlib.sha1(canonical.encode()).hexdigest()


def tiny_model_spec(model: Model) -> dict[str, Any]:
    return {"architecture": model.architecture, "tiny": model.tiny}


def tiny_dataset_spec(dataset: Dataset) -> dict[str, Any]:
    """What a tiny dataset's content depends on; a detection dataset is generated in its declared box format."""
    tiny = dataset.tiny if dataset.box_format is None else {**dataset.tiny, "box_format": dataset.box_format}
    return {"files": dataset.files, "tiny": tiny}


def calibration_sample_sets(recipe: dict[str, Any]) -> list[str]:
    """The sample sets a recipe calibrates on, in order: `activation_calibration.samples` names one or a list."""
    names = recipe["activation_calibration"]["samples"]
    return [names] if isinstance(names, str) else list(names)


def main_quality_condition(decision: dict[str, Any]) -> dict[str, Any] | None:
    """The decision's first per-row quality condition (table quality, reduce min or max): its column
    is the study's main quality metric, the y axis of its speed-vs-quality plot."""
    return next((c for c in decision["conditions"] if c["table"] == "quality" and c["reduce"] in ("min", "max")), None)


def workflow_path(p: str | Path) -> Path:
    """Config paths are relative to the workflow's root, wherever Snakemake runs."""
    p = Path(p)
    return p if p.is_absolute() else ROOT / p


# The smallest change of a timing that counts (`timing.min_effect`, shares): x is a ratio of paired
# rounds and moves less between jobs than a median time does.
MIN_EFFECT = {"x": 0.05, "ms": 0.10}


def load_study(spec_path: str | Path, overrides: str | list[str] | None = None, against_code: bool = True,
               timing_repeats: int | None = None) -> Study:
    """A study spec with its override files deep-merged over it in order, validated; `timing_repeats`
    (the run's) in place of its `timing.repeats`.

    `against_code` also checks the names it gives the code (family, transforms, the layers its
    recipe patterns match), which imports torch and builds each model on the meta device."""
    doc = merged_study_doc(spec_path, overrides)
    where = " + ".join(str(p) for p in [spec_path, *_override_list(overrides)])
    if timing_repeats is not None:
        doc, where = deep_merge(doc, {"timing": {"repeats": timing_repeats}}), f"{where} + the run's timing_repeats"
    _validate(doc, "study.schema.yaml", where)
    # One timing job and one evaluation job per engine unless asked; int: the schema's integer also admits 2.0.
    doc["timing"]["repeats"] = int(doc["timing"].get("repeats", 1))
    doc["timing"]["min_effect"] = {**MIN_EFFECT, **doc["timing"].get("min_effect", {})}
    doc.setdefault("reference_dtype", "float32")
    doc.setdefault("quality_against", [])
    doc["evaluation"] = {"repeats": int((doc.get("evaluation") or {}).get("repeats", 1))}
    study = _build_study(_locked(doc, where), where, against_code)
    if study.published:
        # Against the spec as well as this run's doc: a tiny run's overrides may leave out a model
        # the write-up measured, whose numbers are then listed as not reproduced here.
        problems = _published_problems(load_published(study.published), [_load_yaml(workflow_path(spec_path)), doc],
                                       study.name)
        if problems:
            raise ConfigError(f"invalid published numbers ({study.published}, study {where}):\n"
                              + "\n".join(f"  {p}" for p in problems))
    return study


def _override_list(overrides: str | Path | list[str] | None) -> list:
    """A study's overrides as a list: a run config names one file or a list of them."""
    return [overrides] if isinstance(overrides, (str, Path)) else list(overrides or [])


def merged_study_doc(spec_path: str | Path, overrides: str | list[str] | None = None) -> dict[str, Any]:
    """A study spec with its override files deep-merged over it in order (not yet validated)."""
    doc = _load_yaml(workflow_path(spec_path))
    for o in _override_list(overrides):
        doc = deep_merge(doc, _load_yaml(workflow_path(o)) or {})
    return doc


def _locked(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """The doc with every short or missing revision replaced by its commit in the lock file; an
    unresolved one stops the run here, before any job, with the command that resolves it."""
    doc, entries, unresolved = copy.deepcopy(doc), lockfile.read(), []
    for kind, entry in lockfile.pinned(doc):
        req = lockfile.request(kind, entry["repo"], entry.get("revision"))
        if req is None:
            continue
        try:
            commit = lockfile.locked_commit(req, entries)
        except lockfile.LockError as e:
            raise ConfigError(f"invalid study ({where}): {e}") from None
        if commit is None:
            unresolved.append(req)
        else:
            entry["revision"] = commit
    if unresolved:
        raise ConfigError(
            f"unresolved revisions ({where}), not in {lockfile.shown(lockfile.LOCK_FILE)}:\n"
            + "\n".join(f"  {r.describe()}" for r in unresolved)
            + f"\nOn a machine that reaches the hub, run `{lockfile.command([str(p) for p in where.split(' + ')])}` "
            "and commit the lock file; a short hash is never used as a revision.")
    return doc


def _build_study(doc: dict[str, Any], where: str, against_code: bool) -> Study:
    problems: list[str] = []
    settings = {n: Setting(n, s["batch"], shape_of(s), s.get("quality", True)) for n, s in doc["settings"].items()}
    models = {}
    for name, m in doc["models"].items():
        try:
            arch = load_architecture(m["architecture"])
        except ConfigError as e:
            problems.append(f"model {name!r}: {e}")
            continue
        for s in m["settings"]:
            if s not in settings:
                problems.append(f"model {name!r} names unknown setting {s!r}; settings: {', '.join(settings)}")
        models[name] = Model(name, m["checkpoint"]["repo"], m["checkpoint"]["revision"], m["architecture"],
                             arch, tuple(m["settings"]), m.get("tiny"), m.get("timing", True))
        if not models[name].timed:
            problems += [f"model {name!r} has timing: false, so its setting {s!r} (quality: false) would measure nothing"
                         for s in m["settings"] if s in settings and not settings[s].quality]
        if m.get("tiny") and models[name].revision != tiny_revision(tiny_model_spec(models[name])):
            problems.append(f"model {name!r}: a tiny checkpoint's revision is the content hash of its spec: "
                            f"set revision to {tiny_revision(tiny_model_spec(models[name]))}")
    datasets = {n: Dataset(n, d["repo"], d["revision"], d["files"], d.get("tiny"), d.get("box_format"), entry=d)
                for n, d in doc["datasets"].items()}
    samples = {n: SampleSpec.from_params(n, s) for n, s in doc["samples"].items()}
    for d in datasets.values():
        if d.tiny and d.revision != tiny_revision(tiny_dataset_spec(d)):
            problems.append(f"dataset {d.name!r}: a tiny dataset's revision is the content hash of its spec: "
                            f"set revision to {tiny_revision(tiny_dataset_spec(d))}")
    for name, s in doc["samples"].items():
        if s["dataset"] not in datasets:
            problems.append(f"samples {name!r} name unknown dataset {s['dataset']!r}")
        elif s["split"] not in datasets[s["dataset"]].files:
            problems.append(f"samples {name!r}: dataset {s['dataset']!r} has no split {s['split']!r}")
    for role, name in [*[("recipe.activation_calibration.samples", n) for n in calibration_sample_sets(doc["recipe"])],
                       *[("evaluation_samples", n) for n in doc["evaluation_samples"]]]:
        if name not in doc["samples"]:
            problems.append(f"{role} names {name!r}, no entry of samples; samples: {', '.join(doc['samples'])}")

    variants = {}
    for name, v in doc["variants"].items():
        transforms = tuple((next(iter(t)), dict(next(iter(t.values())) or {})) for t in v.get("transforms", []))
        variants[name] = Variant(name, v["precision"], transforms, v.get("timed", True))
    # Speed is measured against the baseline and decided on the candidate: neither can be quality-only.
    for role, name in [("candidate", doc["candidate"]), ("baseline.default", doc["baseline"]["default"]),
                       *[(f"baseline.by_setting.{s}", n) for s, n in doc["baseline"].get("by_setting", {}).items()]]:
        if name in variants and not variants[name].timed:
            problems.append(f"{role} names {name!r}, a quality-only variant (timed: false): it must be timed")
    for role, name in [("candidate", doc["candidate"]), ("baseline.default", doc["baseline"]["default"]),
                       *[(f"baseline.by_setting.{s}", n) for s, n in doc["baseline"].get("by_setting", {}).items()],
                       *[("quality_against", n) for n in doc["quality_against"]],
                       *[(f"decision.conditions[{i}].relative_to", c["relative_to"])
                         for i, c in enumerate(doc["decision"]["conditions"]) if "relative_to" in c]]:
        if name not in variants:
            problems.append(f"{role} names unknown variant {name!r}; variants: {', '.join(variants)}")
    for target, only in (doc.get("targets") or {}).items():
        for s in (only or {}).get("settings", []):
            if s not in settings:
                problems.append(f"targets.{target}.settings names unknown setting {s!r}")
        kept = set((only or {}).get("variants", variants))
        for v in kept - set(variants):
            problems.append(f"targets.{target}.variants names unknown variant {v!r}")
        for s in (only or {}).get("settings", settings):
            base = doc["baseline"].get("by_setting", {}).get(s, doc["baseline"]["default"])
            if s in settings and base not in kept:
                problems.append(f"targets.{target}.variants leaves out {base!r}, the baseline of setting {s!r}")
        problems += [f"targets.{target}.variants leaves out {v!r}, which quality_against names"
                     for v in doc["quality_against"] if v in variants and v not in kept]
    for name in doc["baseline"].get("by_setting", {}):
        if name not in settings:
            problems.append(f"baseline.by_setting names unknown setting {name!r}; settings: {', '.join(settings)}")
    for model in models.values():
        for s in model.settings:
            if s in settings and _calibration_setting(doc.get("calibrate_by"), s, settings, model.settings) is None:
                problems.append(f"model {model.name!r}: setting {s!r} has no quality setting of its shape "
                                f"(by {doc.get('calibrate_by', 'every shape key')}) to calibrate at")

    problems += _engine_problems(doc, models)
    problems += _condition_problems(doc)
    if main_quality_condition(doc["decision"]) is None:
        problems.append("decision has no per-row quality condition (table: quality, reduce: min or max): its column "
                        "is the study's main quality metric, which the speed-vs-quality plot draws")

    if against_code and problems:  # the layers only once the rest is sound (a model may be missing)
        problems += _problems_against_code(doc, models, variants, settings, match_layers=False)
    elif against_code:
        passed = CODE_CHECKS / _code_check_key(doc, models)
        if not passed.exists():
            problems += _problems_against_code(doc, models, variants, settings, match_layers=True)
            if not problems:
                passed.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(passed, json.dumps({"passed": True}))  # a marker read back whole
    if problems:
        raise ConfigError(f"invalid study ({where}):\n" + "\n".join(f"  {p}" for p in problems))
    timing = doc["timing"]
    return Study(
        doc["study"], doc["family"], doc["title"], models, settings, datasets, samples, variants,
        Recipe.from_params(doc["recipe"]), Baseline(doc["baseline"]["default"], dict(doc["baseline"].get("by_setting", {}))),
        doc["candidate"],
        Timing(timing["warmup"], timing["rounds"], timing["calls_per_round"], timing["repeats"], timing["min_effect"],
               timing.get("min_round_ms")),
        Decision(tuple(Condition.from_config(c) for c in doc["decision"]["conditions"])),
        doc["metrics"], doc["seeds"], tuple(doc["evaluation_samples"]), tuple(doc["quality_against"]),
        doc["reference_dtype"], doc["evaluation"]["repeats"],
        None if "calibrate_by" not in doc else tuple(doc["calibrate_by"]),
        {n: s["engine"] for n, s in doc["settings"].items() if "engine" in s},
        {t: dict(f or {}) for t, f in (doc.get("targets") or {}).items()}, doc.get("published"), doc)


# The speed table's columns (aggregate: a timing row, its repeats, its Amdahl bound, its target), beside
# the settings' shape keys: what a decision condition on that table may name. A quality table's columns
# are its family's metric blocks. tests/test_workflow.py checks a run's rows against this list.
SPEED_COLUMNS = frozenset({
    "target", "model", "setting", "variant", "graph", "status", "error", "source", "gpu", "backend", "batch",
    "baseline", "variant_ms", "variant_spread", "baseline_ms", "x", "x_min", "x_max", "repeat", "repeats", "x_by_repeat",
    "x_jobs_min", "x_jobs_max", "x_jobs_spread", "timing_sources", "bound", "bound_note", "at_limit", "x_of_bound",
    "f", "f_basis", "f_kind", "f_source", "g", "g_source", "fp8_emulated",
    "x_rounds_low", "x_rounds_high", "x_low", "x_high"})
# The quality table's columns that are not the family's (aggregate._quality, across_evaluations).
QUALITY_ROW_COLUMNS = frozenset({
    "target", "model", "setting", "variant", "status", "error", "source", "gpu", "backend", "batch", "evaluations",
    "quality_sources", "evaluation_repeat", "nonfinite", "nonfinite_detail"})


def quality_columns(declared: QualityColumns) -> frozenset[str]:
    """The quality table's columns from a family's declaration (Family.quality_columns), named as
    aggregate names them: block.metric, nonfinite.<set> and .of, each number's .jobs_min and .jobs_max
    across evaluation jobs, reference.block.metric, and the columns every quality row has."""
    own = {f"{b}.{m}" for b, metrics in declared.blocks.items() for m in metrics}
    own |= {f"nonfinite.{s}{end}" for s in declared.nonfinite for end in ("", ".of")}
    return frozenset(own | {f"{c}.jobs_{e}" for c in own | {"nonfinite"} for e in ("min", "max")} | QUALITY_ROW_COLUMNS
                     | {f"reference.{b}.{m}" for b, metrics in declared.reference.items() for m in metrics})


# Row fields every table has, whose values a condition's `rows` filter may name.
ROW_FIELDS = {"target": "targets", "model": "models", "setting": "settings", "variant": "variants"}


def _condition_problems(doc: dict[str, Any]) -> list[str]:
    """Decision conditions whose speed column, row filter or sample list names nothing: such a condition
    finds no rows, and the decision counts it as not met, a changed answer instead of an error. (The
    quality table's columns are the family's: _problems_against_code checks those.)"""
    known = {"models": list(doc["models"]), "settings": list(doc["settings"]), "variants": list(doc["variants"]),
             "targets": list(doc.get("targets") or {})}
    problems = _column_problems(doc, "speed", SPEED_COLUMNS)
    for i, c in enumerate(doc["decision"]["conditions"]):
        where = f"decision.conditions[{i}] ({c['name']!r})"
        for key, value in (c.get("rows") or {}).items():
            names = known.get(ROW_FIELDS.get(key, ""))
            if names and value not in names:
                problems.append(f"{where}: rows names {key} {value!r}, which the study has none of; its "
                                f"{ROW_FIELDS[key]}: {', '.join(names)}")
        for name in c.get("samples", []):
            if name not in doc["samples"]:
                problems.append(f"{where}: samples names {name!r}, which the study has no sample list of; its "
                                f"sample lists: {', '.join(doc['samples'])}")
    return problems


def _column_problems(doc: dict[str, Any], table: str, columns: frozenset[str]) -> list[str]:
    """The decision conditions on `table` whose column or row filter is none of its `columns` (or the
    settings' shape keys, which every table has)."""
    columns = columns | {k for s in doc["settings"].values() for k in s if k not in ("engine", "quality")}
    problems = []
    for i, c in enumerate(doc["decision"]["conditions"]):
        if c["table"] != table:
            continue
        where = f"decision.conditions[{i}] ({c['name']!r})"
        for what, name in [("column", c["column"]), *(("rows filter", key) for key in c.get("rows") or {})]:
            if name in columns:
                continue
            near = difflib.get_close_matches(name, columns, n=3)
            # without a near name, every column but the .jobs_ ranges (each number has both)
            listed = sorted(col for col in columns if not col.endswith((".jobs_min", ".jobs_max")))
            problems.append(f"{where}: {what} {name!r} is no column of the {table} table; "
                            + (f"did you mean {' or '.join(near)}?" if near else f"its columns: {', '.join(listed)}"))
    return problems


def _names(value: str | list[str] | None) -> list[str]:
    """A published key's names: one, a list, or none (the key matches every row)."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def load_published(path: str | Path) -> dict[str, Any]:
    """A published-numbers file (config/published/<study>.yaml), validated, each seed table's cells
    flattened into one entry: what it is, the keys of its row in tables.json, its value as printed and
    as a range {min, max}, units, tolerance and source (seed, section, table title, row, column)."""
    doc = _load_yaml(workflow_path(path))
    _validate(doc, "published.schema.yaml", str(path))
    entries, problems = [], []
    for t in doc["tables"]:
        for r in t["rows"]:
            where = f"{t['title']!r}, row {r['row']!r}"
            problems += [f"{where}: columns names {c!r}, which the row gives no value for"
                         for c in r.get("columns", {}) if c not in r["values"]]
            for label, value in r["values"].items():
                col = t["columns"].get(label)
                if col is None:
                    problems.append(f"{where}: value of column {label!r}, which the table's columns do not name; "
                                    f"its columns: {', '.join(t['columns'])}")
                    continue
                keys = {**t.get("keys", {}), **col.get("keys", {}), **r.get("keys", {}), **r.get("columns", {}).get(label, {})}
                printed = [value] if isinstance(value, str) else list(value)
                low, high = (float(v.replace(",", "")) for v in (printed[0], printed[-1]))
                if low > high:
                    problems.append(f"{where}, column {label!r}: the range {printed[0]} to {printed[-1]} runs backwards")
                if col["kind"] not in doc["tolerances"]:
                    problems.append(f"{where}, column {label!r}: kind {col['kind']!r} has no tolerance; "
                                    f"tolerances: {', '.join(doc['tolerances'])}")
                if t["table"] != "references" and "target" not in keys:
                    problems.append(f"{where}, column {label!r}: no target (a {t['table']} row is measured on one)")
                entries.append({"table": t["table"], "column": col["column"],
                                **{k: keys.get(k) for k in PUBLISHED_KEYS},
                                "units": col["units"], "kind": col["kind"], "tolerance": doc["tolerances"].get(col["kind"]),
                                "printed": printed, "min": low, "max": high, "note": r.get("note"),
                                "source": {"seed": doc["seed"], "section": t["section"], "title": t["title"],
                                           "row": r["row"], "column": label}})
    if problems:
        raise ConfigError(f"invalid published numbers ({path}):\n" + "\n".join(f"  {p}" for p in problems))
    return {"file": str(path), **{k: doc[k] for k in ("study", "seed", "weights", "runs", "tolerances")},
            "entries": entries}


def _published_problems(published: dict[str, Any], docs: list[dict[str, Any]], study: str) -> list[str]:
    """Each key of each published number names a model, setting and variant of the study, and a
    target the study runs on in one of the run configs the file names (`runs`)."""
    if published["study"] != study:
        return [f"the file is about study {published['study']!r}, not {study!r}"]
    problems, targets = [], []
    for run_path in published["runs"]:
        run = _load_yaml(workflow_path(run_path))
        entry = (run.get("studies") or {}).get(study)
        if entry is None:
            problems.append(f"runs names {run_path}, which does not run study {study!r}")
            continue
        spec = merged_study_doc(entry["spec"], entry.get("overrides"))
        docs = [*docs, spec]
        targets += [t for t in run.get("targets") or {} if not spec.get("targets") or t in spec["targets"]]
    known = {"target": targets, "model": [m for d in docs for m in d.get("models") or {}],
             "setting": [s for d in docs for s in d.get("settings") or {}],
             "variant": [v for d in docs for v in d.get("variants") or {}]}
    for e in published["entries"]:
        for key, names in known.items():
            for name in _names(e[key]):
                if name not in names:
                    s = e["source"]
                    problems.append(f"{s['title']!r}, row {s['row']!r}, column {s['column']!r}: {key} {name!r} is no "
                                    f"{key} of study {study}" + (f" on {', '.join(published['runs'])}" if key == "target" else "")
                                    + f"; its {key}s: {', '.join(dict.fromkeys(names))}")
    return problems


def _engine_of(settings: dict[str, dict[str, Any]], name: str) -> str:
    """The setting whose engines setting `name` runs on (its `engine:`, else itself): the one lookup."""
    return settings[name].get("engine", name)


def _engine_problems(doc: dict[str, Any], models: dict[str, Model]) -> list[str]:
    """`engine:` names a setting that builds its own engines, on every model that has this one."""
    problems = []
    for name in doc["settings"]:
        engine = _engine_of(doc["settings"], name)
        if engine == name:
            continue
        if engine not in doc["settings"]:
            problems.append(f"setting {name!r}: engine names unknown setting {engine!r}")
        elif _engine_of(doc["settings"], engine) != engine:
            problems.append(f"setting {name!r}: engine {engine!r} is timed on another setting's engine "
                            f"itself; name the setting that builds it")
        else:
            problems += [f"model {m.name!r} has setting {name!r} but not {engine!r}, whose engines it is timed on"
                         for m in models.values() if name in m.settings and engine not in m.settings]
    return problems


def _metrics_and_seeds_problems(doc: dict[str, Any], family) -> list[str]:
    """The study's `metrics` against its family's schema, and its `seeds` against the names the family
    draws with (each required, no other): a misspelt key would otherwise be ignored, or read as a default."""
    name = doc["family"]
    problems = [f"metrics{''.join(f'.{p}' for p in e.absolute_path)}: {e.message} (the {name} family's metrics)"
                for e in jsonschema.Draft202012Validator(family.metrics_schema).iter_errors(doc["metrics"])]
    problems += [f"seeds.{s} is required: the {name} family draws with it" for s in family.seeds if s not in doc["seeds"]]
    problems += [f"seeds.{s} is no seed the {name} family uses; its seeds: {', '.join(family.seeds) or 'none'}"
                 for s in doc["seeds"] if s not in family.seeds]
    return problems


def _engine_fit(family, setting: Setting, engine: Setting, model: Model) -> list[str]:
    """Each input of the setting's graphs within the engine setting's: a static size equal, a
    dynamic one within the range the engine is built for."""
    problems = []
    built = family.graphs(engine, model.architecture)
    for g, graph in family.graphs(setting, model.architecture).items():
        for name, t in graph.inputs.items():
            e = built[g].inputs[name]
            for axis, (n, m) in enumerate(zip(t.shape, e.shape)):
                dim = e.dynamic.get(axis)
                if (dim is None and n != m) or (dim is not None and not dim.min <= n <= dim.max):
                    allowed = f"{m}" if dim is None else f"{dim.min} to {dim.max}"
                    problems.append(f"setting {setting.name!r} cannot run on the engine of {engine.name!r} "
                                    f"({model.name}, graph {g}): {name} axis {axis} is {n}, the engine takes {allowed}")
    return problems


def _calibration_setting(calibrate_by, setting: str, settings: dict[str, Setting], model_settings) -> str | None:
    shape = settings[setting].shape
    keys = list(shape) if calibrate_by is None else calibrate_by
    for s in model_settings:
        if s in settings and settings[s].quality and all(settings[s].shape.get(k) == shape.get(k) for k in keys):
            return s
    return None


def _code_check_key(doc: dict[str, Any], models: dict[str, Model]) -> str:
    """What the checks against the code depend on: the study, its architectures, this package's
    source and the model libraries' versions. A no-op rerun then need not import torch."""
    h = hashlib.sha256(json.dumps([doc, {n: m.architecture for n, m in models.items()}], sort_keys=True).encode())
    for path in sorted((ROOT / "quantstudy").rglob("*.py")):
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    for package in ("torch", "transformers", "timm", "nvidia-modelopt"):
        try:
            h.update(f"{package}=={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{package} missing".encode())
    return h.hexdigest()


def _problems_against_code(doc: dict[str, Any], models: dict[str, Model], variants: dict[str, Variant],
                           settings: dict[str, Setting], match_layers: bool) -> list[str]:
    """The names a study gives the code: its family, its settings' shapes, its transforms, the
    layers its patterns match."""
    from quantstudy import families, quantization  # deferred: these import torch

    if doc["family"] not in families.names():
        return [f"unknown family {doc['family']!r}; registered families: {', '.join(families.names())}"]
    family = families.get(doc["family"])
    known = quantization.transform_names(family.transforms())
    problems = [f"variant {v.name!r} names unknown transform {t!r}; known transforms: {', '.join(sorted(known))}"
                for v in variants.values() for t, _ in v.transforms if t not in known]
    problems += [p for s in settings.values() for p in family.check_setting(s)]
    problems += _metrics_and_seeds_problems(doc, family)
    declared = family.quality_columns(list(doc["evaluation_samples"]), list(doc["quality_against"]))
    problems += _column_problems(doc, "quality", quality_columns(declared))
    if doc["quality_against"] and declared == family.quality_columns(list(doc["evaluation_samples"]), []):
        problems.append(f"quality_against names {', '.join(doc['quality_against'])}, but the {doc['family']} family's "
                        "evaluation compares with no other engine: those engines would be opened and measure nothing")
    if problems or not match_layers:
        return problems
    for name in doc["settings"]:
        engine = _engine_of(doc["settings"], name)
        for model in (m for m in models.values() if engine != name and name in m.settings):
            problems += _engine_fit(family, settings[name], settings[engine], model)
    # Each pattern with where it is written: a misspelt one would build another variant than meant.
    patterns = [("recipe pattern", p) for p in doc["recipe"]["quantize"]]
    patterns += [(f"variant {v.name!r}: fp8 {k} pattern", p) for v in variants.values() for t, params in v.transforms
                 if t == "fp8" for k in ("include", "add", "exclude") for p in params.get(k, [])]
    for model in models.values():
        layers = family.quantizable_layers(model.architecture)
        for where, pattern in patterns:
            if not fnmatch.filter(layers, pattern):
                problems.append(f"{where} {pattern!r} matches no layer of {model.name} "
                                f"({model.architecture_name}); its linear layers are like {layers[:3]}")
    return problems


def run_of_study(configfile: str | Path, name: str) -> Run:
    """The run config `configfile`, checked as a run checks it without the code, which must run study
    `name`: what an auditor names with --configfile."""
    run = load_run(_load_yaml(Path(configfile)), against_code=False)
    if name not in run.studies:
        raise ConfigError(f"{configfile} has no study {name!r}; its studies: {', '.join(run.studies)}")
    return run


def load_run(config: dict[str, Any], against_code: bool = True) -> Run:
    """Validate a run config (the dict Snakemake read) and everything it names."""
    _validate(config, "config.schema.yaml", "workflow config")
    studies: dict[str, Study] = {}
    for name, entry in config["studies"].items():
        study = load_study(entry["spec"], entry.get("overrides"), against_code, config.get("timing_repeats"))
        if study.name != name:
            raise ConfigError(f"config names study {name!r} but {entry['spec']} is study {study.name!r}")
        unknown = sorted(set(study.targets) - set(config["targets"]))
        if unknown:
            raise ConfigError(f"study {name!r} names targets {unknown} that the run does not define; "
                              f"run targets: {', '.join(config['targets'])}")
        studies[name] = study
    targets = {n: Target(n, **t) for n, t in config["targets"].items()}
    r = config["run"]
    return Run(r["name"], r["weights"], config["hf_cache"], config.get("offline", False), studies, targets,
               r.get("note", ""))
