"""The decision and the write-up's revisit checks, computed from the study's tables.

The decision rule is a list of conditions over the tables' columns (config `decision`): each reduces
a column over the candidate's rows and compares it with a threshold, and says whether this run's
noise resolves it. FP8 ships only if every condition holds and every measurement of the candidate
succeeded. A revisit check applies one condition to the variants it names.
"""

from __future__ import annotations

import operator
from typing import Any

import pandas as pd

from quantstudy import compare
from quantstudy.aggregate_rows import as_records, is_missing
from quantstudy.families.base import measured_against
from quantstudy.render_formats import value_range
from quantstudy.study import REVISIT_SELECTORS

COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
REDUCE = {"min": min, "max": max, "sum": sum, "mean": lambda v: sum(v) / len(v)}


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
    missing = sum(map(is_missing, values))
    present = [v for v in values if not is_missing(v)]
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
            **_uncertainty(spec, [r for r in as_records(rows) if not is_missing(r.get(column))] if column in rows else [],
                           bool(met), bool(missing) or not present, noise)}


def _row_interval(spec: dict[str, Any], row: dict[str, Any]) -> tuple[tuple[float, float] | None, str | None]:
    """A row's interval of the condition's column (compare.VERDICT_LEVEL) and what it is made of: x from its
    rounds and the spread between jobs; a rate over `n` samples (the condition's `n` column): Wilson."""
    if spec["column"] == "x" and not is_missing(row.get("x_low")):
        return (row["x_low"], row["x_high"]), "rounds and jobs"
    if spec.get("n") and not is_missing(row.get(spec["n"])) and row[spec["n"]] > 0:
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
                               for r, m, t in zip(as_records(joined), joined["intervals"], joined["_other_intervals"])]
    return joined.drop(columns=[c for c in ("_other", "_other_intervals") if c in joined])


def _ratio_interval(a: float, b: float, of_a: dict[str, Any] | None, of_b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The interval of a / b from the intervals of a and of b, taken as independent (their half-widths add in
    quadrature in log space): wider than a paired resample of two engines on the same samples would give,
    so a ratio it calls resolved is. None where either has no interval or one is not positive."""
    if of_a is None or of_b is None or is_missing(a) or is_missing(b) or min(a, b, of_a["low"], of_b["low"]) <= 0:
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
