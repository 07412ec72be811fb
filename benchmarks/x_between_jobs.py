"""How far x moves between jobs: the candidate's x per setting in several runs' tables.json.

    python benchmarks/x_between_jobs.py RUN1/tables.json RUN2/tables.json [...] [--names a b ...]
    python benchmarks/x_between_jobs.py RUN/tables.json      # a run with timing repeats: one column per repeat

Each column is one timing job per setting (a run's, or one repeat of a run with `timing_repeats`);
the change columns compare each job with the one before it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def x_by_setting(tables: dict, repeat: int | None = None) -> dict[tuple[str, str, str], float | None]:
    """The candidate's x per setting: the row's x, or that of one repeat (1, 2, ...)."""
    cand = tables["spec"]["candidate"]
    rows = [r for r in tables["speed"] if r["variant"] == cand]
    if repeat is None:
        return {(r["target"], r["model"], r["setting"]): r.get("x") for r in rows}
    return {(r["target"], r["model"], r["setting"]): (r.get("x_by_repeat") or [None] * repeat)[repeat - 1] for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+", type=Path)
    parser.add_argument("--names", nargs="+")
    args = parser.parse_args()
    docs = [json.loads(p.read_text()) for p in args.tables]
    repeats = docs[0]["spec"]["timing"].get("repeats", 1)
    if len(docs) == 1 and repeats > 1:
        names = args.names or [f"r{i}" for i in range(1, repeats + 1)]
        runs = [x_by_setting(docs[0], i) for i in range(1, repeats + 1)]
    else:
        names = args.names or [str(p.parent) for p in args.tables]
        runs = [x_by_setting(d) for d in docs]
    header = ["target", "model", "setting"] + [f"x {n}" for n in names] + \
             [f"{names[i]} vs {names[i - 1]}" for i in range(1, len(names))]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for key in runs[0]:
        xs = [run.get(key) for run in runs]
        changes = [f"{100 * (b / a - 1):+.2f}%" if a and b else "-" for a, b in zip(xs, xs[1:])]
        print("| " + " | ".join([*key, *(f"{x:.4f}" if x else "-" for x in xs), *changes]) + " |")


if __name__ == "__main__":
    main()
