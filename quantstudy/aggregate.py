"""Tidy tables of one study (pandas) and the decision computed from them.

Reads every per-variant JSON the workflow wrote; writes tables.json, the render's only input.
Each row keeps the path of the JSON it came from, so a rendered number can be traced back.
"""

from __future__ import annotations

import logging
from typing import Any

import pandas as pd

from quantstudy.artifacts import now, provenance, read_json, write_json
from quantstudy.render import value_range

log = logging.getLogger("quantstudy")


def _rows(paths: list[str], kind: str, flatten) -> pd.DataFrame:
    rows = []
    for path in paths:
        doc = read_json(path, kind)
        row = {k: doc.get(k) for k in ("target", "model", "setting", "variant", "status")}
        lines = (doc.get("error") or "").strip().splitlines()
        row["error"] = lines[-1] if lines else None  # a traceback's last line names the error
        if doc.get("status", "ok") == "ok":
            row.update(flatten(doc))
        row["source"] = path
        rows.append(row)
    return pd.DataFrame(rows)


def _speed(doc: dict[str, Any]) -> dict[str, Any]:
    return {"baseline": doc["baseline"], "variant_ms": doc["variant_ms"]["median_ms"],
            "variant_spread": doc["variant_ms"]["spread"], "baseline_ms": doc["baseline_ms"]["median_ms"],
            "x": doc["x"], "x_min": doc["x_min"], "x_max": doc["x_max"], "batch": doc["batch"], "window": doc["window"]}


def _quality(doc: dict[str, Any]) -> dict[str, Any]:
    m, c, bar, nf = doc["mlm"], doc["cls"], doc["quality_bar"], doc["nonfinite"]
    return {"window": doc["window"], "kl_mean": m["kl_mean"], "kl_p99": m["kl_p99"], "top1": m["top1_agreement"],
            "cos_mean": c["cosine_mean"], "cos_min": c["cosine_min"], "cls_rel_err": c["relative_error"],
            "sts_spearman": doc["sts_spearman"], "bar_passed": bar["passed"], "bar_sentences": bar["sentences"],
            "nonfinite": nf["total_bad"], "nonfinite_heldout": nf["heldout"]["bad"], "heldout": nf["heldout"]["of"],
            "nonfinite_detail": {k: v for k, v in nf.items() if isinstance(v, dict)}}


def _build(doc: dict[str, Any]) -> dict[str, Any]:
    return {"engine_bytes": doc.get("engine_bytes"), "fp8_layers": len(doc.get("fp8_layers") or []),
            "hidden_scale": doc.get("hidden_scale")}


def _kernels(doc: dict[str, Any]) -> dict[str, Any]:
    return {"groups_ms": doc["groups_ms"], "total_ms": doc["total_ms"], "group_order": doc["groups"]}


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: (None if (not isinstance(v, (dict, list)) and pd.isna(v)) else v) for k, v in r.items()}
            for r in frame.to_dict("records")]


