"""Tidy tables of one study (pandas) and the decision computed from them.

Reads every per-variant JSON the workflow wrote; writes tables.json, the render's only input.
Each row keeps the path of the JSON it came from, so a rendered number can be traced back.
Nothing here knows a family: a family's metric blocks become columns named `block.metric`,
and the decision rule is a list of conditions over those columns (config `decision`).

Its parts: aggregate_rows.py reads each kind of artifact into rows, aggregate_bound.py puts the
Amdahl bound beside each speed row, decision.py applies the decision and the revisit checks, and
published.py sets the write-up's published numbers beside this run's.
"""

from __future__ import annotations

import logging
from typing import Any

import pandas as pd

from quantstudy import artifacts, bound, compare, paths, timing
from quantstudy.aggregate_bound import with_bounds, with_timed
from quantstudy.aggregate_rows import (
    across_evaluations, across_repeats, as_records, build_rows, calibration_row, is_missing, kernel_rows,
    note_damaged, quality_rows, readable, record_rows, reference_rows, rows_of, sample_lists, speed_rows)
from quantstudy.artifacts import DamagedArtifact, now, provenance, read_json, write_json
from quantstudy.config import load_published, shape_of
from quantstudy.decision import decide, revisit, with_ratio
from quantstudy.published import compare_published

log = logging.getLogger("quantstudy")


def _with_x_intervals(speed: pd.DataFrame, noise: dict[str, Any]) -> pd.DataFrame:
    """Each row's interval of x (`x_low`, `x_high`): its rounds' (resampled) and the study's spread between
    jobs (timing.timing_noise) over the row's jobs, combined (compare.combined_interval)."""
    def interval(r: dict[str, Any]) -> tuple[float | None, float | None]:
        if r.get("status") != "ok" or is_missing(r.get("x")) or is_missing(r.get("x_rounds_low")):
            return None, None
        return compare.combined_interval(r["x"], (r["x_rounds_low"], r["x_rounds_high"]), between_jobs=noise["x"],
                                         jobs=int(r.get("repeats") or 1))
    ends = [interval(r) for r in as_records(speed)]
    return speed.assign(x_low=[lo for lo, _ in ends], x_high=[hi for _, hi in ends])


def aggregate(inputs: dict[str, list[str]], study: dict[str, Any], baselines: dict[str, str], run: dict[str, Any],
              targets: dict[str, dict[str, Any]], out: str) -> None:
    """tables.json: the tables of the input files, with every argument they were made from in its
    provenance (the audit makes them again from those files and compares, audit_checks.rederived_problems)."""
    started = now()
    params = {"study": study, "baselines": baselines, "run": run, "targets": targets}
    write_json(out, "tables", {**tables(inputs, **params), "provenance": provenance(
        "aggregate", {f"{k}[{i}]": p for k, v in inputs.items() for i, p in enumerate(v)}, params, started)})


# The lists of files rule aggregate gives (rules/report.smk); an empty one leaves no trace in provenance.
INPUT_KINDS = ("builds", "records", "timings", "kernels", "gemms", "qualities", "references", "amax", "checkpoints",
               "published", "samples")


def inputs_of(tables_doc: dict[str, Any]) -> dict[str, list[str]]:
    """The `inputs` aggregate was given, from tables.json's provenance ({"timings[0]": ...} back to lists;
    a kind it had none of, such as a quality-only run's timings, as an empty list)."""
    inputs: dict[str, list[str]] = {kind: [] for kind in INPUT_KINDS}
    named = tables_doc["provenance"]["inputs"]
    for name in sorted(named, key=lambda n: (n.split("[")[0], int(n.split("[")[1].rstrip("]")))):
        inputs.setdefault(name.split("[")[0], []).append(named[name]["path"])
    return inputs


SPEC_KEYS = ("models", "settings", "datasets", "samples", "evaluation_samples", "recipe", "variants", "baseline",
             "candidate", "reference_dtype", "timing", "evaluation", "metrics", "decision", "quality_against")


def spec_of(study: dict[str, Any]) -> dict[str, Any]:
    """The part of the study's config that tables.json carries for the templates: everything the
    Method and the verdict describe (config.py gives each key its default, so none is missing)."""
    return {k: study[k] for k in SPEC_KEYS}


