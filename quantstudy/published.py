"""A write-up's published numbers (config/published/<study>.yaml) beside the values this run measured
on the same rows of its tables: tables.json's `published` list."""

from __future__ import annotations

from typing import Any, Iterable

from quantstudy.config import PUBLISHED_KEYS, UNIT_SCALE
from quantstudy.render_formats import value_range


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
