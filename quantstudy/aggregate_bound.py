"""The Amdahl bound beside each speed row, and beside each profile the timed call it splits.

f comes from the baseline's kernels.json, g from the GEMM job's gemm.json (bound.py has the formula);
where either is missing or failed, the study does not profile (`timing.profile: false`), or the baseline's
profile disagrees with its own timing, the row's `bound_note` says why and the bound is left out.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from quantstudy import bound
from quantstudy.aggregate_rows import as_records, error_of, is_missing

BOUND_COLUMNS = ("f", "g", "bound", "x_of_bound", "at_limit", "f_kind", "f_basis", "fp8_emulated", "bound_note",
                 "f_source", "g_source")


def _error_text(doc: dict[str, Any]) -> str:
    return error_of(doc) or "no error text"


NOT_PROFILED = "not profiled in this run (timing.profile: false)"


def row_bound(row: dict[str, Any], gemms: dict[tuple, tuple[str, dict | None]] | None, kernels: dict[tuple, tuple[str, dict]],
           baseline: str, threshold: float, profiles: dict[tuple, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Amdahl bound of one speed row (bound.py): f from its baseline's kernels.json, g from the
    gemm.json of its target, model and setting (`gemms` None: the study profiles nothing); where either is
    missing or failed, or the baseline's profile disagrees with its timing (`profiles`: kernels rows by
    target, model, setting, graph and variant, as with_timed judged them), `bound_note` says why."""
    out: dict[str, Any] = dict.fromkeys(BOUND_COLUMNS)
    if gemms is None:
        return out | {"bound_note": NOT_PROFILED}
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
    if not is_missing(x):
        out.update(x_of_bound=x / out["bound"], at_limit=bound.at_limit(x, out["bound"], threshold))
    return out


def with_bounds(speed: pd.DataFrame, gemms: dict | None, kernels: dict, baselines: dict[str, str],
                 threshold: float, profiles: dict[tuple, dict[str, Any]]) -> pd.DataFrame:
    bounds = [row_bound(r, gemms, kernels, baselines[r["setting"]], threshold, profiles) for r in as_records(speed)]
    return pd.concat([speed, pd.DataFrame(bounds, index=speed.index, columns=list(BOUND_COLUMNS))], axis=1)


def with_timed(kernels: pd.DataFrame, speed: pd.DataFrame, baselines: dict[str, str], candidate: str) -> pd.DataFrame:
    """Beside each profile, the timed median of the same call (target, model, setting, graph, variant:
    its own timing row; a baseline's, the one timed beside the candidate, which the speed table shows) and
    whether the two agree (bound.profile_agrees): a profile that does not is no split of the timed call, and
    what is read from it is withheld."""
    timed = {}
    for r in as_records(speed) if len(speed) else []:
        if r["status"] == "ok":
            where = (r["target"], r["model"], r["setting"], r.get("graph") or "main")
            timed.setdefault((*where, r["variant"]), r.get("variant_ms"))
            if r["variant"] == candidate and not is_missing(r.get("baseline_ms")):  # one time per baseline engine: the candidate's pair
                timed[(*where, baselines.get(r["setting"]))] = r.get("baseline_ms")
    rows = []
    for r in as_records(kernels):
        ms = timed.get((r["target"], r["model"], r["setting"], r.get("graph") or "main", r["variant"]))
        ratio = bound.profile_vs_timed(r.get("total_ms"), ms) if r["status"] == "ok" else None
        rows.append({"timed_ms": ms, "profile_vs_timed": ratio,
                     "profile_agrees": None if ratio is None else bound.profile_agrees(ratio)})
    return pd.concat([kernels, pd.DataFrame(rows, index=kernels.index)], axis=1)
