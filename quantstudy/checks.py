"""The checks of a study config, each problem a sentence for the person who wrote it: what its names
refer to (samples, variants, settings, targets, the decision's columns, shared engines) and, importing
the code, what it asks of the code (family, transforms, the layers its patterns match). config.py runs
them at load and raises one ConfigError with every problem found.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import jsonschema

from quantstudy.families.base import QualityColumns, Setting
from quantstudy.study import REVISIT_SELECTORS, calibration_setting_of
from quantstudy.study_values import Dataset, Model, Variant, calibration_sample_sets

ROOT = Path(__file__).resolve().parent.parent


def main_quality_condition(decision: dict[str, Any]) -> dict[str, Any] | None:
    """The decision's first per-row quality condition (table quality, reduce min or max): its column
    is the study's main quality metric, the y axis of its speed-vs-quality plot."""
    return next((c for c in decision["conditions"] if c["table"] == "quality" and c["reduce"] in ("min", "max")), None)


# The speed table's columns (aggregate: a timing row, its repeats, its Amdahl bound, its target), beside
# the settings' shape keys: what a decision condition on that table may name. A quality table's columns
# are its family's metric blocks. tests/test_workflow.py checks a run's rows against this list.
SPEED_COLUMNS = frozenset({
    "target", "model", "setting", "variant", "graph", "status", "error", "source", "gpu", "backend", "batch",
    "baseline", "variant_ms", "variant_spread", "baseline_ms", "x", "x_min", "x_max", "repeat", "repeats", "x_by_repeat",
    "x_jobs_min", "x_jobs_max", "x_jobs_spread", "timing_sources", "bound", "bound_note", "at_limit", "x_of_bound",
    "f", "f_basis", "f_kind", "f_source", "g", "g_source", "fp8_emulated",
    "x_rounds_low", "x_rounds_high", "x_low", "x_high"})
# The quality table's columns that are not the family's (aggregate_rows.quality_rows, across_evaluations).
QUALITY_ROW_COLUMNS = frozenset({
    "target", "model", "setting", "variant", "status", "error", "source", "gpu", "backend", "batch", "evaluations",
    "quality_sources", "quality_builds", "evaluation_repeat", "nonfinite", "nonfinite_detail", "intervals"})


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


def condition_problems(doc: dict[str, Any]) -> list[str]:
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


def study_problems(doc: dict[str, Any], models: dict[str, Model], settings: dict[str, Setting],
                   datasets: dict[str, Dataset], variants: dict[str, Variant]) -> list[str]:
    """What the study's names refer to (samples, variants, settings, targets, the decision's columns),
    each problem a sentence; the names it gives the code are problems_against_code's."""
    problems: list[str] = []
    for name, s in doc["samples"].items():
        if s["dataset"] not in datasets:
            problems.append(f"samples {name!r} name unknown dataset {s['dataset']!r}")
        elif s["split"] not in datasets[s["dataset"]].files:
            problems.append(f"samples {name!r}: dataset {s['dataset']!r} has no split {s['split']!r}")
    for role, name in [*[("recipe.activation_calibration.samples", n) for n in calibration_sample_sets(doc["recipe"])],
                       *[("evaluation_samples", n) for n in doc["evaluation_samples"]]]:
        if name not in doc["samples"]:
            problems.append(f"{role} names {name!r}, no entry of samples; samples: {', '.join(doc['samples'])}")

    for name, v in variants.items():
        if v.calibration is None:
            continue
        if v.calibration == {"method": doc["recipe"]["activation_calibration"]["algorithm"]}:
            problems.append(f"variant {name!r}: calibration {v.calibration} is the recipe's own method; leave it out")
        if not any(t in ("fp8", "microscaling") for t, _ in v.transforms):
            problems.append(f"variant {name!r} names a calibration method but quantizes nothing (no fp8 or "
                            "microscaling transform)")

    conditions = {c["name"] for c in doc["decision"]["conditions"]}
    for i, r in enumerate(doc.get("revisit") or []):
        if "condition" in r and r["condition"] not in conditions:
            problems.append(f"revisit[{i}] names {r['condition']!r}, no condition of the decision; conditions: "
                            f"{', '.join(sorted(conditions))}")
        problems += [f"revisit[{i}] names unknown variant {v!r}; variants: {', '.join(variants)}, or calibration_methods, "
                     "microscaled" for v in r.get("variants", []) if v not in variants and v not in REVISIT_SELECTORS]

    # Speed is measured against the baseline and decided on the candidate: neither can be quality-only.
    for role, name in [("candidate", doc["candidate"]), ("baseline.default", doc["baseline"]["default"]),
                       *[(f"baseline.by_setting.{s}", n) for s, n in doc["baseline"].get("by_setting", {}).items()]]:
        if name in variants and variants[name].timed is not True:
            kind = ("a quality-only variant (timed: false)" if variants[name].timed is False
                    else "a variant timed on Blackwell targets only (timed: blackwell)")
            problems.append(f"{role} names {name!r}, {kind}: it must be timed")
    # A block-scaled variant timed off Blackwell would time fake-quant, not NVFP4 / MXFP8 GEMMs.
    problems += [f"variant {v.name!r} is microscaled (NVFP4 / MXFP8), whose GEMMs run on Blackwell tensor cores "
                 "(sm_100+) only: give it `timed: blackwell` (timed on b200 / b300 targets, quality-only on the "
                 "others) or `timed: false`" for v in variants.values()
                 if v.timed is True and any(t == "microscaling" for t, _ in v.transforms)]
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
            if s in settings and calibration_setting_of(doc.get("calibrate_by"), s, settings, model.settings) is None:
                problems.append(f"model {model.name!r}: setting {s!r} has no quality setting of its shape "
                                f"(by {doc.get('calibrate_by', 'every shape key')}) to calibrate at")

    problems += engine_problems(doc, models)
    problems += condition_problems(doc)
    if main_quality_condition(doc["decision"]) is None:
        problems.append("decision has no per-row quality condition (table: quality, reduce: min or max): its column "
                        "is the study's main quality metric, which the speed-vs-quality plot draws")
    return problems