def tables(inputs: dict[str, list[str]], study: dict[str, Any], baselines: dict[str, str], run: dict[str, Any],
           targets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The study's tables from its input files (by kind: timings, qualities, builds, ...): tables.json
    without its provenance."""
    damaged: list[dict[str, str]] = []  # inputs that could not be read: rendered, never a bare decoder error
    speed = pd.DataFrame(across_repeats(as_records(rows_of(inputs["timings"], "timing", speed_rows, damaged))))
    quality = pd.DataFrame(across_evaluations(as_records(rows_of(inputs["qualities"], "quality", quality_rows, damaged))))
    builds = rows_of(inputs["builds"], "build", build_rows, damaged)
    kernels = rows_of(inputs["kernels"], "kernels", kernel_rows, damaged)
    records = rows_of(inputs["records"], "measurements", record_rows, damaged)
    kernel_files = readable(inputs["kernels"], "kernels", [])
    kernel_docs = [doc for _, doc in kernel_files]
    settings = {name: shape_of(s) for name, s in study["settings"].items()}
    references = reference_rows(inputs["references"], settings, damaged)
    amax = [a | {"source": p} for p, a in readable(inputs["amax"], "amax", damaged)]
    checkpoints = [c | {"source": p} for p, c in readable(inputs["checkpoints"], "checkpoint", damaged)]
    samples = sample_lists(readable(inputs["samples"], "samples", damaged), study)
    for frame in (speed, quality, builds, kernels, records):
        if "target" not in frame:  # no rows at all (a quality-only run times nothing)
            continue
        frame["gpu"] = frame.target.map(lambda t: targets[t].get("gpu", "cpu"))
        frame["backend"] = frame.target.map(lambda t: targets[t]["backend"])
        frame["batch"] = frame.setting.map(lambda s: study["settings"][s]["batch"])
        for key in {k for s in settings.values() for k in s}:
            frame[key] = frame.setting.map(lambda s: settings[s].get(key))
    # The reference's own metrics beside each variant's (e.g. the fp32 model's STS Spearman).
    by_ref = {(r["model"], r["setting"]): r for r in references}
    for col in sorted({k for r in references for k in r if "." in k}):
        quality[f"reference.{col}"] = [by_ref.get((m, s), {}).get(col) for m, s in zip(quality.model, quality.setting)]
    # A relative condition's column on every row of its table (each variant's KL over fp16's, say).
    for c in study["decision"]["conditions"]:
        if c.get("relative_to") and c["table"] == "quality":
            quality = with_ratio(quality, c["column"], c["relative_to"])
    # The Amdahl bound beside every x: g from gemm.json, f from the baseline's kernels.json.
    gemms: dict[tuple, tuple[str, dict | None]] = {}
    for path in inputs.get("gemms", []):
        try:
            doc = read_json(path, "gemm")
            gemms[(doc["target"], doc["model"], doc["setting"])] = (path, doc)
        except DamagedArtifact as e:
            note_damaged(e, "gemm", damaged)
            gemms[paths.setting_of(path)] = (path, None)
    threshold = (study.get("bound") or {}).get("at_limit", bound.AT_LIMIT)
    if len(kernels):
        kernels = with_timed(kernels, speed, baselines, study["candidate"])
    # One judgement per profile: the kernel table's and the bound's.
    profiles = {(r["target"], r["model"], r["setting"], r.get("graph") or "main", r["variant"]): r
                for r in as_records(kernels)} if len(kernels) else {}
    noise = timing.timing_noise([doc for _, doc in readable(inputs["timings"], "timing", [])])
    # The devices the jobs that built, timed, profiled and evaluated the engines ran on, as their JSONs record.
    ran_on = artifacts.devices(doc for kind, schema in (("builds", "build"), ("timings", "timing"),
                                                        ("kernels", "kernels"), ("qualities", "quality"))
                               for _, doc in readable(inputs[kind], schema, []))
    if len(speed):
        speed = _with_x_intervals(speed, noise)
        kernels_by_engine = {(d["target"], d["model"], d["setting"], d["variant"]): (p, d) for p, d in kernel_files}
        speed = with_bounds(speed, gemms if study["timing"]["profile"] else None, kernels_by_engine, baselines, threshold,
                            profiles)
    log.info("%d timing, %d quality, %d build, %d kernel rows", len(speed), len(quality), len(builds), len(kernels))
    calibration = [calibration_row(a, study) for a in amax]
    published = load_published(inputs["published"][0]) if inputs.get("published") else None
    published_rows = [] if published is None else compare_published(
        published, {"speed": as_records(speed), "quality": as_records(quality), "builds": as_records(builds),
                    "kernels": as_records(kernels), "references": references}, run["weights"], targets)
    return {
        "study": study["study"], "title": study["title"], "family": study["family"],
        "description": study.get("description", ""), "run": run, "targets": targets, "baselines": baselines,
        "kernel_groups": next((d["groups"] for d in kernel_docs if d["status"] == "ok"), []),
        "bound": {"at_limit": threshold, "definition": bound.DEFINITION,
                  "f_bases": {t: sorted({r["f_basis"] for r in as_records(speed) if r.get("target") == t and r.get("f_basis")})
                              for t in targets}},
        "spec": spec_of(study),
        "checkpoints": [{k: c[k] for k in ("repo", "revision", "weights", "source")} for c in checkpoints],
        "samples": samples,
        "speed": as_records(speed), "quality": as_records(quality), "builds": as_records(builds),
        "kernels": as_records(kernels), "records": as_records(records), "references": references, "calibration": calibration,
        "timing_noise": noise, "devices": ran_on,
        "decision": decide(study, {"speed": speed, "quality": quality}, baselines, noise),
        "revisit": revisit(study, {"speed": speed, "quality": quality}, baselines, noise), "damaged": damaged,
        "published": published_rows,
        "published_from": None if published is None else {k: published[k] for k in ("file", "seed", "weights", "runs",
                                                                                      "tolerances", "differs", "left_out")}}
