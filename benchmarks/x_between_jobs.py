"""How far x moves between jobs: the candidate's x per setting in several runs' tables.json.

    python benchmarks/x_between_jobs.py RUN1/tables.json RUN2/tables.json [...] [--names a b ...]

Each column is one run (one timing job per setting); the change columns compare each run with
the one before it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def x_by_setting(tables: dict) -> dict[tuple[str, str, str], float | None]:
    cand = tables["spec"]["candidate"]
    return {(r["target"], r["model"], r["setting"]): r.get("x") for r in tables["speed"] if r["variant"] == cand}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+", type=Path)
    parser.add_argument("--names", nargs="+")
    args = parser.parse_args()
    names = args.names or [str(p.parent) for p in args.tables]
    runs = [x_by_setting(json.loads(p.read_text())) for p in args.tables]
    header = ["target", "model", "setting"] + [f"x {n}" for n in names] + \
             [f"{names[i]} vs {names[i - 1]}" for i in range(1, len(names))]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for key in runs[0]:
        xs = [run.get(key) for run in runs]
        changes = [f"{100 * (b / a - 1):+.2f}%" if a and b else "-" for a, b in zip(xs, xs[1:])]
        print("| " + " | ".join([*key, *(f"{x:.4f}" if x else "-" for x in xs), *changes]) + " |")


if __name__ == "__main__":
    main()
