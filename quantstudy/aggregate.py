"""Tidy tables of one study (pandas) and the decision computed from them.

Reads every per-variant JSON the workflow wrote; writes tables.json, the render's only input.
Each row keeps the path of the JSON it came from, so a rendered number can be traced back.
Nothing here knows a family: a family's metric blocks become columns named `block.metric`,
and the decision rule is a list of conditions over those columns (config `decision`).
"""

from __future__ import annotations

import logging
import math
import operator
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from quantstudy import artifacts, bound, compare, paths, timing
from quantstudy.artifacts import DamagedArtifact, now, provenance, read_json, sha256_file, write_json
from quantstudy.config import PUBLISHED_KEYS, UNIT_SCALE, calibration_sample_sets, load_published, shape_of
from quantstudy.study import REVISIT_SELECTORS, calibration_label
from quantstudy.families.base import measured_against
from quantstudy.render_formats import value_range

log = logging.getLogger("quantstudy")

IDENT = ("target", "model", "setting", "variant", "status")


def flatten(blocks: dict[str, dict[str, Any]], prefix: str = "") -> dict[str, Any]:
    """{block: {metric: v}} -> {"block.metric": v} (numbers, strings and None; lists are left out)."""
    return {f"{prefix}{block}.{metric}": v for block, metrics in blocks.items() for metric, v in metrics.items()
            if not isinstance(v, (list, dict))}


def _error(doc: dict[str, Any]) -> str | None:
    """A failed record's error as one line: the whole text of the exception that ended its traceback
    (a TensorRT builder error spans several lines, and the last one alone often names no cause)."""
    return exception_text(doc.get("error") or "")


def exception_text(error: str) -> str | None:
    """The final exception of a Python traceback (every line of its message), or the text as it is when
    it holds no traceback, joined into one line."""
    lines = error.strip().splitlines()
    # The last frame is "  File ..." followed by its indented source lines; the exception follows them
    # (or follows the "Traceback" heading, in a traceback cut short).
    frames = [i for i, line in enumerate(lines) if line.startswith(("  File ", "Traceback"))]
    if frames:
        i = frames[-1] + 1
        while i < len(lines) and lines[i].startswith("    "):
            i += 1
        lines = lines[i:]
    text = " ".join(line.strip() for line in lines if line.strip())
    return text or None


def _note_damaged(e: DamagedArtifact, kind: str, damaged: list[dict[str, str]]) -> None:
    log.error("%s", e)
    damaged.append({"source": e.path, "kind": kind, "error": str(e)})


def _readable(files: list[str], kind: str, damaged: list[dict[str, str]]) -> list[tuple[str, dict[str, Any]]]:
    """(path, doc) of the artifacts that read as `kind`; each one that does not goes to `damaged`."""
    docs = []
    for path in files:
        try:
            docs.append((path, read_json(path, kind)))
        except DamagedArtifact as e:
            _note_damaged(e, kind, damaged)
    return docs


def _rows(files: list[str], kind: str, flatten_doc: Callable[[dict], Iterable[dict]],
          damaged: list[dict[str, str]]) -> pd.DataFrame:
    """One or more rows per JSON (a row per graph where the JSON has graphs); a failed JSON is one
    row, and so is a damaged one (status "damaged"), which also goes to `damaged`."""
    rows = []
    for path in files:
        try:
            doc = read_json(path, kind)
        except DamagedArtifact as e:
            _note_damaged(e, kind, damaged)
            rows.append({**paths.variant_of(path), "status": "damaged", "error": e.problem, "source": path})
            continue
        base = {k: doc.get(k) for k in IDENT} | {"error": _error(doc), "source": path}
        if doc.get("status", "ok") == "ok":
            rows += [base | r for r in flatten_doc(doc)]
        else:
            rows.append(base)
    return pd.DataFrame(rows)


