"""The view: what the study templates show, computed from tables.json alone (and, for tables
written before aggregate kept the devices, from the files they name). Nothing here knows a family:
a family's template block reads its columns through the view's `column_range` and `ratio_range`.
"""

from __future__ import annotations

import functools
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from quantstudy import bound, paths
from quantstudy.artifacts import devices
from quantstudy.config import main_quality_condition, shape_of
from quantstudy.render_formats import span, times, value_range
from quantstudy.render_verdict import UNITS, condition_units, revisit, samples_view, verdict
from quantstudy.study_values import timed_on

PLOT = paths.name_of(paths.PLOT)  # beside the README: the plot rule writes it, the section links it

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
        # The baselines this run measured: timed, or in a quality-only run evaluated.
        "baselines": sorted({r["variant"] for r in t["speed"] + t["quality"] if r["variant"] in set(baselines.values())}),
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
        "samples": samples_view(t), "link": functools.partial(link, t["study"]), "kept": kept,
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
