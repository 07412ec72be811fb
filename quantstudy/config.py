"""Loading the run and study configuration: read, merged, validated once, locked, built into the typed
study model (study.py) after the checks (checks.py).

Every check that can fail on bad input runs when the Snakefile is read, so a bad config is a sentence
on the terminal before any job starts. The model's and the checks' public names are importable from
here too, as they were before the split.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from quantstudy import checks, lockfile
from quantstudy.artifacts import atomic_write
from quantstudy.checks import (  # noqa: F401  (re-exported: imported from config by other modules)
    QUALITY_ROW_COLUMNS, SPEED_COLUMNS, main_quality_condition, quality_columns)
from quantstudy.families.base import Setting
from quantstudy.study import (  # noqa: F401  (re-exported: imported from config by other modules)
    Run, Study, calibration_setting_of, tiny_dataset_spec)
from quantstudy.study_values import (  # noqa: F401  (re-exported: imported from config by other modules)
    Baseline, Condition, Configured, Dataset, Decision, Model, Recipe, SampleSpec, Target, Timing, Variant,
    calibration_sample_sets, is_card, on_its_card)

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
    doc["timing"]["profile"] = doc["timing"].get("profile", True)
    doc.setdefault("reference_dtype", "float32")
    doc.setdefault("quality_against", [])
    evaluation = doc.get("evaluation") or {}
    # `rebuild` only where set: the study as a run without it recorded it stays the same document.
    doc["evaluation"] = {"repeats": int(evaluation.get("repeats", 1)),
                         **({"rebuild": True} if evaluation.get("rebuild") else {})}
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
    variants = {}
    for name, v in doc["variants"].items():
        transforms = tuple((next(iter(t)), dict(next(iter(t.values())) or {})) for t in v.get("transforms", []))
        variants[name] = Variant(name, v["precision"], transforms, v.get("timed", True), v.get("calibration"))
    problems += checks.study_problems(doc, models, settings, datasets, variants)

    if against_code and problems:  # the layers only once the rest is sound (a model may be missing)
        problems += checks.problems_against_code(doc, models, variants, settings, match_layers=False)
    elif against_code:
        passed = CODE_CHECKS / checks.code_check_key(doc, models)
        if not passed.exists():
            problems += checks.problems_against_code(doc, models, variants, settings, match_layers=True)
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
               timing.get("min_round_ms"), timing["profile"]),
        Decision(tuple(Condition.from_config(c) for c in doc["decision"]["conditions"])),
        doc["metrics"], doc["seeds"], tuple(doc["evaluation_samples"]), tuple(doc["quality_against"]),
        doc["reference_dtype"], doc["evaluation"]["repeats"], doc["evaluation"].get("rebuild", False),
        None if "calibrate_by" not in doc else tuple(doc["calibrate_by"]),
        {n: s["engine"] for n, s in doc["settings"].items() if "engine" in s},
        {t: dict(f or {}) for t, f in (doc.get("targets") or {}).items()}, doc.get("published"), doc)


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
            "differs": doc.get("differs", []), "left_out": doc["left_out"], "entries": entries}


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
    compared = {e["column"] for e in published["entries"]} | {
        c.get("column") for d in docs for c in (d.get("decision") or {}).get("conditions", [])}
    problems += [f"differs names column {c!r}, which no published number and no decision condition compares: "
                 "it would flag nothing" for d in published.get("differs", []) for c in d["columns"] if c not in compared]
    for e in published["entries"]:
        for key, names in known.items():
            for name in _names(e[key]):
                if name not in names:
                    s = e["source"]
                    problems.append(f"{s['title']!r}, row {s['row']!r}, column {s['column']!r}: {key} {name!r} is no "
                                    f"{key} of study {study}" + (f" on {', '.join(published['runs'])}" if key == "target" else "")
                                    + f"; its {key}s: {', '.join(dict.fromkeys(names))}")
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