def decide(study: dict[str, Any], speed: pd.DataFrame, quality: pd.DataFrame) -> dict[str, Any]:
    """Apply the study's decision rule to the candidate variant's rows; every condition is shown."""
    rule, cand = study["decision"], study["candidate"]
    s = speed[(speed.variant == cand)]
    q = quality[(quality.variant == cand)]
    b1 = s[s.batch == 1] if "batch" in s else s.iloc[0:0]
    failed = pd.concat([s[s.status != "ok"], q[q.status != "ok"]])
    conditions = []

    def cond(name, observed, threshold, ok, note=""):
        conditions.append({"name": name, "observed": observed, "threshold": threshold, "pass": bool(ok), "note": note})

    xs = value_range(b1.x) if len(b1) else None
    cond("speedup at batch 1 (every row)", xs, rule["min_speedup_batch1"],
         xs is not None and xs["min"] >= rule["min_speedup_batch1"])
    top1 = value_range(q.top1) if len(q) else None
    cond("masked-LM top-1 agreement (every row)", top1, rule["min_mlm_top1_agreement"],
         top1 is not None and top1["min"] >= rule["min_mlm_top1_agreement"])
    bar_failures = int((q.bar_sentences - q.bar_passed).sum()) if "bar_passed" in q and len(q) else None
    cond("quality-bar failures (CLS relative L2)", bar_failures, rule["max_quality_bar_failures"],
         bar_failures is not None and bar_failures <= rule["max_quality_bar_failures"])
    nonfinite = int(q.nonfinite.sum()) if "nonfinite" in q and len(q) else None
    cond("non-finite outputs", nonfinite, 0 if not rule["allow_nonfinite"] else None,
         nonfinite is not None and (rule["allow_nonfinite"] or nonfinite == 0))
    if len(failed):
        cond("every measurement of the candidate succeeded", len(failed), 0, False,
             "failed: " + ", ".join(sorted(set(failed.source))))
    return {"candidate": cand, "ship": all(c["pass"] for c in conditions), "conditions": conditions}


def aggregate(inputs: dict[str, list[str]], study: dict[str, Any], run: dict[str, Any],
              targets: dict[str, dict[str, Any]], out: str) -> None:
    started = now()
    speed = _rows(inputs["timings"], "timing", _speed)
    quality = _rows(inputs["qualities"], "quality", _quality)
    builds = _rows(inputs["builds"], "build", _build)
    kernels = _rows(inputs["kernels"], "kernels", _kernels)
    references = [read_json(p, "reference") | {"source": p} for p in inputs["references"]]
    amax = [read_json(p, "amax") | {"source": p} for p in inputs["amax"]]
    checkpoints = [read_json(p, "checkpoint") | {"source": p} for p in inputs["checkpoints"]]
    for frame in (speed, quality, builds, kernels):
        frame["gpu"] = frame.target.map(lambda t: targets[t].get("gpu", "cpu"))
        frame["backend"] = frame.target.map(lambda t: targets[t]["backend"])
    log.info("%d timing, %d quality, %d build, %d kernel rows", len(speed), len(quality), len(builds), len(kernels))

    known_issue = [{"model": r["model"], "setting": r["setting"], "window": r["window"],
                    "peak": r["mixing_peak"]["max"], "fp16_max": r["mixing_peak"]["fp16_max"],
                    "passages_over": r["mixing_peak"]["passages_over_fp16_max"],
                    "passages": len(r["mixing_peak"]["per_passage"]), "source": r["source"]} for r in references]
    reference_sts = {(r["model"], r["setting"]): r["sts_spearman"] for r in references}
    quality["reference_sts_spearman"] = [reference_sts.get((m, s)) for m, s in zip(quality.model, quality.setting)]
    calibration = [{"model": a["model"], "window": a["window"], "layers": len(a["recipe_layers"]),
                    "largest_ratio": a["outliers"]["largest_ratio"], "outliers": a["outliers"]["layers"],
                    "ratio": a["outliers"]["ratio"], "passages": a["calibration"]["passages"], "source": a["source"]}
                   for a in amax]
    write_json(out, "tables", {
        "study": study["study"], "title": study["title"], "family": study["family"],
        "description": study.get("description", ""), "run": run, "targets": targets,
        "spec": {k: study[k] for k in ("models", "settings", "datasets", "samples", "recipe", "variants", "baseline",
                                       "candidate", "timing", "metrics", "decision")},
        "checkpoints": [{k: c[k] for k in ("repo", "revision", "weights", "source")} for c in checkpoints],
        "speed": _records(speed), "quality": _records(quality), "builds": _records(builds),
        "kernels": _records(kernels), "known_issue": known_issue, "calibration": calibration,
        "decision": decide(study, speed, quality),
        "provenance": provenance("aggregate", {f"{k}[{i}]": p for k, v in inputs.items() for i, p in enumerate(v)},
                                 {"study": study["study"], "run": run}, started)})