def _speed(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for graph, g in doc["graphs"].items():
        # x's interval from its paired rounds, resampled (compare.speedup_of); the spread between jobs is added
        # once the study's is known (_with_x_intervals)
        low, high = compare.speedup_of(g["baseline_ms"]["samples_ms"], g["variant_ms"]["samples_ms"]
                                       ).interval(compare.VERDICT_LEVEL)
        yield {"graph": graph, "repeat": doc.get("repeat", 1), "baseline": doc["baseline"], "batch": doc["batch"],
               **doc["shape"], "variant_ms": g["variant_ms"]["median_ms"], "variant_spread": g["variant_ms"]["spread"],
               "baseline_ms": g["baseline_ms"]["median_ms"], "x": g["x"], "x_min": g["x_min"], "x_max": g["x_max"],
               "x_rounds_low": low, "x_rounds_high": high}


def _per_engine(jobs: list[dict[str, Any]], combine: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
                ) -> list[dict[str, Any]]:
    """The rows of an engine's jobs (by target, model, setting and variant; its repeats) made into its
    table rows by `combine`. A failed or damaged job makes the engine's rows that failure, so a
    decision never rests on the jobs that happened to succeed."""
    by_engine: dict[tuple, list[dict[str, Any]]] = {}
    for row in jobs:
        by_engine.setdefault(tuple(row.get(k) for k in IDENT[:4]), []).append(row)
    rows = []
    for engine_rows in by_engine.values():
        rows += [r for r in engine_rows if r.get("status") != "ok"] or combine(engine_rows)
    return rows


def across_repeats(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One speed row per variant and graph from the rows of its timing jobs (`timing.repeats`).

    x is the median of the jobs' x (of two, their mean); baseline and variant ms the medians of
    the jobs' medians; x_min / x_max the range over every job's paired rounds. Across the jobs:
    x_by_repeat (in repeat order), x_jobs_min / x_jobs_max and x_jobs_spread = (max - min) / median
    of their x, measured only where two or more jobs timed the variant (else None); `source` is the
    first job's file, `timing_sources` every job's. A failed or damaged job makes the variant's row
    that failure (_per_engine).
    """
    def combine(variant_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        by_graph: dict[str, list[dict[str, Any]]] = {}
        for row in sorted(variant_rows, key=lambda r: r["repeat"]):
            by_graph.setdefault(row["graph"], []).append(row)
        rows = []
        for graph_rows in by_graph.values():
            xs = [r["x"] for r in graph_rows]
            measured = [x for x in xs if not _missing(x)]
            median = statistics.median(measured) if measured else None
            several = len(measured) > 1
            first = {k: v for k, v in graph_rows[0].items() if k != "repeat"}
            rows.append({**first, "repeats": len(graph_rows),
                         "variant_ms": statistics.median(r["variant_ms"] for r in graph_rows),
                         "variant_spread": statistics.median(r["variant_spread"] for r in graph_rows),
                         "baseline_ms": statistics.median(r["baseline_ms"] for r in graph_rows),
                         "x": median, "x_min": min(r["x_min"] for r in graph_rows),
                         # the widest of the jobs' rounds intervals, relative to each job's x, around the median
                         "x_rounds_low": _widest(median, graph_rows, "x_rounds_low", min),
                         "x_rounds_high": _widest(median, graph_rows, "x_rounds_high", max),
                         "x_max": max(r["x_max"] for r in graph_rows), "x_by_repeat": xs,
                         "x_jobs_min": min(measured) if several else None,
                         "x_jobs_max": max(measured) if several else None,
                         "x_jobs_spread": (max(measured) - min(measured)) / median if several and median else None,
                         "timing_sources": [r["source"] for r in graph_rows]})
        return rows

    return _per_engine(jobs, combine)


def _widest(x: float | None, rows: list[dict[str, Any]], end: str, pick: Callable) -> float | None:
    """One end of the widest of the jobs' rounds intervals of x, relative to each job's x, around `x`."""
    shares = [r[end] / r["x"] for r in rows if not _missing(r.get(end)) and not _missing(r.get("x"))]
    return x * pick(shares) if x and len(shares) == len(rows) else None


def _quality(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    nf = doc["nonfinite"]
    sets = {k: v for k, v in nf.items() if isinstance(v, dict)}
    build = doc.get("provenance", {}).get("inputs", {}).get("build", {}).get("path")  # the engine this job opened
    yield {"evaluation_repeat": doc.get("repeat", 1), "evaluation_build": build, **flatten(doc["blocks"]),
           "nonfinite": nf["total_bad"],
           **{f"nonfinite.{k}": v["bad"] for k, v in sets.items()}, **{f"nonfinite.{k}.of": v["of"] for k, v in sets.items()},
           "nonfinite_detail": sets, "intervals": intervals(doc["blocks"])}


def intervals(blocks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The intervals a quality job measured beside its metrics ({block: {"intervals": {metric: interval}}},
    metrics.mean_interval), by column: {"block.metric": {low, high, n, unit, method, level}}."""
    return {f"{block}.{metric}": interval for block, metrics in blocks.items()
            for metric, interval in (metrics.get("intervals") or {}).items() if interval}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def across_evaluations(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One quality row per engine from the rows of its evaluation jobs (`evaluation.repeats`).

    The values are the first job's; `evaluations` counts the jobs and `quality_sources` lists their
    files. Where two or more jobs measured it, each metric's range across them: `<metric>.jobs_min` and
    `<metric>.jobs_max` (a metric a job left non-finite or empty has none). Where the jobs opened separate
    builds of the engine (`evaluation.rebuild`), `quality_builds` lists the build.json each opened, in job
    order: the range is then build to build. A failed or damaged job makes the engine's row that failure
    (_per_engine).
    """
    def combine(engine_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ordered = sorted(engine_rows, key=lambda r: r["evaluation_repeat"])
        row = {k: v for k, v in ordered[0].items() if k not in ("evaluation_repeat", "evaluation_build")}
        row |= {"evaluations": len(ordered), "quality_sources": [r["source"] for r in ordered]}
        builds = [r.get("evaluation_build") for r in ordered]
        if len(set(builds)) > 1:
            row["quality_builds"] = builds
        if len(ordered) > 1:
            for column, value in list(row.items()):
                values = [r.get(column) for r in ordered]
                if _number(value) and all(_number(v) for v in values):
                    row[f"{column}.jobs_min"], row[f"{column}.jobs_max"] = min(values), max(values)
        return [row]

    # A failed job's row keeps the columns it had (evaluation_build is combine's alone).
    return [{k: v for k, v in r.items() if k != "evaluation_build"} for r in _per_engine(jobs, combine)]


def _build(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    # engine_bytes: every graph's engine together; engine_bytes.<graph>: each one's (a plan per engine).
    # microscaled_layers: NVFP4 / MXFP8 layers (`microscaling`), only where a build has some.
    micro = {"microscaled_layers": len(doc.get("microscaled_layers") or []), "microscaling_format": doc.get("microscaling_format")}
    yield {"engine_bytes": doc.get("engine_bytes"), "fp8_layers": len(doc.get("fp8_layers") or []),
           "precision": doc.get("precision"), "dequantize_dtype": doc.get("dequantize_dtype"),
           **(micro if doc.get("microscaled_layers") else {}),
           **{f"engine_bytes.{g}": e.get("engine_bytes") for g, e in (doc.get("graphs") or {}).items()}}


def _joined(values: list[str] | str) -> str:
    return values if isinstance(values, str) else ", ".join(values)


def _record(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """A measurements record's recipe as built, per graph: dtypes, FP8 layer count, opset, Q/DQ ops."""
    for graph, g in doc["graphs"].items():
        fp8, linear = g["layers"]["fp8_linear"], g["layers"]["linear"]
        onnx = doc["onnx"][graph] if isinstance(doc["onnx"], dict) else None
        qdq = {op: onnx[op] for op in ("QuantizeLinear", "DequantizeLinear")} if onnx else {}
        yield {"graph": graph, "backend_version": doc["backend"]["version"], "precision": doc["precision"],
               "fp8_layers": doc["fp8_layers"]["count"],
               "fp8_weight": fp8 if isinstance(fp8, str) else _joined(fp8["weight"]),
               "fp8_activation": fp8 if isinstance(fp8, str) else _joined(fp8["activation"]),
               "dequantized_to": fp8 if isinstance(fp8, str) else _joined(fp8["dequantized_to"]),
               "linear_layers": 0 if isinstance(linear, str) else linear["layers"],
               "linear_weight": linear if isinstance(linear, str) else _joined(linear["weight"]),
               "opset": onnx["opset"] if onnx else None, "onnx": "exported" if onnx else doc["onnx"],
               "quantize_ops": qdq["QuantizeLinear"]["count"] if onnx else None,
               "dequantize_ops": qdq["DequantizeLinear"]["count"] if onnx else None,
               "qdq_types": {op: q["output_types"] for op, q in qdq.items()},
               "fp8_path": doc["fp8_path"], "amax_sha256": doc["amax"] if isinstance(doc["amax"], str) else doc["amax"]["sha256"]}


def _kernels(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for graph, g in doc["graphs"].items():
        yield {"graph": graph, "groups_ms": g["groups_ms"], "groups_count": g.get("groups_count"),
               "total_ms": g["total_ms"]}


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: (None if (not isinstance(v, (dict, list)) and pd.isna(v)) else v) for k, v in r.items()}
            for r in frame.to_dict("records")]


def sample_lists(docs: list[tuple[str, dict[str, Any]]], study: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per sample list the study reads: what it is used for, how many samples it holds (as
    drawn, which may be fewer than the config asks for), where from, and the sha256 of the file."""
    calibration, evaluation = calibration_sample_sets(study["recipe"]), study["evaluation_samples"]
    rows = []
    for path, doc in docs:
        name = Path(path).stem
        used_for = [role for role, names in (("calibration", calibration), ("evaluation", evaluation)) if name in names]
        rows.append({"name": name, "used_for": used_for, "kind": doc["kind"], "count": len(doc["samples"]),
                     "dataset": doc["repo"], "revision": doc["revision"], "split": doc["split"],
                     "sha256": sha256_file(path), "source": path})
    return rows


BOUND_COLUMNS = ("f", "g", "bound", "x_of_bound", "at_limit", "f_kind", "f_basis", "fp8_emulated", "bound_note",
                 "f_source", "g_source")


def _error_text(doc: dict[str, Any]) -> str:
    return _error(doc) or "no error text"


def _bound(row: dict[str, Any], gemms: dict[tuple, tuple[str, dict | None]], kernels: dict[tuple, tuple[str, dict]],
           baseline: str, threshold: float, profiles: dict[tuple, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Amdahl bound of one speed row (bound.py): f from its baseline's kernels.json, g from the
    gemm.json of its target, model and setting; where either is missing or failed, or the baseline's
    profile disagrees with its timing (`profiles`: kernels rows by target, model, setting, graph and
    variant, as _with_timed judged them), `bound_note` says why."""
    out: dict[str, Any] = dict.fromkeys(BOUND_COLUMNS)
    key = (row["target"], row["model"], row["setting"])
    if key not in gemms:
        return out | {"bound_note": "no FP8 layer"}
    gemm_path, gemm_doc = gemms[key]
    out["g_source"] = gemm_path
    if gemm_doc is None:
        return out | {"bound_note": f"{gemm_path} could not be read"}
    if gemm_doc["status"] != "ok":
        if row["variant"] not in gemm_doc["provenance"]["params"].get("specs", {}):
            return out | {"bound_note": "no FP8 layer"}
        return out | {"bound_note": f"GEMM timing failed: {_error_text(gemm_doc)}"}
    graphs = gemm_doc["graphs"]
    graph = row.get("graph") if row.get("graph") in graphs else (next(iter(graphs)) if len(graphs) == 1 else None)
    if graph is None:
        return out | {"bound_note": "no graph was timed"}
    if row["variant"] not in graphs[graph]["variants"]:
        return out | {"bound_note": "no FP8 layer"}
    measured = graphs[graph]["variants"][row["variant"]]
    if measured["status"] != "ok":
        return out | {"bound_note": f"GEMM timing failed: {_error_text(measured)}"}
    if not measured["calls"]:
        return out | {"f": 0.0, "bound": 1.0, "f_kind": "exact", "bound_note": "no FP8 GEMM runs in this graph"}
    out.update(g=measured["g"], fp8_emulated=measured["emulated"])
    kernel_path, kernel_doc = kernels.get(key + (baseline,), (None, None))
    if kernel_doc is None:
        return out | {"bound_note": f"no readable profile of the baseline {baseline}"}
    out["f_source"] = kernel_path
    if kernel_doc["status"] != "ok":
        return out | {"bound_note": f"profile of the baseline {baseline} failed: {_error_text(kernel_doc)}"}
    if graph not in kernel_doc["graphs"]:
        return out | {"bound_note": f"the baseline's profile has no graph {graph}"}
    judged = (profiles or {}).get(key + (graph, baseline))
    if judged and judged.get("profile_agrees") is False:
        return out | {"bound_note": f"withheld: the baseline's profile totals {judged['total_ms']:.3g} ms a call, "
                                    f"{judged['profile_vs_timed']:.2g} x the {judged['timed_ms']:.3g} ms its "
                                    f"timing measured"}
    try:
        share = bound.recipe_share(kernel_doc["graphs"][graph], measured["calls"])
    except ValueError as e:
        return out | {"bound_note": f"f not computed: {e}"}
    out.update(f=share["f"], f_kind=share["kind"], f_basis=share["basis"], bound=bound.amdahl_bound(share["f"], out["g"]))
    x = row.get("x")
    if not _missing(x):
        out.update(x_of_bound=x / out["bound"], at_limit=bound.at_limit(x, out["bound"], threshold))
    return out


def _with_bounds(speed: pd.DataFrame, gemms: dict, kernels: dict, baselines: dict[str, str],
                 threshold: float, profiles: dict[tuple, dict[str, Any]]) -> pd.DataFrame:
    bounds = [_bound(r, gemms, kernels, baselines[r["setting"]], threshold, profiles) for r in _records(speed)]
    return pd.concat([speed, pd.DataFrame(bounds, index=speed.index, columns=list(BOUND_COLUMNS))], axis=1)


def _with_x_intervals(speed: pd.DataFrame, noise: dict[str, Any]) -> pd.DataFrame:
    """Each row's interval of x (`x_low`, `x_high`): its rounds' (resampled) and the study's spread between
    jobs (timing.timing_noise) over the row's jobs, combined (compare.combined_interval)."""
    def interval(r: dict[str, Any]) -> tuple[float | None, float | None]:
        if r.get("status") != "ok" or _missing(r.get("x")) or _missing(r.get("x_rounds_low")):
            return None, None
        return compare.combined_interval(r["x"], (r["x_rounds_low"], r["x_rounds_high"]), between_jobs=noise["x"],
                                         jobs=int(r.get("repeats") or 1))
    ends = [interval(r) for r in _records(speed)]
    return speed.assign(x_low=[lo for lo, _ in ends], x_high=[hi for _, hi in ends])


def _with_timed(kernels: pd.DataFrame, speed: pd.DataFrame, baselines: dict[str, str], candidate: str) -> pd.DataFrame:
    """Beside each profile, the timed median of the same call (target, model, setting, graph, variant:
    its own timing row; a baseline's, the one timed beside the candidate, which the speed table shows) and
    whether the two agree (bound.profile_agrees): a profile that does not is no split of the timed call, and
    what is read from it is withheld."""
    timed = {}
    for r in _records(speed) if len(speed) else []:
        if r["status"] == "ok":
            where = (r["target"], r["model"], r["setting"], r.get("graph") or "main")
            timed.setdefault((*where, r["variant"]), r.get("variant_ms"))
            if r["variant"] == candidate and not _missing(r.get("baseline_ms")):  # one time per baseline engine: the candidate's pair
                timed[(*where, baselines.get(r["setting"]))] = r.get("baseline_ms")
    rows = []
    for r in _records(kernels):
        ms = timed.get((r["target"], r["model"], r["setting"], r.get("graph") or "main", r["variant"]))
        ratio = bound.profile_vs_timed(r.get("total_ms"), ms) if r["status"] == "ok" else None
        rows.append({"timed_ms": ms, "profile_vs_timed": ratio,
                     "profile_agrees": None if ratio is None else bound.profile_agrees(ratio)})
    return pd.concat([kernels, pd.DataFrame(rows, index=kernels.index)], axis=1)


COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
REDUCE = {"min": min, "max": max, "sum": sum, "mean": lambda v: sum(v) / len(v)}


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def condition(spec: dict[str, Any], rows: pd.DataFrame, noise: dict[str, Any] | None = None) -> dict[str, Any]:
    """One decision condition over the candidate's rows of a table: reduce a column, compare.

    A condition with no rows, or with a row whose value is missing (not measured, NaN), is not
    met: a rule cannot pass on what was not measured. For min and max the observed value shown
    is the range over all rows; for sum and mean the reduced number.
    """
    for key, value in (spec.get("rows") or {}).items():
        rows = rows[rows[key] == value] if key in rows else rows.iloc[0:0]
    rows = rows[rows.status == "ok"] if "status" in rows else rows
    column = spec["column"]
    values = list(rows[column]) if column in rows and len(rows) else []
    missing = sum(map(_missing, values))
    present = [v for v in values if not _missing(v)]
    reduced = REDUCE[spec["reduce"]](present) if present else None
    if spec["reduce"] in ("min", "max"):
        observed = value_range(present)
    else:
        observed = None if reduced is None else (int(reduced) if float(reduced).is_integer() else reduced)
    met = reduced is not None and not missing and COMPARE[spec["compare"]](reduced, spec["threshold"])
    note = f"{missing} of {len(values)} rows not measured" if missing else ("no rows" if not values else "")
    threshold = spec["threshold"]
    return {"name": spec["name"], "column": column, "reduce": spec["reduce"], "compare": spec["compare"],
            "observed": observed, "threshold": int(threshold) if float(threshold).is_integer() else threshold,
            "pass": bool(met), "note": note, "rows": dict(spec.get("rows") or {}), "n": len(present),
            "basis": spec.get("basis"), "samples": spec.get("samples"), "units": spec.get("units"),
            "table": spec["table"],
            **_uncertainty(spec, [r for r in _records(rows) if not _missing(r.get(column))] if column in rows else [],
                           bool(met), bool(missing) or not present, noise)}


def _row_interval(spec: dict[str, Any], row: dict[str, Any]) -> tuple[tuple[float, float] | None, str | None]:
    """A row's interval of the condition's column (compare.VERDICT_LEVEL) and what it is made of: x from its
    rounds and the spread between jobs; a rate over `n` samples (the condition's `n` column): Wilson."""
    if spec["column"] == "x" and not _missing(row.get("x_low")):
        return (row["x_low"], row["x_high"]), "rounds and jobs"
    if spec.get("n") and not _missing(row.get(spec["n"])) and row[spec["n"]] > 0:
        n = int(row[spec["n"]])
        return compare.wilson(round(row[spec["column"]] * n), n, compare.VERDICT_LEVEL), f"Wilson, n = {n}"
    measured = row["intervals"].get(spec["column"]) if isinstance(row.get("intervals"), dict) else None
    if measured:
        return (measured["low"], measured["high"]), f"bootstrap over {measured['n']} {measured['unit']}"
    return None, None


def _uncertainty(spec: dict[str, Any], rows: list[dict[str, Any]], met: bool, unmeasured: bool,
                 noise: dict[str, Any] | None) -> dict[str, Any]:
    """Whether this run resolves the condition: every row's interval on the threshold's one side ("met" /
    "not met"), or one straddling it ("within the noise"; how many samples or timing jobs would resolve it).
    Sums and means of counts are exact; a column with no interval (a maximum, a percentile) is judged
    on its values, and says so (`interval_kind` None)."""
    exact = {"resolved": "met" if met else "not met", "interval": None, "interval_kind": None, "to_resolve": None}
    if unmeasured or spec["reduce"] not in ("min", "max"):
        return exact
    judged = [(r, *_row_interval(spec, r)) for r in rows]
    if any(interval is None for _, interval, _ in judged):
        return exact
    op, threshold = spec["compare"], spec["threshold"]
    states = [compare.against_threshold(r[spec["column"]], interval, op, threshold) for r, interval, _ in judged]
    resolved = "not met" if "not met" in states else "within the noise" if "within the noise" in states else "met"
    to_resolve = None
    if resolved == "within the noise":
        straddling = [r for (r, _, _), state in zip(judged, states) if state == "within the noise"]
        if spec["column"] == "x":
            counts = [compare.jobs_to_resolve(r["x"], (r["x_rounds_low"], r["x_rounds_high"]), (noise or {}).get("x", 0.0),
                                              threshold) for r in straddling]
            unit, otherwise = "timing jobs a row", "more rounds a job first (its rounds alone straddle the threshold)"
        elif spec.get("n"):
            counts = [compare.samples_to_resolve(r[spec["column"]], int(r[spec["n"]]), threshold) for r in straddling]
            unit, otherwise = "samples a row", "no number of samples (a row sits on the threshold)"
        else:
            measured = [r["intervals"][spec["column"]] for r in straddling]
            counts = [compare.units_to_resolve(r[spec["column"]], (m["low"], m["high"]), m["n"], threshold)
                      for r, m in zip(straddling, measured)]
            unit, otherwise = f"{measured[0]['unit']} a row", "no number of samples (a row sits on the threshold)"
        to_resolve = otherwise if None in counts else f"{max(counts)} {unit}"
    return {"resolved": resolved, "interval": {"min": min(i[0] for _, i, _ in judged), "max": max(i[1] for _, i, _ in judged)},
            "interval_kind": judged[0][2].split(",")[0] if judged else None, "to_resolve": to_resolve}


# What makes two rows of a table the same measurement of two variants.
ROW_KEYS = ("target", "model", "setting", "graph")


def relative(frame: pd.DataFrame, column: str, other: str, candidate: str) -> pd.DataFrame:
    """The candidate's rows with a column `<column> / <other>`: each row's value over the value of
    variant `other` on the same target, model, setting (and graph); missing (NaN) where `other` has
    no ok row there, so a condition on it is not met."""
    keys = [k for k in ROW_KEYS if k in frame]
    theirs = frame[frame.variant == other]
    theirs = theirs[theirs.status == "ok"] if "status" in theirs else theirs
    theirs = theirs[keys + [column]].rename(columns={column: "_other"}) if column in theirs else None
    if theirs is not None and "intervals" in frame:
        theirs["_other_intervals"] = frame.loc[theirs.index, "intervals"]
    mine = frame[frame.variant == candidate]
    if theirs is None or column not in mine:
        return mine.iloc[0:0]
    joined = mine.merge(theirs, on=keys, how="left")
    ratio = f"{column} / {other}"
    joined[ratio] = joined[column] / joined["_other"]
    if "_other_intervals" in joined:
        known = lambda v: v if isinstance(v, dict) else {}  # a row with no intervals holds NaN there
        joined["intervals"] = [{**known(m), ratio: _ratio_interval(r[column], r["_other"], known(m).get(column),
                                                                   known(t).get(column))}
                               for r, m, t in zip(_records(joined), joined["intervals"], joined["_other_intervals"])]
    return joined.drop(columns=[c for c in ("_other", "_other_intervals") if c in joined])


def _ratio_interval(a: float, b: float, of_a: dict[str, Any] | None, of_b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The interval of a / b from the intervals of a and of b, taken as independent (their half-widths add in
    quadrature in log space): wider than a paired resample of two engines on the same samples would give,
    so a ratio it calls resolved is. None where either has no interval or one is not positive."""
    if of_a is None or of_b is None or _missing(a) or _missing(b) or min(a, b, of_a["low"], of_b["low"]) <= 0:
        return None
    r = a / b
    low, high = compare.combined_interval(r, (r * of_a["low"] / a, r * of_a["high"] / a),
                                          (r * b / of_b["high"], r * b / of_b["low"]), level=of_a["level"])
    return {"low": low, "high": high, "n": min(of_a["n"], of_b["n"]), "unit": of_a["unit"],
            "method": "bootstrap of each, combined", "level": of_a["level"]}


def with_ratio(frame: pd.DataFrame, column: str, other: str) -> pd.DataFrame:
    """Every row with the column `<column> / <other>` that `relative` gives the candidate's: its value over
    variant `other`'s on the same row key, on every variant's row (NaN where `other` has no ok row). A
    published ratio (a write-up's "KL 8 times the floor") is compared with it, and `audit chain` traces it."""
    if column not in frame or not len(frame):
        return frame
    keys = [k for k in ROW_KEYS if k in frame]
    theirs = frame[(frame.variant == other) & (frame.status == "ok" if "status" in frame else True)]
    theirs = theirs[keys + [column]].drop_duplicates(keys).rename(columns={column: "_other"})
    joined = frame.merge(theirs, on=keys, how="left")
    frame = frame.copy()
    frame[f"{column} / {other}"] = (joined[column] / joined["_other"]).to_numpy()
    return frame


def decide(study: dict[str, Any], tables: dict[str, pd.DataFrame], baselines: dict[str, str],
           noise: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apply the study's decision rule to the candidate variant's rows; every condition is shown.

    A condition with `relative_to: <variant>` compares each candidate row's value over that
    variant's on the same row (`relative`): "KL at most 10 x the fp16 engine's". Beyond the study's
    conditions, every measurement of the candidate must have succeeded.

    A quality condition is also applied to each setting's baseline (`baseline`: what it observes
    and whether the baseline would meet it), so that a bar the baseline misses as well is seen as
    the bar's, not the candidate's. A speed condition has none: x is measured against the baseline;
    nor has a column measured against the baseline's own engine (`quality_against`).
    """
    cand = study["candidate"]
    mine = {name: frame[frame.variant == cand] if "variant" in frame else frame for name, frame in tables.items()}
    conditions = []
    for c in study["decision"]["conditions"]:
        if "relative_to" in c:
            column = f"{c['column']} / {c['relative_to']}"
            result = condition({**c, "column": column}, relative(tables[c["table"]], c["column"], c["relative_to"], cand))
            conditions.append({**result, "relative_to": c["relative_to"], "baseline": None})
            continue
        result = condition(c, mine[c["table"]], noise)
        frame = tables[c["table"]]
        result["baseline"] = None
        if c["table"] == "quality" and len(frame):
            # Not on the engine the column is measured against: it has no value in it, by design.
            reference = measured_against(c["column"], study.get("quality_against") or [])
            theirs = frame[(frame.variant == frame.setting.map(baselines)) & (frame.variant != reference)]
            if len(theirs):
                base = condition(c, theirs)
                result["baseline"] = {"variants": sorted(set(theirs.variant)), "observed": base["observed"],
                                      "n": base["n"], "pass": base["pass"]}
        conditions.append(result)
    failed = [src for f in mine.values() if "status" in f for src in f[f.status != "ok"].source]
    if failed:
        conditions.append({"name": "every measurement of the candidate succeeded", "observed": len(failed),
                           "threshold": 0, "pass": False, "note": "failed: " + ", ".join(sorted(set(failed))),
                           "basis": "every study: a candidate with a failed measurement is not judged on the rest",
                           "baseline": None, "n": len(failed), "samples": None, "rows": {}, "resolved": "not met",
                           "interval": None, "interval_kind": None, "to_resolve": None})
    return {"candidate": cand, "ship": all(c["pass"] for c in conditions), "conditions": conditions,
            # the conditions this run cannot resolve: the verdict rests on their measured values alone
            "within_noise": [c["name"] for c in conditions if c.get("resolved") == "within the noise"]}



def revisit_variants(study: dict[str, Any], names: list[str]) -> list[str]:
    """The variants a revisit check looks at: each name, a selector (REVISIT_SELECTORS) as its variants."""
    chosen = []
    for name in names:
        selector = REVISIT_SELECTORS.get(name)
        chosen += [v for v, spec in study["variants"].items() if selector(spec)] if selector else [name]
    return list(dict.fromkeys(chosen))


def revisit(study: dict[str, Any], tables: dict[str, pd.DataFrame], baselines: dict[str, str],
            noise: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each "revisit when" of the write-up (`revisit` in the study config), checked: the decision
    condition it names, applied to each variant it names as if that were the candidate (decide, with
    the check's own `rows` where it gives them). Met where a variant meets it beyond the noise, within
    the noise where one straddles the bar, not met where every variant misses it, and not measurable
    where none of the variants ran, or where the check needs what no run here has (`not_measurable`)."""
    checks = []
    for entry in study.get("revisit") or []:
        check = {"when": entry["when"], "variants": []}
        if "not_measurable" in entry:
            checks.append({**check, "verdict": "not measurable in this run", "reason": entry["not_measurable"]})
            continue
        spec = next(c for c in study["decision"]["conditions"] if c["name"] == entry["condition"])
        spec = {**spec, "rows": entry["rows"]} if "rows" in entry else spec
        frame = tables[spec["table"]]
        for v in revisit_variants(study, entry["variants"]):
            if len(frame) and (frame.variant == v).any():
                d = decide({**study, "candidate": v, "decision": {"conditions": [spec]}}, tables, baselines, noise)
                if d["conditions"][0]["note"] == "no rows" and len(d["conditions"]) == 1:
                    continue  # it ran, but not on these rows (a setting this run leaves out)
                check["variants"].append({"variant": v, "met": d["ship"], "condition": d["conditions"][0],
                                          "failed": d["conditions"][1]["note"] if len(d["conditions"]) > 1 else None})
        resolved = [v["condition"].get("resolved") for v in check["variants"]]
        if not check["variants"]:
            verdict, reason = "not measurable in this run", (
                f"none of {', '.join(entry['variants'])} ran in this run" + (f" on rows {spec['rows']}" if spec.get("rows") else ""))
        elif any(v["met"] and r == "met" for v, r in zip(check["variants"], resolved)):
            verdict, reason = "met", None
        elif "within the noise" in resolved:
            verdict, reason = "within the noise of this run", None
        else:
            verdict, reason = "not met", None
        checks.append({**check, "condition": spec["name"], "rows": dict(spec.get("rows") or {}), "verdict": verdict,
                       "reason": reason})
    return checks


def _cell(row: dict[str, Any], column: str) -> Any:
    """A row's value of `column`, or of `a.b` where the row has a dict column `a` (groups_ms.<group>)."""
    if column in row:
        return row[column]
    head, _, key = column.partition(".")
    return row[head].get(key) if isinstance(row.get(head), dict) else None


def _beyond(difference: float, published: float, tolerance: dict[str, float]) -> bool:
    bound = tolerance["absolute"] if "absolute" in tolerance else tolerance["relative"] * abs(published)
    return abs(difference) > bound + 1e-9 * max(1.0, abs(published))  # a printed 1.05 vs 1.07 is 0.02, not more


def _reproducing_rows(entry: dict[str, Any], rows: list[dict[str, Any]], weights: str, published_weights: str,
                      run_targets: Iterable[str]) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of this run's table that reproduce a published number, or why there are none."""
    if weights != published_weights:
        return [], f"this run's weights are {weights}, not the write-up's ({published_weights})"
    keys = {k: [entry[k]] if isinstance(entry[k], str) else entry[k] for k in PUBLISHED_KEYS if entry[k] is not None}
    missing = [t for t in keys.get("target", []) if t not in run_targets]
    if missing:
        return [], f"target {', '.join(missing)} is not in this run"
    matched = [r for r in rows if all(r.get(k) in names for k, names in keys.items())]
    absent = [f"{k} {n}" for k, names in keys.items() for n in names if not any(r.get(k) == n for r in matched)]
    if absent:
        return [], f"no row of {', '.join(absent)} in this run"
    return matched, None


def compare_published(published: dict[str, Any], tables: dict[str, list[dict[str, Any]]], weights: str,
                      run_targets: Iterable[str]) -> list[dict[str, Any]]:
    """Each published number beside the value this run measured on its row(s): both as ranges in the
    write-up's units (one row and one printed number: min = max), their difference per end, and
    whether it is beyond the file's tolerance for its kind. A number this run cannot reproduce says why."""
    out = []
    for e in published["entries"]:
        row = {"table": e["table"], "column": e["column"], **{k: e[k] for k in PUBLISHED_KEYS},
               "units": e["units"], "kind": e["kind"], **{f"tolerance_{k}": v for k, v in e["tolerance"].items()},
               "printed": e["printed"], "published_min": e["min"], "published_max": e["max"], "note": e["note"],
               "differs": [d["how"] for d in published.get("differs", []) if e["column"] in d["columns"]],
               "published_source": e["source"], "source": None, "reproduced_from": [],
               "sources": {"published_min": published["file"], "published_max": published["file"]},
               "status": "not reproduced here", "reason": None, "reproduced_min": None, "reproduced_max": None,
               "difference_min": None, "difference_max": None, "beyond_tolerance": None}
        matched, reason = _reproducing_rows(e, tables[e["table"]], weights, published["weights"], run_targets)
        row["reason"] = reason
        if matched:
            row["reproduced_from"] = [r["source"] for r in matched]
            row["source"] = matched[0]["source"] if len(matched) == 1 else None
            failed = [r for r in matched if r.get("status", "ok") != "ok"]
            values = [_cell(r, e["column"]) for r in matched]
            measured = value_range(v * UNIT_SCALE.get(e["units"], 1.0) for v in values if v is not None)
            if failed:
                row.update(status="failed here", reason="; ".join(sorted({f"{r['source']}: {r.get('error')}" for r in failed})))
            elif measured is None or measured["n"] < len(values):  # a NaN metric (fp16 at 512) is not a value
                row.update(status="not measured here",
                           reason=f"{len(values) - (measured or {'n': 0})['n']} of {len(values)} rows have no value of {e['column']}")
            else:
                d_min, d_max = measured["min"] - e["min"], measured["max"] - e["max"]
                row.update(status="reproduced", reproduced_min=measured["min"], reproduced_max=measured["max"],
                           difference_min=d_min, difference_max=d_max,
                           beyond_tolerance=_beyond(d_min, e["min"], e["tolerance"]) or _beyond(d_max, e["max"], e["tolerance"]))
        out.append(row)
    return out



def calibration_row(amax: dict[str, Any], study: dict[str, Any]) -> dict[str, Any]:
    """One amax file as a row: its method ("recipe": the recipe's own; "variants": those that name it), and
    its layers and outliers, or why the method failed."""
    recipe_method = {"method": study["recipe"]["activation_calibration"]["algorithm"]}
    method = amax["calibration"].get("method") or recipe_method
    row = {"model": amax["model"], "setting": amax["setting"], "method": calibration_label(method),
           "recipe": method == recipe_method,
           "variants": [n for n, v in study["variants"].items() if v.get("calibration") == method],
           "status": amax.get("status", "ok"), "samples": amax["calibration"]["samples"], "source": amax["source"]}
    if row["status"] != "ok":
        return {**row, "error": artifacts.error_summary(amax["error"])}
    changed = amax["calibration"].get("changed_from_max")
    if changed is not None:  # the recipe's layers whose amax the method moved from max calibration's
        row["changed_from_max"] = {k: len(set(v) & set(amax["recipe_layers"])) for k, v in changed.items()}
    return {**row, **amax["shape"], "layers": len(amax["recipe_layers"]),
            "largest_ratio": amax["outliers"]["largest_ratio"], "outliers": amax["outliers"]["layers"],
            "ratio": amax["outliers"]["ratio"]}

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


def reference_rows(paths: list[str], settings: dict[str, dict[str, int]], damaged: list[dict[str, str]]) -> list[dict]:
    """One row per reference.json: its model, setting (and the setting's shape), the dtype the file records
    the reference ran in (the Method names it, never a default), its metrics' columns and its path."""
    return [{"model": r["model"], "setting": r["setting"], **settings[r["setting"]], "dtype": r.get("dtype"),
             **flatten(r["blocks"]), "source": p} for p, r in _readable(paths, "reference", damaged)]


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
    speed = pd.DataFrame(across_repeats(_records(_rows(inputs["timings"], "timing", _speed, damaged))))
    quality = pd.DataFrame(across_evaluations(_records(_rows(inputs["qualities"], "quality", _quality, damaged))))
    builds = _rows(inputs["builds"], "build", _build, damaged)
    kernels = _rows(inputs["kernels"], "kernels", _kernels, damaged)
    records = _rows(inputs["records"], "measurements", _record, damaged)
    kernel_files = _readable(inputs["kernels"], "kernels", [])
    kernel_docs = [doc for _, doc in kernel_files]
    settings = {name: shape_of(s) for name, s in study["settings"].items()}
    references = reference_rows(inputs["references"], settings, damaged)
    amax = [a | {"source": p} for p, a in _readable(inputs["amax"], "amax", damaged)]
    checkpoints = [c | {"source": p} for p, c in _readable(inputs["checkpoints"], "checkpoint", damaged)]
    samples = sample_lists(_readable(inputs["samples"], "samples", damaged), study)
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
            _note_damaged(e, "gemm", damaged)
            gemms[paths.setting_of(path)] = (path, None)
    threshold = (study.get("bound") or {}).get("at_limit", bound.AT_LIMIT)
    if len(kernels):
        kernels = _with_timed(kernels, speed, baselines, study["candidate"])
    # One judgement per profile: the kernel table's and the bound's.
    profiles = {(r["target"], r["model"], r["setting"], r.get("graph") or "main", r["variant"]): r
                for r in _records(kernels)} if len(kernels) else {}
    noise = timing.timing_noise([doc for _, doc in _readable(inputs["timings"], "timing", [])])
    # The devices the jobs that built, timed, profiled and evaluated the engines ran on, as their JSONs record.
    ran_on = artifacts.devices(doc for kind, schema in (("builds", "build"), ("timings", "timing"),
                                                        ("kernels", "kernels"), ("qualities", "quality"))
                               for _, doc in _readable(inputs[kind], schema, []))
    if len(speed):
        speed = _with_x_intervals(speed, noise)
        speed = _with_bounds(speed, gemms, {(d["target"], d["model"], d["setting"], d["variant"]): (p, d)
                                            for p, d in kernel_files}, baselines, threshold, profiles)
    log.info("%d timing, %d quality, %d build, %d kernel rows", len(speed), len(quality), len(builds), len(kernels))
    calibration = [calibration_row(a, study) for a in amax]
    published = load_published(inputs["published"][0]) if inputs.get("published") else None
    published_rows = [] if published is None else compare_published(
        published, {"speed": _records(speed), "quality": _records(quality), "builds": _records(builds),
                    "kernels": _records(kernels), "references": references}, run["weights"], targets)
    return {
        "study": study["study"], "title": study["title"], "family": study["family"],
        "description": study.get("description", ""), "run": run, "targets": targets, "baselines": baselines,
        "kernel_groups": next((d["groups"] for d in kernel_docs if d["status"] == "ok"), []),
        "bound": {"at_limit": threshold, "definition": bound.DEFINITION,
                  "f_bases": {t: sorted({r["f_basis"] for r in _records(speed) if r.get("target") == t and r.get("f_basis")})
                              for t in targets}},
        "spec": spec_of(study),
        "checkpoints": [{k: c[k] for k in ("repo", "revision", "weights", "source")} for c in checkpoints],
        "samples": samples,
        "speed": _records(speed), "quality": _records(quality), "builds": _records(builds),
        "kernels": _records(kernels), "records": _records(records), "references": references, "calibration": calibration,
        "timing_noise": noise, "devices": ran_on,
        "decision": decide(study, {"speed": speed, "quality": quality}, baselines, noise),
        "revisit": revisit(study, {"speed": speed, "quality": quality}, baselines, noise), "damaged": damaged,
        "published": published_rows,
        "published_from": None if published is None else {k: published[k] for k in ("file", "seed", "weights", "runs",
                                                                                      "tolerances", "differs", "left_out")}}
