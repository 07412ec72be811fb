"""Two runs side by side: every row they share, its change, the change's interval and whether it counts.

    python -m quantstudy.diff RUN_A RUN_B [--out diff.md] [--fail-on x --fail-on heldout.top1_agreement]

A run is a results folder (`results/`, or an evidence run's `.../results`) holding `<study>/tables.json`.
Speed rows (x, each engine's median ms) are compared by compare.compare on their timing rounds, resampled,
with the spread between jobs each run measured (timing.timing_noise) and the study's minimum effects.
Quality values are compared exactly, beyond a minimum effect (QUALITY_MIN_EFFECT): two runs of a study
answer the same seeded samples, so a difference is in the engines' answers to them, not a sampling one.
(The intervals quality.json keeps say how far a value could move on other samples: what a verdict's
threshold needs, not what two runs on the same samples differ by.)
Rows in one run only are listed. With --fail-on, the exit status is 1 when a named column regresses in
a shared row (x and a decision condition's column know which way is worse), for CI gating.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantstudy import compare, config, paths
from quantstudy.timing import timing_noise

KEY = ("target", "model", "setting", "variant")
# Two quality values differ beyond this share of the larger one (a GPU's GEMM algorithm between processes
# moves a metric by about 1e-6 of itself; reproduce allows 1e-5).
QUALITY_MIN_EFFECT = 1e-5
SPEED = ("x", "variant_ms", "baseline_ms")


@dataclass(frozen=True)
class Run:
    """One run's studies: {study: tables.json}, and the folder the tables' source paths are relative to."""
    folder: Path
    tables: dict[str, dict[str, Any]]

    @classmethod
    def load(cls, folder: str | Path) -> Run:
        folder = Path(folder)
        tables = {p.parent.name: json.loads(p.read_text()) for p in paths.glob(folder, paths.TABLES)}
        if not tables:
            raise SystemExit(f"{folder} holds no <study>/tables.json: give a run's results folder")
        return cls(folder, tables)

    def source(self, path: str) -> dict[str, Any]:
        """A JSON a row names (`results/<study>/...`, relative to the run's checkout)."""
        return json.loads((self.folder.parent / path).read_text())


def _rows(tables: dict[str, Any], table: str) -> dict[tuple, dict[str, Any]]:
    return {tuple(r[k] for k in KEY) + ((r["graph"],) if "graph" in r else ()): r
            for r in tables[table] if r.get("status") == "ok"}


def _timing_noise(run: Run, study: str) -> dict[str, Any]:
    docs = [run.source(s) for r in run.tables[study]["speed"] if r.get("status") == "ok"
            for s in r.get("timing_sources") or [r["source"]]]
    return timing_noise(docs)


def _speed_estimates(run: Run, row: dict[str, Any]) -> dict[str, compare.Estimate]:
    """x and both medians of a speed row, from its timing job's rounds (the median over repeat jobs, if any)."""
    graphs = [run.source(s)["graphs"][row["graph"]] for s in row.get("timing_sources") or [row["source"]]]
    if len(graphs) > 1:
        return {"x": compare.median_of_jobs([g["x"] for g in graphs]),
                **{ms: compare.median_of_jobs([g[ms]["median_ms"] for g in graphs]) for ms in SPEED[1:]}}
    g = graphs[0]
    return {"x": compare.speedup_of(g["baseline_ms"]["samples_ms"], g["variant_ms"]["samples_ms"]),
            **{ms: compare.median_of(g[ms]["samples_ms"]) for ms in SPEED[1:]}}


def better_when(tables: dict[str, Any], column: str) -> str | None:
    """Which way a column improves: "higher" for x, or as the study's decision condition on it reads."""
    if column == "x":
        return "higher"
    for c in tables["spec"]["decision"]["conditions"]:
        if c["column"] == column and "relative_to" not in c:
            return "higher" if c["compare"] in (">=", ">") else "lower"
    return None


def diff(a: Run, b: Run) -> dict[str, Any]:
    """Per study both runs have: the shared rows' changes and the rows in one run only."""
    studies = {}
    for study in sorted(set(a.tables) & set(b.tables)):
        ta, tb = a.tables[study], b.tables[study]
        min_effect = {**config.MIN_EFFECT, **ta["spec"]["timing"].get("min_effect", {})}
        na, nb = _timing_noise(a, study), _timing_noise(b, study)
        # one job's spread between jobs, either run's: the root mean square of the two runs' own
        noise = {k: math.sqrt((na[k] ** 2 + nb[k] ** 2) / 2) for k in ("x", "ms")}
        rows = []
        sa, sb = _rows(ta, "speed"), _rows(tb, "speed")
        for key in [k for k in sa if k in sb]:
            ea, eb = _speed_estimates(a, sa[key]), _speed_estimates(b, sb[key])
            own = sa[key]["variant"] == sa[key]["baseline"]  # the baseline's row: x is 1, one engine
            for column in SPEED[1:2] if own else SPEED:
                kind = "x" if column == "x" else "ms"
                change = compare.compare(ea[column], eb[column], min_effect[kind], noise[kind])
                rows.append(_row("speed", key, column, change, better_when(ta, column) if column == "x" else "lower"))
        qa, qb = _rows(ta, "quality"), _rows(tb, "quality")
        for key in [k for k in qa if k in qb]:
            for column in sorted(set(qa[key]) & set(qb[key])):
                va, vb = qa[key][column], qb[key][column]
                if not (_number(va) and _number(vb)) or not is_metric(column, ta):
                    continue
                change = compare.compare(compare.exact(va), compare.exact(vb), QUALITY_MIN_EFFECT, kind="difference")
                rows.append(_row("quality", key, column, change, better_when(ta, column)))
        only = {"a": [list(k) for t in ("speed", "quality") for k in _rows(ta, t) if k not in _rows(tb, t)],
                "b": [list(k) for t in ("speed", "quality") for k in _rows(tb, t) if k not in _rows(ta, t)]}
        studies[study] = {"noise": {"a": na, "b": nb, "used": noise}, "min_effect": min_effect, "rows": rows,
                          "only": only, "decision": {"a": ta["decision"]["ship"], "b": tb["decision"]["ship"]}}
    return {"a": str(a.folder), "b": str(b.folder), "studies": studies,
            "only_in": {"a": sorted(set(a.tables) - set(b.tables)), "b": sorted(set(b.tables) - set(a.tables))}}


# Quality columns that count samples or describe the setting or the reference, not the engine's answers.
NOT_METRICS = (".rows", ".of", ".images", ".disagree")


def is_metric(column: str, tables: dict[str, Any]) -> bool:
    """A quality column that measures the engine: not a sample count, a shape or the reference's own."""
    return (not column.endswith(NOT_METRICS) and not column.startswith("reference.")
            and column not in set().union(*tables["spec"]["settings"].values()))  # batch and shape keys


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _row(table: str, key: tuple, column: str, change: compare.Change, better: str | None) -> dict[str, Any]:
    regressed = change.counts and better is not None and change.direction != better
    return {"table": table, "row": list(key), "column": column, **change.as_dict(), "better": better,
            "regressed": regressed}


def regressions(result: dict[str, Any], columns: list[str]) -> list[dict[str, Any]]:
    """The shared rows whose named column got worse, beyond the noise and the minimum effect."""
    return [{"study": s, **r} for s, d in result["studies"].items() for r in d["rows"]
            if r["column"] in columns and r["regressed"]]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def markdown(result: dict[str, Any]) -> str:
    """The diff as a page: per study, the rows whose change counts first, then the others."""
    names = result.get("names") or {"a": result["a"], "b": result["b"]}
    lines = [f"# {names['a']} against {names['b']}", "",
             f"A is `{result['a']}`, B is `{result['b']}`. A change counts when it is significant (its "
             f"{compare.LEVEL:.0%} interval leaves out no change) and beyond the minimum effect "
             "(quantstudy/compare.py). Speed: B / A, from each timing job's rounds resampled, widened by the spread "
             "between jobs the runs measured. Quality: B - A, compared exactly (both runs answer the same seeded "
             "samples: a change is in the engines' answers to them).", ""]
    for s in result["only_in"]["a"] + result["only_in"]["b"]:
        lines.append(f"- study `{s}` is in one run only")
    for study, d in result["studies"].items():
        used, eff = d["noise"]["used"], d["min_effect"]
        changed = [r for r in d["rows"] if r["counts"]]
        lines += [f"## {study}", "",
                  f"Decision: A {'ship' if d['decision']['a'] else 'do not ship'}, "
                  f"B {'ship' if d['decision']['b'] else 'do not ship'}. "
                  f"{len(changed)} of {len(d['rows'])} compared values changed beyond the noise. "
                  f"Spread between jobs (sd of log): x {used['x']:.3f}, ms {used['ms']:.3f} "
                  f"(A {d['noise']['a']['ms']:.3f} with {d['noise']['a']['ms_dof']} dof, "
                  f"B {d['noise']['b']['ms']:.3f} with {d['noise']['b']['ms_dof']} dof); "
                  f"minimum effect x {eff['x']:g}, ms {eff['ms']:g}, quality {QUALITY_MIN_EFFECT:g} of the value.", "",
                  "| row | column | A | B | change | interval | n (A, B) | counts |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(d["rows"], key=lambda r: (not r["counts"], r["table"], r["row"], r["column"])):
            sign = "x" if r["kind"] == "ratio" else "+"
            change = f"{sign}{_fmt(r['estimate'])}" if r["kind"] == "ratio" else f"{r['estimate']:+.4g}"
            interval = "exact" if r["low"] == r["high"] else f"{_fmt(r['low'])} to {_fmt(r['high'])}"
            verdict = ("**regressed**" if r["regressed"] else f"**{r['direction']}**") if r["counts"] else "no"
            lines.append(f"| {' / '.join(map(str, r['row']))} | {r['column']} | {_fmt(r['a'])} | {_fmt(r['b'])} | "
                         f"{change} | {interval} | {r['n'][0]}, {r['n'][1]} | {verdict} |")
        for side in ("a", "b"):
            for k in d["only"][side]:
                lines.append(f"\nOnly in {side.upper()}: {' / '.join(map(str, k))}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantstudy.diff", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="a run's results folder (A)")
    parser.add_argument("run_b", help="another run's results folder (B)")
    parser.add_argument("--out", help="write the page here (.md; a .html beside it)")
    parser.add_argument("--json", help="write the comparison as JSON here")
    parser.add_argument("--names", nargs=2, metavar=("A", "B"), help="what to call the two runs on the page")
    parser.add_argument("--fail-on", action="append", default=[], metavar="COLUMN",
                        help="exit 1 when this column regresses in a shared row (x, or a decision condition's column)")
    args = parser.parse_args(argv)
    result = diff(Run.load(args.run_a), Run.load(args.run_b))
    if args.names:
        result["names"] = dict(zip("ab", args.names))
    page = markdown(result)
    if args.out:
        from quantstudy.artifacts import atomic_write
        from quantstudy.render_page import html_page

        atomic_write(args.out, page + "\n")
        atomic_write(Path(args.out).with_suffix(".html"), html_page(page, "quantstudy diff"))
    else:
        print(page)
    if args.json:
        from quantstudy.artifacts import atomic_write

        atomic_write(args.json, json.dumps(result, indent=1) + "\n")
    worse = regressions(result, args.fail_on)
    for r in worse:
        print(f"regressed: {r['study']} {' / '.join(map(str, r['row']))} {r['column']}: {r['a']:.4g} -> {r['b']:.4g}",
              file=sys.stderr)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
