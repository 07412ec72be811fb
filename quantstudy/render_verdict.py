"""A decision's conditions in words: what each measured, on how many rows and samples, against
which threshold, for the README's verdict, the write-ups' "revisit when" checks and the report's
front page. From tables.json alone.
"""

from __future__ import annotations

import functools
from typing import Any

from quantstudy.compare import VERDICT_LEVEL
from quantstudy.render_formats import count, num, pct, pct_of, span, times

# A condition's units: the number's format and its unit (a word follows a range once: 48.1 to 48.7 times).
UNITS = {"x": (times, "x"), "percent": (pct, ""), "count": (count, ""), "times": (lambda v: num(v, 1), " times"),
         "number": (lambda v: num(v, 4), "")}


def condition_units(c: dict[str, Any]) -> str:
    """How a decision condition's values are printed: its `units`, else from its kind."""
    if c.get("units"):
        return c["units"]
    if c.get("relative_to"):
        return "times"
    if c.get("table") == "speed":
        return "x"
    return "count" if c.get("reduce") == "sum" else "number"


COMPARE_WORDS = {">=": "at least", ">": "above", "<=": "at most", "<": "below", "==": "exactly"}


def verdict(t: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per decision condition, from tables.json's decision: what the candidate measured,
    on how many rows and samples, what the baseline measured on the same rule, and the threshold with
    where it comes from."""
    return [verdict_line(t, c) for c in t["decision"]["conditions"]]


def verdict_line(t: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """One condition's result (decision.condition, as the decision or a revisit check records it) as words."""
    spec, samples = t["spec"], samples_view(t)
    declared = {d["name"]: d for d in spec["decision"]["conditions"]}
    c = {**declared.get(c["name"], {}), **c}  # a tables.json before decide() copied table and units
    units = condition_units(c)
    lists = [samples[name] for name in c.get("samples") or [] if name in samples]
    fmt, unit = ((functools.partial(pct_of, n=lists[0]["count"]), "")
                 if units == "percent_of_samples" and len(lists) == 1 else UNITS.get(units, UNITS["percent"]))

    def shown(observed) -> str:
        return (span(observed, fmt, unit) if isinstance(observed, dict)
                else "not measured" if observed is None else fmt(observed) + unit)

    # The threshold as configured, never rounded to a sample's precision (99.5% of 24 pairs is not 100%).
    threshold = ("" if c.get("threshold") is None
                 else (pct if units == "percent_of_samples" else fmt)(c["threshold"]) + unit)
    if c.get("relative_to"):
        threshold += f" the `{c['relative_to']}` engine's"
    base = c.get("baseline")
    interval = c.get("interval")
    measured = c.get("n") != 0  # no row measured it: no samples or rounds to name (None: tables before counts)
    return {
        "name": c["name"], "met": c["pass"], "observed": shown(c["observed"]), "rows": c.get("n"),
        # tables.json from before the noise model: each condition resolved as met or not
        "resolved": c.get("resolved") or ("met" if c["pass"] else "not met"),
        "interval": interval and (span(interval, fmt, unit) + f" ({c['interval_kind']}, "
                                  f"{VERDICT_LEVEL:.0%} interval)"),
        "to_resolve": c.get("to_resolve"),
        "samples": measured and ", ".join(f"{count(s['count'])} {s['kind'].replace('_', ' ')} ({s['name']})" for s in lists),
        "timing": measured and c.get("table") == "speed" and spec["timing"],
        "baseline": base and {"variants": base["variants"], "met": base["pass"], "observed": shown(base["observed"])},
        "threshold": f"{COMPARE_WORDS.get(c.get('compare'), c.get('compare') or '')} {threshold}".strip(),
        "basis": c.get("basis"), "note": c.get("note"),
        # Measured otherwise than the write-up did (config/published `differs`): said beside the basis.
        "differs": [d["how"] for d in (t.get("published_from") or {}).get("differs", [])
                    if c.get("column") in d["columns"]],
        "setting": (c.get("rows") or {}).get("setting")}


def revisit(t: dict[str, Any]) -> list[dict[str, Any]]:
    """Each write-up's "revisit when", checked (tables.json's revisit): its verdict, and each variant's
    result on the decision condition it is checked by, in words."""
    return [{**r, "variants": [{**v, "line": verdict_line(t, v["condition"])} for v in r["variants"]]}
            for r in t.get("revisit") or []]


def samples_view(t: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{name: sample list row}: from the lists the jobs read (tables.json's `samples`); tables written
    before they were recorded (older evidence) have only the spec's counts, and no file to link."""
    if t.get("samples"):
        return {s["name"]: s for s in t["samples"]}
    spec = t["spec"]
    return {name: {"name": name, "count": s["count"], "kind": s["kind"], "split": s["split"], "source": None,
                   "dataset": spec["datasets"][s["dataset"]]["repo"],
                   "revision": spec["datasets"][s["dataset"]]["revision"]} for name, s in spec["samples"].items()}