def _engine_of(settings: dict[str, dict[str, Any]], name: str) -> str:
    """The setting whose engines setting `name` runs on (its `engine:`, else itself): the one lookup."""
    return settings[name].get("engine", name)


def engine_problems(doc: dict[str, Any], models: dict[str, Model]) -> list[str]:
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


def code_check_key(doc: dict[str, Any], models: dict[str, Model]) -> str:
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


# What the fp8 transform reads (transforms.apply_variant and fp8_layers); `when` is every transform's.
FP8_PARAMETERS = ("include", "exclude", "add", "keep_edge_blocks", "exclude_calls", "weight_scales", "activation_scales",
                  "when")


def problems_against_code(doc: dict[str, Any], models: dict[str, Model], variants: dict[str, Variant],
                           settings: dict[str, Setting], match_layers: bool) -> list[str]:
    """The names a study gives the code: its family, its settings' shapes, its transforms, the
    layers its patterns match."""
    from quantstudy import families, quantization, transforms  # deferred: these import torch

    if doc["family"] not in families.names():
        return [f"unknown family {doc['family']!r}; registered families: {', '.join(families.names())}"]
    family = families.get(doc["family"])
    known = transforms.transform_names(family.transforms())
    problems = [f"variant {v.name!r} names unknown transform {t!r}; known transforms: {', '.join(sorted(known))}"
                for v in variants.values() for t, _ in v.transforms if t not in known]
    for v in variants.values():
        for t, params in v.transforms:
            if t != "fp8":
                continue
            problems += [f"variant {v.name!r}: fp8 has no parameter {k!r}; its parameters: {', '.join(FP8_PARAMETERS)}"
                         for k in params if k not in FP8_PARAMETERS]
            for key, allowed in (("weight_scales", quantization.WEIGHT_SCALES),
                                 ("activation_scales", quantization.ACTIVATION_SCALES)):
                if key in params and params[key] not in allowed:
                    problems.append(f"variant {v.name!r}: fp8 {key} {params[key]!r} is not one of {', '.join(allowed)}")
    problems += [f"variant {v.name!r}: microscaling format {params.get('format')!r} is not one of "
                 f"{', '.join(quantization.MICROSCALING_BLOCK)}" for v in variants.values() for t, params in v.transforms
                 if t == "microscaling" and params.get("format") not in quantization.MICROSCALING_BLOCK]
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
    patterns += [(f"variant {v.name!r}: {t} {k} pattern", p) for v in variants.values() for t, params in v.transforms
                 if t in ("fp8", "microscaling") for k in ("include", "add", "exclude") for p in params.get(k, [])]
    for model in models.values():
        layers = family.quantizable_layers(model.architecture)
        for where, pattern in patterns:
            if not fnmatch.filter(layers, pattern):
                problems.append(f"{where} {pattern!r} matches no layer of {model.name} "
                                f"({model.architecture_name}); its linear layers are like {layers[:3]}")
    return problems
