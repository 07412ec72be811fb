"""Prints where a run's GPU time went: each rule's job-seconds, and each measurement job's seconds
opening engines against the rest of the job (measuring, loading inputs, writing).

    .venv/bin/python benchmarks/gpu_cost.py RUN_DIR [--study timm_xcit]

RUN_DIR holds the run's `benchmarks/` (Snakemake's benchmark TSV of each job: its wall seconds) and
`logs/` (the job logs). A job's opening seconds are the sum of its log's `opened ... in X s` lines,
which the torch backend writes when it opens an engine from its build's compiled program; a job of
a run from before that (or a backend that logs no such line) shows its opening seconds as `-`. Where
those lines give the opening's parts (weights, artifacts, trace, compiler, calls, capture, waiting:
TorchBackend.open) and the work it redid (compiling, autotuning), each rule's seconds in each, and
the largest of one opening, are printed too. Where the logs give a measurement's wait for its turn
on the GPU alone (timing.gpu_turn: until other jobs' GPU work ends), each rule's waits are printed.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

GPU_RULES = ("reference", "calibrate", "build", "rebuild", "time", "profile", "gemm", "evaluate")
MEASUREMENT_RULES = ("time", "profile", "gemm", "evaluate")
OPENED = re.compile(r" opened \S+ at .* in ([0-9.]+) s from .*")
PHASE = re.compile(r"(\w+) (-?[0-9.]+) s")  # a part of an opening in its `opened` line: "trace 3.21 s"
TURN = re.compile(r" GPU turn alone after waiting ([0-9.]+) s")


def rule_of(tsv: Path) -> str:
    """A benchmark file's rule: its name, less a timing repeat's suffix (time-r2.tsv -> time)."""
    return re.sub(r"-r\d+$", "", tsv.stem)


def jobs(run: Path, study: str | None = None) -> list[dict]:
    """Every job of the run with a benchmark TSV: its rule, key (folder), wall seconds and the seconds
    its log says it spent opening engines (None where its log says nothing of it)."""
    found = []
    root = run / "benchmarks" / (study or "")
    for tsv in sorted(root.rglob("*.tsv")):
        lines = tsv.read_text().splitlines()
        if len(lines) < 2:
            continue
        seconds = float(lines[1].split("\t")[0])
        key = tsv.relative_to(run / "benchmarks").with_suffix("")
        log = run / "logs" / key.with_suffix(".log")
        text = log.read_text(errors="replace") if log.exists() else ""
        lines = list(OPENED.finditer(text))
        opened = [float(m.group(1)) for m in lines]
        # "...0 misses; weights 0.50 s, ..., waiting 0.00 s; of which compiling 0.00 s, autotuning 0.00 s)"
        parts = [m.group(0).partition("misses; ")[2].partition("; of which ") for m in lines]
        found.append({"rule": rule_of(tsv), "key": str(key), "seconds": seconds, "opens": len(opened),
                      "open_seconds": sum(opened) if opened else None, "openings": opened,
                      "open_phases": [_seconds(p[0]) | {f"{k} (redone)": v for k, v in _seconds(p[2]).items()}
                                      for p in parts if p[0]],
                      "turn_waits": [float(w) for w in TURN.findall(text)]})
    return found


def _seconds(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in PHASE.findall(text)}


def phase_report(found: list[dict]) -> list[str]:
    """Each measurement rule's opening seconds by part: the sum over its jobs' openings, and the largest
    of one opening (in brackets). Empty where no log gives the parts."""
    parts = list(dict.fromkeys(k for j in found for p in j["open_phases"] for k in p))
    if not parts:
        return []
    lines = ["", "opening engines, by part: seconds summed over the rule's openings [largest in one opening]; "
                 "(redone): work within those parts that the build should have done",
             f"{'rule':<10} {'opens':>5}  " + "  ".join(f"{k:>18}" for k in parts)]
    for rule in MEASUREMENT_RULES:
        opens = [p for j in found if j["rule"] == rule for p in j["open_phases"]]
        if opens:
            cells = [f"{sum(p.get(k, 0) for p in opens):.1f} [{max(p.get(k, 0) for p in opens):.1f}]" for k in parts]
            lines.append(f"{rule:<10} {len(opens):>5}  " + "  ".join(f"{c:>18}" for c in cells))
    return lines


def wait_report(found: list[dict]) -> list[str]:
    """Each measurement rule's waits for its turns on the GPU alone: how many, their sum and the longest.
    Empty where no log gives them (a run from before them, or a CPU run)."""
    if not any(j["turn_waits"] for j in found):
        return []
    lines = ["", "waiting for the GPU alone (a measurement's turn, until other jobs' GPU work ended)",
             f"{'rule':<10} {'turns':>5} {'seconds':>8} {'longest':>8}"]
    for rule in MEASUREMENT_RULES:
        waits = [w for j in found if j["rule"] == rule for w in j["turn_waits"]]
        if waits:
            lines.append(f"{rule:<10} {len(waits):>5} {sum(waits):>8.1f} {max(waits):>8.1f}")
    return lines


def report(found: list[dict]) -> str:
    by_rule: dict[str, list[dict]] = defaultdict(list)
    for j in found:
        by_rule[j["rule"]].append(j)
    lines = ["rule        jobs  job-seconds  open-seconds  rest-seconds  max open (one engine)"]
    total = 0.0
    for rule in GPU_RULES:
        js = by_rule.get(rule, [])
        if not js:
            continue
        seconds = sum(j["seconds"] for j in js)
        total += seconds
        logged = [j for j in js if j["open_seconds"] is not None]
        opened = sum(j["open_seconds"] for j in logged)
        most = max((o for j in logged for o in j["openings"]), default=None)
        lines.append(f"{rule:<10} {len(js):>5} {seconds:>12.1f} "
                     f"{(f'{opened:.1f}' if logged else '-'):>13} {(f'{seconds - opened:.1f}' if logged else '-'):>13}"
                     f"  {(f'{most:.1f}' if most is not None else '-'):>8}")
    lines.append(f"GPU rules, all jobs: {total:.1f} job-seconds")
    lines += phase_report(found)
    lines += wait_report(found)
    lines.append("")
    lines.append("measurement jobs: seconds opening engines / whole job")
    for j in found:
        if j["rule"] in MEASUREMENT_RULES:
            opened = f"{j['open_seconds']:.1f} ({j['opens']} engines)" if j["open_seconds"] is not None else "-"
            lines.append(f"  {j['key']}: {opened} / {j['seconds']:.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a folder holding the run's benchmarks/ and logs/")
    parser.add_argument("--study", help="one study's jobs only")
    args = parser.parse_args()
    found = jobs(args.run, args.study)
    if not found:
        raise SystemExit(f"no benchmark TSV under {args.run / 'benchmarks' / (args.study or '')}")
    print(report(found))


if __name__ == "__main__":
    main()
