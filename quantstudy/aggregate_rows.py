"""The rows of aggregate's tables, each kind of artifact read into its own (aggregate.tables puts them together).

A timing, quality, build, kernels or measurements JSON becomes one row or more (a row per graph); a
failed one is one row with its error, and a damaged one a row of status "damaged" that also goes to
the study's `damaged` list. Several jobs of one engine (timing and evaluation repeats) make its one row
(across_repeats, across_evaluations). Reference, sample-list and amax files make rows of their own.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from quantstudy import artifacts, compare, paths
from quantstudy.artifacts import DamagedArtifact, read_json, sha256_file
from quantstudy.config import calibration_sample_sets
from quantstudy.study_values import calibration_label

log = logging.getLogger("quantstudy")

IDENT = ("target", "model", "setting", "variant", "status")


def flatten(blocks: dict[str, dict[str, Any]], prefix: str = "") -> dict[str, Any]:
    """{block: {metric: v}} -> {"block.metric": v} (numbers, strings and None; lists are left out)."""
    return {f"{prefix}{block}.{metric}": v for block, metrics in blocks.items() for metric, v in metrics.items()
            if not isinstance(v, (list, dict))}


def error_of(doc: dict[str, Any]) -> str | None:
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


def note_damaged(e: DamagedArtifact, kind: str, damaged: list[dict[str, str]]) -> None:
    log.error("%s", e)
    damaged.append({"source": e.path, "kind": kind, "error": str(e)})


def readable(files: list[str], kind: str, damaged: list[dict[str, str]]) -> list[tuple[str, dict[str, Any]]]:
    """(path, doc) of the artifacts that read as `kind`; each one that does not goes to `damaged`."""
    docs = []
    for path in files:
        try:
            docs.append((path, read_json(path, kind)))
        except DamagedArtifact as e:
            note_damaged(e, kind, damaged)
    return docs


def rows_of(files: list[str], kind: str, flatten_doc: Callable[[dict], Iterable[dict]],
          damaged: list[dict[str, str]]) -> pd.DataFrame:
    """One or more rows per JSON (a row per graph where the JSON has graphs); a failed JSON is one
    row, and so is a damaged one (status "damaged"), which also goes to `damaged`."""
    rows = []
    for path in files:
        try:
            doc = read_json(path, kind)
        except DamagedArtifact as e:
            note_damaged(e, kind, damaged)
            rows.append({**paths.variant_of(path), "status": "damaged", "error": e.problem, "source": path})
            continue
        base = {k: doc.get(k) for k in IDENT} | {"error": error_of(doc), "source": path}
        if doc.get("status", "ok") == "ok":
            rows += [base | r for r in flatten_doc(doc)]
        else:
            rows.append(base)
    return pd.DataFrame(rows)


def speed_rows(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
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
            measured = [x for x in xs if not is_missing(x)]
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
    shares = [r[end] / r["x"] for r in rows if not is_missing(r.get(end)) and not is_missing(r.get("x"))]
    return x * pick(shares) if x and len(shares) == len(rows) else None


def quality_rows(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
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


def build_rows(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    # engine_bytes: every graph's engine together; engine_bytes.<graph>: each one's (a plan per engine).
    # microscaled_layers: NVFP4 / MXFP8 layers (`microscaling`), only where a build has some.
    micro = {"microscaled_layers": len(doc.get("microscaled_layers") or []), "microscaling_format": doc.get("microscaling_format")}
    yield {"engine_bytes": doc.get("engine_bytes"), "fp8_layers": len(doc.get("fp8_layers") or []),
           "precision": doc.get("precision"), "dequantize_dtype": doc.get("dequantize_dtype"),
           **(micro if doc.get("microscaled_layers") else {}),
           **{f"engine_bytes.{g}": e.get("engine_bytes") for g, e in (doc.get("graphs") or {}).items()}}


def _joined(values: list[str] | str) -> str:
    return values if isinstance(values, str) else ", ".join(values)


def record_rows(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
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


def kernel_rows(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for graph, g in doc["graphs"].items():
        yield {"graph": graph, "groups_ms": g["groups_ms"], "groups_count": g.get("groups_count"),
               "total_ms": g["total_ms"]}


def as_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: (None if (not isinstance(v, (dict, list)) and pd.isna(v)) else v) for k, v in r.items()}
            for r in frame.to_dict("records")]


def is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


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


def reference_rows(paths: list[str], settings: dict[str, dict[str, int]], damaged: list[dict[str, str]]) -> list[dict]:
    """One row per reference.json: its model, setting (and the setting's shape), the dtype the file records
    the reference ran in (the Method names it, never a default), its metrics' columns and its path."""
    return [{"model": r["model"], "setting": r["setting"], **settings[r["setting"]], "dtype": r.get("dtype"),
             **flatten(r["blocks"]), "source": p} for p, r in readable(paths, "reference", damaged)]


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
