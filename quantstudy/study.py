"""The typed study model: a run, its targets and studies, and each study's models, settings, datasets,
sample sets, variants, recipe, timing, baseline and decision, as frozen objects that config.py builds
once at load, after checks.py has checked them. Rules and steps read their attributes; a value that
crosses into a rule's params converts in one place (as_params / from_params).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from quantstudy import paths
from quantstudy.families.base import Setting


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
    def method(self) -> dict[str, Any]:
        """Its calibration method as a variant names one (`{"method": "max"}`)."""
        return {"method": self.activation_calibration["algorithm"]}

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


# The GPUs (a target's `gpu:`) whose tensor cores run NVFP4 and MXFP8 GEMMs (Blackwell, sm_100+): the only
# targets a block-scaled variant (`timed: blackwell`) is timed on.
BLACKWELL = ("b200", "b300")


def timed_on(timed: bool | str, gpu: str) -> bool:
    """Whether a variant whose config says `timed` is timed on a target with this `gpu:`."""
    return timed is True or (timed == "blackwell" and gpu.lower() in BLACKWELL)


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str
    transforms: tuple[tuple[str, dict[str, Any]], ...] = ()
    # False: a quality-only variant (built and evaluated; no time, profile or gemm job measures it);
    # "blackwell": timed on Blackwell targets (BLACKWELL) only, quality-only on every other.
    timed: bool | str = True
    # Its own calibration method (`calibration: {method: mse}`); None: the recipe's.
    calibration: dict[str, Any] | None = None

    def timed_on(self, gpu: str) -> bool:
        """Whether a target with this `gpu:` times the variant."""
        return timed_on(self.timed, gpu)

    @property
    def calibration_label(self) -> str:
        """What names its amax file (paths.calibration_suffix): "" for the recipe's method."""
        return calibration_label(self.calibration) if self.calibration else ""

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

    def needs_amax(self, setting: Setting) -> bool:
        """Whether its build reads the amax file: FP8 layers' scales, or NVFP4's per-tensor activation scale."""
        return any(name in ("fp8", "microscaling") for name, _ in self.transforms_at(setting))


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
    evaluation_rebuild: bool = False  # evaluation job r >= 2 opens its own build (`evaluation.rebuild`)
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
        (`quality_only`: that it evaluates; `timed_only`: that it times and profiles). `run_targets`: the
        run's {name: Target}, or target names (then each counts as no Blackwell GPU)."""
        for t in run_targets:
            if self.targets and t not in self.targets:
                continue
            only = self.targets.get(t) or {}
            gpu = getattr(run_targets[t], "gpu", "cpu") if isinstance(run_targets, dict) else "cpu"
            for m, s in self.model_settings(quality_only, timed_only):
                if s in only.get("settings", [s]):
                    for v in self.variants:
                        timed = self.variants[v].timed_on(gpu)
                        # not an engine of a variant this target does not time at a setting without quality
                        if v in only.get("variants", [v]) and (timed or not timed_only) and (timed or self.settings[s].quality):
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

    def evaluated_build_json(self, target: str, model: str, setting: str, variant: str, repeat: int) -> str:
        """The build record of the engine a variant's evaluation job `repeat` opens: the one it is timed on
        (build_json), or with `evaluation.rebuild` its own separate build for job 2 on (paths.REBUILD)."""
        if repeat == 1 or not self.evaluation_rebuild:
            return self.build_json(target, model, setting, variant)
        return paths.REBUILD.format(study=self.name, target=target, model=model, setting=self.engine_setting(setting),
                                    variant=variant, repeat=paths.repeat_suffix(repeat))

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
        return calibration_setting_of(self.calibrate_by, setting, self.settings, self.models[model].settings)

    def calibration_settings(self, model: str) -> list[str]:
        return sorted({self.calibration_setting(model, s) for s in self.models[model].settings})

    def calibration_method(self, label: str) -> dict[str, Any]:
        """The method an amax file is calibrated by: the recipe's for "", else the variant's that `label` names."""
        if not label:
            return self.recipe.method
        return next(v.calibration for v in self.variants.values() if v.calibration_label == label)

    def calibration_labels(self, run_targets) -> list[str]:
        """The amax files each calibration setting has on the run's targets: "" (the recipe's), then one per
        method a measured variant names."""
        measured = dict.fromkeys(v for *_, v in self.engines(run_targets))
        return ["", *dict.fromkeys(self.variants[v].calibration_label for v in measured
                                   if self.variants[v].calibration_label)]


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




def tiny_dataset_spec(dataset: Dataset) -> dict[str, Any]:
    """What a tiny dataset's content depends on; a detection dataset is generated in its declared box format."""
    tiny = dataset.tiny if dataset.box_format is None else {**dataset.tiny, "box_format": dataset.box_format}
    return {"files": dataset.files, "tiny": tiny}


# What a revisit check's `variants` may name beside variants (as configured: dicts): every variant of a kind,
# whichever of them this run has.
REVISIT_SELECTORS = {
    "calibration_methods": lambda v: bool(v.get("calibration")),  # a variant's own calibration method
    "microscaled": lambda v: any("microscaling" in t for t in v.get("transforms") or []),  # NVFP4, MXFP8
}


def calibration_label(method: dict[str, Any]) -> str:
    """A calibration method's name in paths: the method, then its parameters' values in key order
    (`{method: percentile, percentile: 99.9}` -> "percentile-99.9")."""
    return "-".join([method["method"], *(str(method[k]) for k in sorted(method) if k != "method")])


def calibration_sample_sets(recipe: dict[str, Any]) -> list[str]:
    """The sample sets a recipe calibrates on, in order: `activation_calibration.samples` names one or a list."""
    names = recipe["activation_calibration"]["samples"]
    return [names] if isinstance(names, str) else list(names)


def calibration_setting_of(calibrate_by, setting: str, settings: dict[str, Setting], model_settings) -> str | None:
    """The first of `model_settings` that is a quality setting agreeing with `setting` on the shape keys
    an amax file depends on (`calibrate_by`, None: all of them); None if there is none."""
    shape = settings[setting].shape
    keys = list(shape) if calibrate_by is None else calibrate_by
    for s in model_settings:
        if s in settings and settings[s].quality and all(settings[s].shape.get(k) == shape.get(k) for k in keys):
            return s
    return None
