"""README sections from a study's tables.json and the Jinja templates.

Reads JSON and templates only (no torch, no backend). Every number in the output comes from
tables.json; ranges in sentences are computed here from all rows of the table they summarize.
The section sits between marker comments, so it can be spliced into an existing README.

    python -m quantstudy.render results/<study>/tables.json --into path/to/<study>/README.md
"""

from __future__ import annotations

import argparse
import base64
import html
import functools
import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import jinja2

from quantstudy import bound, paths
from quantstudy.artifacts import DamagedArtifact, atomic_write, devices, read_json
from quantstudy.compare import VERDICT_LEVEL
from quantstudy.config import main_quality_condition, shape_of
from quantstudy.study import timed_on

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
PLOT = paths.name_of(paths.PLOT)  # beside the README: the plot rule writes it, the section links it


def begin_marker(study: str) -> str:
    return f"<!-- quantstudy:begin {study} -->"


def end_marker(study: str) -> str:
    return f"<!-- quantstudy:end {study} -->"


# --- number formats ------------------------------------------------------------------------

def ms(v) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 100 else f"{v:.1f}"


def times(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def sci(v) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.2g}" if 1e-3 <= abs(v) < 1e3 else f"{v:.1e}"


def num(v, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def count(v) -> str:
    return "-" if v is None else f"{int(v):,}"


def like(v, printed: str, signed: bool = False, units: str = "") -> str:
    """`v` in the notation and precision the write-up printed a number in (0.752, 5.9e-06, 69,042);
    a percentage with at least two decimals (a printed 100% next to 99.85%)."""
    if v is None:
        return "-"
    mantissa, e, _ = printed.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    if units == "%":
        decimals = max(decimals, 2)
    sign = "+" if signed else ""
    return f"{v:{sign}.{decimals}e}" if e else f"{v:{sign}{',' if ',' in printed else ''}.{decimals}f}"


def pct_of(v, n: int | None) -> str:
    """A fraction of `n` samples as a percentage with the precision one sample supports: 94% of 16
    images, 99.8% of 400, 99.85% of 2,000 (one sample is 6.25, 0.25 and 0.05 points)."""
    if v is None:
        return "-"
    if not n:
        return pct(v)
    decimals = min(2, max(0, math.ceil(-math.log10(100 / n))))
    return f"{100 * v:.{decimals}f}%"


def pct0(v) -> str:
    """A change in whole percent, signed: -27%."""
    return "-" if v is None else f"{100 * v:+.0f}%"


def mib(n_bytes) -> str:
    """Bytes in MiB to three significant digits (0.296, 67.7, 1,230)."""
    if n_bytes is None:
        return "-"
    v = n_bytes / 2**20
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def params_text(p) -> str:
    """A transform's parameters as words, not JSON: `factor 64, when window 512`."""
    if isinstance(p, dict):
        return ", ".join(f"{k} {params_text(v)}" for k, v in p.items())
    if isinstance(p, (list, tuple)):
        return " / ".join(params_text(v) for v in p)
    return str(p)


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
    """One condition's result (aggregate.condition, as the decision or a revisit check records it) as words."""
    spec, samples = t["spec"], _samples_view(t)
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
    return {
        "name": c["name"], "met": c["pass"], "observed": shown(c["observed"]), "rows": c.get("n"),
        # tables.json from before the noise model: each condition resolved as met or not
        "resolved": c.get("resolved") or ("met" if c["pass"] else "not met"),
        "interval": interval and (span(interval, fmt, unit) + f" ({c['interval_kind']}, "
                                  f"{VERDICT_LEVEL:.0%} interval)"),
        "to_resolve": c.get("to_resolve"),
        "samples": ", ".join(f"{count(s['count'])} {s['kind'].replace('_', ' ')} ({s['name']})" for s in lists),
        "timing": c.get("table") == "speed" and spec["timing"],
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


def cell_text(text) -> str:
    """Recorded text (an error) inside a Markdown table cell: a pipe would end the cell, and a `<`
    would start HTML (the page and GitHub render the folds' HTML)."""
    return html.escape(str(text), quote=False).replace("|", "\\|")


def span(r: dict | None, fmt=times, unit: str = "") -> str:
    """'a to b' (or 'a') from a computed range: a symbol after each end (1.03x to 1.11x), a word (a unit
    starting with a space) once, after the range (48.1 to 48.7 times)."""
    if not r:
        return "not measured"
    lo, hi = fmt(r["min"]), fmt(r["max"])
    if lo == hi:
        return f"{lo}{unit}"
    return f"{lo} to {hi}{unit}" if unit.startswith(" ") else f"{lo}{unit} to {hi}{unit}"


def value_range(values) -> dict | None:
    """min, max and count of the finite values among `values` (None and NaN left out), or None."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return {"min": min(values), "max": max(values), "n": len(values)} if values else None


# --- the view: what the templates show, computed from the tables -----------------------------

# Why a variant timed on Blackwell targets only (`timed: blackwell`) has no speed on the others.
BLACKWELL_REASON = "NVFP4 / MXFP8 GEMMs run on Blackwell tensor cores, sm_100+"


def not_timed_here(t: dict[str, Any]) -> dict[str, list[str]]:
    """{target: the variants built on it that it does not time because they are timed on Blackwell targets
    only}, for each of the run's targets (tables.json's `targets`) that has some."""
    variants, built = t["spec"]["variants"], {(b["target"], b["variant"]) for b in t["builds"]}
    found = {target: [v for v, spec in variants.items() if spec.get("timed") == "blackwell" and (target, v) in built
                      and not timed_on(spec["timed"], tg.get("gpu", "cpu"))] for target, tg in t["targets"].items()}
    return {target: vs for target, vs in found.items() if vs}


def blackwell_reason(t: dict[str, Any]) -> str:
    """The reason, with the run's targets and their devices: `... sm_100+; this run's targets are `cpu-torch` (CPU)`."""
    named = [f"`{name}` ({'CPU' if tg.get('device') == 'cpu' else tg.get('gpu', '?').upper()})"
             for name, tg in t["targets"].items()]
    return f"{BLACKWELL_REASON}; this run's targets are {', '.join(named)}"


def tried(t: dict[str, Any], variant: str) -> dict[str, Any] | None:
    """What this run measured of `variant` (a thing a write-up did not try), for its "not tried" item: None
    where the run has no build of it; else its main quality column's range over its ok rows beside the
    candidate's, its x where it was timed, and its failed rows with the first one's error."""
    builds = [b for b in t["builds"] if b["variant"] == variant]
    if not builds:
        return None
    c = main_quality_condition(t["spec"]["decision"])
    column, over = c["column"], c.get("relative_to")
    units = condition_units(c)
    fmt, unit = UNITS.get("percent" if units == "percent_of_samples" else units, UNITS["percent"])
    ok = lambda rows: [r for r in rows if r["status"] == "ok"]  # noqa: E731
    theirs = {(r["target"], r["model"], r["setting"]): r for r in ok(t["quality"]) if r["variant"] == over}

    def value(r: dict[str, Any]) -> float | None:
        """The row's main quality value; relative: its own `<column> / <over>`, or (tables from before
        aggregate kept that column) divided here by `over`'s row on the same key."""
        if not over:
            return r.get(column)
        if r.get(f"{column} / {over}") is not None:
            return r[f"{column} / {over}"]
        other = theirs.get((r["target"], r["model"], r["setting"]), {}).get(column)
        return r[column] / other if other and r.get(column) is not None else None

    mine = [r for r in t["quality"] if r["variant"] == variant]
    speed = [r for r in t["speed"] if r["variant"] == variant]
    failed = [r for r in [*builds, *mine, *speed] if r["status"] not in ("ok", "damaged")]
    quality = value_range(map(value, ok(mine)))
    name = c["name"].removesuffix(" (every row)") + (f", over the `{over}` engine's" if over else "")
    return {"variant": variant, "rows": len(ok(mine)), "quality_name": name,
            "quality": span(quality, fmt, unit) if quality else None,
            "candidate": span(value_range(value(r) for r in ok(t["quality"]) if r["variant"] == t["spec"]["candidate"]),
                              fmt, unit),
            "x": span(value_range(r.get("x") for r in ok(speed)), times, "x") if ok(speed) else None,
            "not_timed": [target for target, vs in not_timed_here(t).items() if variant in vs],
            "failed": len(failed), "error": (failed[0].get("error") or failed[0]["status"]).strip().splitlines()[-1] if failed else None}

def view(t: dict[str, Any], docs: str = "../../docs/reading-a-study.md", repo: str = "../..",
         kept=lambda source: True, read=None) -> dict[str, Any]:
    """What the templates show, computed from tables.json alone. Nothing here knows a family:
    a family's template block reads its columns through `column_range` and `ratio_range`.
    `docs` and `repo`: the shared reading page and the repository root, relative to the README;
    `kept(source)`: whether a file the tables name is beside the README, to be linked; `read(source)`:
    that file's doc (ran_on reads older tables' devices so)."""
    spec, cand, baselines = t["spec"], t["spec"]["candidate"], t["baselines"]
    settings = spec["settings"]
    speed_rows = []
    untimed = not_timed_here(t)
    for (target, model, setting, graph), variants in by_graph(t["speed"]).items():
        c = variants.get(cand, {})
        speed_rows.append({"target": target, "gpu": c.get("gpu") or next(iter(variants.values()))["gpu"],
                           "model": model, "setting": setting, "graph": graph, "batch": settings[setting]["batch"],
                           "baseline": c.get("baseline"), "variants": variants, "candidate": c,
                           # its variants timed on Blackwell targets only, where this target is none
                           "needs_blackwell": untimed.get(target, [])})
    b1 = [r["candidate"].get("x") for r in speed_rows if r["batch"] == 1]
    # Timing jobs per variant; a tables.json written before repeats had one.
    repeats = spec["timing"].get("repeats", 1)
    across_jobs = [r for r in speed_rows if r["candidate"].get("status") == "ok"
                   and r["candidate"].get("x_jobs_spread") is not None]
    bound1 = [r["candidate"].get("bound") for r in speed_rows if r["batch"] == 1]
    bn = [r["candidate"].get("x") for r in speed_rows if r["batch"] > 1]

    q = defaultdict(dict)
    for row in t["quality"]:
        q[(row["target"], row["model"], row["setting"])][row["variant"]] = row

    def rows_of(which: str) -> list[dict[str, Any]]:
        """The candidate's quality rows, or each setting's baseline rows."""
        return [r for r in t["quality"]
                if r["variant"] == (cand if which == "candidate" else baselines[r["setting"]])]

    def column_range(column: str, which: str = "candidate") -> dict | None:
        return value_range(r.get(column) for r in rows_of(which))

    def ratio_range(variant: str, column: str) -> dict | None:
        """A variant's column over the candidate's, per quality row key, as a range."""
        return value_range(rows[variant][column] / rows[cand][column] for rows in q.values()
                           if rows.get(variant, {}).get(column) is not None and rows.get(cand, {}).get(column))

    builds = {(b["target"], b["model"], b["setting"], b["variant"]): b for b in t["builds"]}
    size_change = []
    for (target, model, setting, variant), b in builds.items():
        base = builds.get((target, model, setting, baselines[setting]))
        if variant == cand and b.get("engine_bytes") and base and base.get("engine_bytes"):
            size_change.append({"target": target, "model": model, "setting": setting,
                                "baseline_bytes": base["engine_bytes"], "candidate_bytes": b["engine_bytes"],
                                "change": b["engine_bytes"] / base["engine_bytes"] - 1})

    kernels = by_graph(t["kernels"])
    # Lookups for tables per variant: speed rows by (target, model, setting, graph, variant); builds (above)
    # by (target, model, setting, variant); quality rows are `quality` (target, model, setting) -> {variant: row}.
    speed_of = {(r["target"], r["model"], r["setting"], r.get("graph") or "main", r["variant"]): r for r in t["speed"]}
    variant_summary = {v: {"x_batch1": value_range(r["variants"].get(v, {}).get("x")
                                                   for r in speed_rows if r["batch"] == 1)}
                       for v in spec["variants"]}
    references = [{**r, "target": target, "variants": q[(target, r["model"], r["setting"])]}
                  for target in t["targets"] for r in t["references"] if (target, r["model"], r["setting"]) in q]
    failures = [r for table in ("builds", "speed", "quality", "kernels") for r in t[table]
                if r["status"] not in ("ok", "damaged")]  # a damaged file is listed with the other damaged inputs
    graphs = {r.get("graph") for r in t["speed"] if r.get("graph")}
    return {
        "t": t, "spec": spec, "candidate": cand, "run": t["run"], "settings": settings,
        "tiny": t["run"]["weights"] != "checkpoint", "speed_rows": speed_rows, "quality": q,
        "quality_variants": [v for v in spec["variants"] if v != "fp32"],
        "x_batch1": value_range(b1), "x_batched": value_range(bn), "bound_batch1": value_range(bound1),
        # Tables of a run before the gemm rule (committed evidence) have no bound: their tables keep their columns.
        "has_bound": "bound" in t, "bound": t.get("bound") or {"at_limit": None, "f_bases": {}},
        "f_found": {target: bases for target, bases in ((t.get("bound") or {}).get("f_bases") or {}).items() if bases},
        "baselines": sorted({r["variant"] for r in t["speed"] if r["variant"] in set(baselines.values())}),
        "baseline_of": baselines.__getitem__, "column_range": column_range, "ratio_range": ratio_range,
        "candidate_nonfinite": sum(r.get("nonfinite") or 0 for r in rows_of("candidate")),
        "size_change": size_change, "size_range": value_range(s["change"] for s in size_change),
        # Groups no profile of the run put any time in (a fused-attention group on the torch backend) are not shown.
        "kernels": kernels, "kernel_groups": [g for g in t["kernel_groups"] if any(
            (r.get("groups_ms") or {}).get(g) for r in t["kernels"] if r.get("status") == "ok")],
        # Tables written before profiles were checked against their timing have no such columns.
        "profile_checked": any("profile_agrees" in r for r in t["kernels"]),
        "profile_disagrees": sum(r.get("profile_agrees") is False for r in t["kernels"]),
        "profiles_compared": sum(r.get("profile_agrees") is not None for r in t["kernels"]),
        "profile_agreement": bound.PROFILE_AGREEMENT, "failures": failures, "damaged": t.get("damaged", []),
        "gpus": sorted({r["gpu"] for r in t["speed"]}), "decision": t["decision"],
        "variant_summary": variant_summary, "speed_of": speed_of, "build_of": builds, "references": references,
        "several_graphs": len(graphs) > 1, "reference_dtype": reference_dtype(t), "ran_on": ran_on(t, read),
        "published": _published_view(t),
        "plot": PLOT, "main_quality": main_quality_condition(spec["decision"]), "verdict": verdict(t), "revisit": revisit(t),
        "docs": docs, "repo_link": lambda path: f"{repo}/{path}",
        # Columns and table parts shown only where some row has something to show.
        "show_fp32": any("fp32" in r["variants"] for r in speed_rows),
        "show_bound": "bound" in t and any(r["candidate"].get("bound") is not None or r["candidate"].get("bound_note")
                                           for r in speed_rows),
        "other_variants": sorted({v for r in speed_rows for v in [*r["variants"], *r["needs_blackwell"]]}
                                 - {"fp32", cand, *baselines.values()}),
        "needs_blackwell": list(dict.fromkeys(v for vs in untimed.values() for v in vs)), "not_timed": untimed,
        "blackwell_reason": blackwell_reason(t), "tried": functools.partial(tried, t),
        "any_onnx": any(r.get("opset") is not None for r in t.get("records") or []),
        "chain_example": next((times(r["candidate"]["x"]) for r in speed_rows if r["candidate"].get("status") == "ok"),
                              "<number>"),
        "samples": _samples_view(t), "link": functools.partial(link, t["study"]), "kept": kept,
        "repeats": repeats, "x_jobs_spread": value_range(r["candidate"]["x_jobs_spread"] for r in across_jobs),
        "within_job_noise": [r for r in across_jobs if within_job_noise(r["candidate"])],
        "evaluations": evaluations_view(t["quality"]),
    }


def evaluations_view(quality: list[dict[str, Any]]) -> dict[str, Any]:
    """How the quality rows were measured (`evaluation: {repeats, rebuild}`): `jobs`, the most evaluation jobs
    of one engine; `rows`, the rows measured by two or more; `rebuilt`, those whose jobs each opened their own
    build of the engine (aggregate's `quality_builds`); `across`: what a metric's range across the jobs is
    across, "builds" where every such row was rebuilt (build to build), else "jobs" (of one engine)."""
    several = [r for r in quality if r.get("status") == "ok" and (r.get("evaluations") or 1) > 1]
    rebuilt = [r for r in several if r.get("quality_builds")]
    return {"jobs": int(max((r["evaluations"] for r in several), default=1)), "rows": len(several),
            "rebuilt": len(rebuilt), "across": "builds" if several and len(rebuilt) == len(several) else "jobs"}


def _samples_view(t: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{name: sample list row}: from the lists the jobs read (tables.json's `samples`); tables written
    before they were recorded (older evidence) have only the spec's counts, and no file to link."""
    if t.get("samples"):
        return {s["name"]: s for s in t["samples"]}
    spec = t["spec"]
    return {name: {"name": name, "count": s["count"], "kind": s["kind"], "split": s["split"], "source": None,
                   "dataset": spec["datasets"][s["dataset"]]["repo"],
                   "revision": spec["datasets"][s["dataset"]]["revision"]} for name, s in spec["samples"].items()}


CARD = re.compile(r"\bG?[ABHL]\d{2,3}\b")  # a card as a note names it: H200, B300, A100, L40, GB300


def ran_on(t: dict[str, Any], read=None) -> dict[str, Any]:
    """The devices the run's jobs ran on, as their JSONs' provenance records them (tables.json's `devices`);
    for tables written before aggregate kept them, `read(source)` (a kept file's doc, or None) gives the
    build, timing, profile and evaluation files the tables name. `contradicted`: the cards the run's note
    names that no job ran on (the note is config text; a job's provenance is what happened)."""
    found = t.get("devices")
    if found is None and read is not None:
        sources = dict.fromkeys(r["source"] for table in ("builds", "speed", "kernels", "quality")
                                for r in t[table] if r.get("source"))
        docs = [doc for doc in map(read, sources) if doc is not None]
        found = devices(docs) if docs else None
    names = [d["device"] for d in found or []]
    claimed = dict.fromkeys(CARD.findall(t["run"].get("note") or ""))
    return {"devices": found, "text": ", ".join(f"{d['device']} ({d['jobs']} job{'s' if d['jobs'] != 1 else ''})"
                                                for d in found or []),
            "contradicted": [c for c in claimed if found is not None and not any(c in n for n in names)]}


def reference_dtype(t: dict[str, Any]) -> str | None:
    """The dtype the PyTorch reference ran in, as its reference.json files record it (each reference row's
    `dtype`); tables written before the rows kept it: the study's `reference_dtype`; older still: None."""
    recorded = sorted({r["dtype"] for r in t["references"] if r.get("dtype")})
    return " and ".join(recorded) if recorded else t["spec"].get("reference_dtype")


def within_job_noise(row: dict[str, Any]) -> bool:
    """The candidate's x differs from 1 by no more than its range across timing jobs: these jobs do
    not tell it from its baseline. Only where that range was measured (two or more jobs)."""
    lo, hi = row.get("x_jobs_min"), row.get("x_jobs_max")
    return lo is not None and hi is not None and abs(row["x"] - 1) <= hi - lo


def _published_view(t: dict[str, Any]) -> dict[str, Any] | None:
    """The write-up's published numbers beside this run's, grouped by the write-up's table (or
    sentence) they are printed in, in the file's order; with the counts and, where every number
    is unreproduced for one reason, that reason."""
    if not t.get("published_from"):
        return None
    rows = t["published"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["published_source"]["section"], r["published_source"]["title"]), []).append(r)
    reproduced = [r for r in rows if r["status"] == "reproduced"]
    reasons = {r["reason"] for r in rows if r["status"] != "reproduced"}
    return {"from": t["published_from"], "n": len(rows), "reproduced": len(reproduced),
            "differs": t["published_from"].get("differs", []), "left_out": t["published_from"].get("left_out", []),
            "beyond": sum(bool(r["beyond_tolerance"]) for r in reproduced),
            "reason": next(iter(reasons)) if len(reasons) == 1 and not reproduced else None,
            "groups": [{"section": s, "title": title, "rows": g} for (s, title), g in groups.items()]}


def by_graph(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """(target, model, setting, graph) -> {variant: row}. A failed measurement has no graph: it
    stands in every graph of its target, model and setting (or alone, where none was measured)."""
    groups: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row.get("graph") is not None:
            groups[(row["target"], row["model"], row["setting"], row["graph"])][row["variant"]] = row
    for row in rows:
        if row.get("graph") is None:
            keys = [k for k in groups if k[:3] == (row["target"], row["model"], row["setting"])]
            for key in keys or [(row["target"], row["model"], row["setting"], None)]:
                groups[key][row["variant"]] = row
    return groups


def link(study: str, source: str) -> str:
    """A workflow path (results/<study>/...) as a link relative to the study's README, results/<study>/README.md."""
    return Path(os.path.relpath(source, f"results/{study}")).as_posix()


def shape_label(shape: dict[str, Any]) -> str:
    """A setting's shape as the write-ups print it: `512`, `800 x 1067`."""
    return " x ".join(str(v) for v in shape_of(shape).values())


def setting_words(setting: dict[str, Any]) -> str:
    """A setting described from its values, never from its name: `window 64, batch 1`."""
    return ", ".join(f"{k} {v}" for k, v in [*shape_of(setting).items(), ("batch", setting["batch"])])


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    formats = dict(ms=ms, times=times, pct=pct, pct_of=pct_of, pct0=pct0, mib=mib, sci=sci, num=num, count=count,
                   like=like)
    env.filters.update(span=span, cell_text=cell_text, **formats)
    env.globals.update(shape_label=shape_label, setting_words=setting_words, params_text=params_text,
                       pct_for=lambda n: functools.partial(pct_of, n=n), **formats)  # so macros can take a format as an argument
    return env


DOCS = "docs/reading-a-study.md"  # the explanations every study README shares, in the repository


def repository_of(readme: Path) -> Path:
    """The workflow root a README lives in: the nearest folder above it with a Snakefile."""
    for folder in readme.resolve().parents:
        if (folder / "Snakefile").exists():
            return folder
    raise ValueError(f"{readme} is not inside a workflow checkout (no Snakefile above it)")


def _read_kept(folder: Path, study: str, source: str) -> dict[str, Any] | None:
    """The doc of a file the tables name, where it is kept beside the README; None where it is not."""
    try:
        return read_json(folder / link(study, source))
    except (OSError, DamagedArtifact):
        return None


def render_section(tables: dict[str, Any], readme: str | Path | None = None) -> str:
    """The study's README section, markers included. `readme`: where it is written (default
    results/<study>/README.md of this checkout, every file beside it), for the links to the
    repository's docs and to the files beside it."""
    if readme is None:
        repo, kept, read = "../..", lambda source: True, None
    else:  # an evidence folder may not have kept every file its tables name: those are named, not linked
        folder = Path(readme).resolve().parent
        repo = Path(os.path.relpath(repository_of(Path(readme)), folder)).as_posix()
        kept = lambda source: (folder / link(tables["study"], source)).exists()  # noqa: E731
        read = functools.partial(_read_kept, folder, tables["study"])
    env = environment()
    body = env.get_template(f"{tables['family']}.md.j2").render(**view(tables, f"{repo}/{DOCS}", repo, kept, read))
    body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
    return f"{begin_marker(tables['study'])}\n{body}{end_marker(tables['study'])}\n"


def splice(existing: str, section: str, study: str) -> str:
    """Replace the study's marked section of an existing README (or append it), leaving the rest as is."""
    begin, end = begin_marker(study), end_marker(study)
    if begin in existing and end in existing:
        head, rest = existing.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + section.rstrip("\n") + tail
    return existing.rstrip("\n") + "\n\n" + section


PAGE_STYLE = ("body{font-family:sans-serif;max-width:80em;margin:1em auto;padding:0 1em;line-height:1.4}"
              "table{border-collapse:collapse;margin:.5em 0;font-size:90%}th,td{border:1px solid #ccc;padding:2px 6px}"
              "th{background:#f3f3f3}img{max-width:100%}code{background:#f6f6f6}"
              "details.file{margin:.3em 0}details.file pre{background:#f6f6f6;padding:.5em;overflow:auto;max-height:40em}"
              "details.file>:not(summary){scroll-margin-top:2.5em}"
              ":target{outline:3px solid #ff7f0e}")


LINK = re.compile(r'(href|src)="([^"#:]+)(#[^"]*)?"')
MEDIA = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg"}


def anchor_id(path: str) -> str:
    """A fragment id for a file the page carries, from its path: `file-cpu-torch-<model>-w512-fp8-timing-json`."""
    parts = [p for p in Path(os.path.normpath(path)).parts if p not in ("..", ".")]
    return "file-" + re.sub(r"[^a-z0-9]+", "-", "/".join(parts).lower()).strip("-")


def _heading_ids(body: str, prefix: str) -> str:
    """GitHub's heading anchors (`## The plot` -> `the-plot`) on the headings of a rendered Markdown
    file, prefixed by the file's id, so a link to `reading-a-study.md#the-plot` lands on its heading."""
    def slug(match: re.Match) -> str:
        text = re.sub(r"<[^>]+>", "", match.group(2))
        s = re.sub(r"[^\w\- ]", "", html.unescape(text).strip().lower()).replace(" ", "-")
        return f'<h{match.group(1)} id="{prefix}--{s}">{match.group(2)}</h{match.group(1)}>'
    return re.sub(r"<h([1-6])>(.*?)</h\1>", slug, body)


def _markdown(text: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": True}).enable("table").render(text)  # the folds are HTML


def html_page(section: str, title: str, folder: str | Path | None = None) -> str:
    """The section as one self-contained HTML page: what `snakemake --report` shows. An image resolved
    from `folder` (the README's) is inlined as a data URI; every other file a link resolves to is carried
    once, at the end of the page, in a closed fold with an id (its JSON as text, a Markdown page
    rendered), and the link points at that id: a click opens the fold and scrolls to it, offline, in the
    report's frame as in a browser tab (a browser does not navigate a page to a data: link). A link to no
    file stays as is."""
    markdown = "\n".join(line for line in section.splitlines() if not line.startswith("<!-- quantstudy:"))
    body = _markdown(markdown)
    folder = Path(folder) if folder is not None else None
    carried: dict[str, str] = {}  # link target -> the fold's id
    images: dict[str, str] = {}

    def inline(match: re.Match) -> str:
        attr, target, fragment = match.group(1), match.group(2), match.group(3) or ""
        path = (folder or Path(".")) / target
        if folder is None or not path.is_file():
            return match.group(0)
        if attr == "src" and path.suffix in MEDIA:
            if target not in images:
                images[target] = f"data:{MEDIA[path.suffix]};base64,{base64.b64encode(path.read_bytes()).decode()}"
            return f'src="{images[target]}"'
        fold = carried.setdefault(target, anchor_id(target))
        if fragment and path.suffix == ".md":
            return f'href="#{fold}--{fragment[1:]}" title="{html.escape(target + fragment)}"'
        return f'href="#{fold}" title="{html.escape(target)}"'

    body = LINK.sub(inline, body)
    folds = []
    for target, fold in carried.items():
        path = folder / target
        if path.suffix in MEDIA:
            data = base64.b64encode(path.read_bytes()).decode()
            content = f'<img id="{fold}" src="data:{MEDIA[path.suffix]};base64,{data}" alt="{html.escape(target)}">'
        elif path.suffix == ".md":
            content = f'<div id="{fold}">{_heading_ids(_markdown(path.read_text()), fold)}</div>'
        else:
            content = f'<pre id="{fold}">{html.escape(path.read_text(errors="replace"), quote=False)}</pre>'
        folds.append(f'<details class="file"><summary><code>{html.escape(target)}</code> '
                     f"({path.stat().st_size / 1024:,.1f} KiB)</summary>\n{content}\n</details>")
    if folds:
        body += ('<h3 id="files">The files this page links</h3>\n<p>Each link above opens its file here.</p>\n'
                 + "\n".join(folds) + "\n")
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{PAGE_STYLE}</style></head>\n<body>\n{body}</body></html>\n")


def render_file(tables_json: str | Path, out: str | Path, into: str | Path | None = None,
                page: str | Path | None = None) -> None:
    """The README section to `out` (and spliced `into` another README); with `page`, also as one
    self-contained HTML page, the plot and every file the section links inline (html_page)."""
    tables = read_json(tables_json, "tables")
    section = render_section(tables, out)
    atomic_write(out, section)
    if page:  # the plot is an input of the render rule: it is beside the README when the page is made
        atomic_write(page, html_page(section, tables["title"], Path(out).parent))
    if into:
        into = Path(into)
        atomic_write(into, splice(into.read_text() if into.exists() else "", section, tables["study"]))


def _rst(text: str) -> str:
    """Plain text inside reStructuredText: its inline markup characters escaped."""
    return re.sub(r"([\\`*_|])", r"\\\1", str(text))


def run_kind(run: dict[str, Any], devices_text: str = "") -> str:
    """What kind of run the numbers come from, in a line: its name, its weights, the devices its jobs
    record (`devices_text`) and its note."""
    weights = "the real checkpoints" if run["weights"] == "checkpoint" else f"{run['weights']} weights"
    on = f", on {devices_text}" if devices_text else ""
    return f"Run {run['name']} ({weights}{on}). {run.get('note') or ''}".strip()


def front_page(tables_jsons: list[str | Path], out: str | Path) -> None:
    """The decisions of every study as reStructuredText, for the front page of `snakemake --report`
    (report/workflow.rst includes it): first the kind of run they come from (a smoke run on tiny
    random-init models decides nothing about the real checkpoints), then one line per study: its
    decision and the conditions it does not meet. Each condition's full verdict is its README's."""
    docs = [read_json(path, "tables") for path in tables_jsons]
    # The devices by name only: one line for a run whose studies ran on the same devices.
    kinds = list(dict.fromkeys(run_kind(t["run"], ", ".join(sorted({d["device"] for d in ran_on(t)["devices"] or []})))
                               for t in docs))
    lines = [f"**{_rst(kind)}**" for kind in kinds] + [""]
    for t in docs:
        d, verdicts = t["decision"], verdict(t)
        missed = [v for v in verdicts if not v["met"]]
        line = f"- **{_rst(t['title'])}: {'ship' if d['ship'] else 'do not ship'} {_rst(d['candidate'])}**"
        if missed:
            line += f" ({len(missed)} of {len(verdicts)} conditions not met: " + "; ".join(
                f"{_rst(v['name'])}, {_rst(v['observed'])}, needs {_rst(v['threshold'].replace('`', ''))}"
                for v in missed) + ")"
        else:
            line += f" (all {len(verdicts)} conditions met)"
        lines.append(line)
    atomic_write(out, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="Render a study's README section from its tables.json.")
    parser.add_argument("tables", help="results/<study>/tables.json")
    parser.add_argument("--out", help="where to write the section (default: beside tables.json)")
    parser.add_argument("--into", help="an existing README to splice the section into, between markers")
    args = parser.parse_args()
    render_file(args.tables, args.out or paths.beside(args.tables, paths.README), args.into)


if __name__ == "__main__":
    main()
