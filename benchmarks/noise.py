"""How far one engine's time moves between the jobs of one run: the baseline's median ms in every timing job
of a setting (each variant's job times its baseline beside it), max over min, per setting.

    .venv/bin/python benchmarks/noise.py [RESULTS_DIR]      # a finished run (default results/)
    .venv/bin/python benchmarks/noise.py --run [--cores 2] [--keep DIR]  # the embedded default in a copy of this checkout
    .venv/bin/python benchmarks/noise.py --drift [SECONDS]  # only this machine's own drift

The goal for a quiet machine (issue 39): at most 1.25 for every setting of the embedded default. It also
prints the noise model the comparisons use (timing.timing_noise: the spread between jobs, pooled),
and with --run the main job's wall time.

With --run and --drift it first measures the machine itself, with nothing else running: one fixed
computation (a one-thread torch float32 matmul, and a pure-Python loop) timed back to back for some
seconds, its median over each quarter-second window, max / min. No scheduling of jobs can take the
between-job spread below this floor: on the 2-core VM of 2026-12-06 it was 1.50 for both, and one
engine timed twelve times in one process, half a second apart, moved its median 2.3x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from quantstudy import paths
from quantstudy.devtools import copy_checkout, snakemake
from quantstudy.timing import timing_noise

ROOT = Path(__file__).resolve().parent.parent
GOAL = 1.25
DRIFT_WINDOW_S = 0.25  # about a timing job's measuring time per engine in the embedded default
DRIFT_SECONDS = 20.0  # both workloads together


def baseline_medians(results: Path) -> dict[tuple, list[float]]:
    """(study, target, model, setting, graph, baseline) -> the baseline's median ms in each job that timed it."""
    groups: dict[tuple, list[float]] = {}
    for path in paths.glob(results, paths.TIMING):
        doc = json.loads(path.read_text())
        if doc.get("status") != "ok":
            continue
        study = path.relative_to(results).parts[0]
        for g, graph in doc["graphs"].items():
            key = (study, doc["target"], doc["model"], doc["setting"], g, doc["baseline"])
            groups.setdefault(key, []).append(graph["baseline_ms"]["median_ms"])
    return groups


def report(results: Path) -> float:
    """Print the table and the noise per study; return the worst max / min."""
    groups = baseline_medians(results)
    print("| study | target | model | setting | graph | baseline | jobs | min ms | max ms | max / min |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 1.0
    for key, ms in groups.items():
        if len(ms) < 2:
            continue
        ratio = max(ms) / min(ms)
        worst = max(worst, ratio)
        print("| " + " | ".join(key) + f" | {len(ms)} | {min(ms):.4f} | {max(ms):.4f} | {ratio:.2f}"
              + (" **over the goal**" if ratio > GOAL else "") + " |")
    print(f"\nworst max / min: {worst:.2f} (goal: at most {GOAL})")
    for study in sorted({k[0] for k in groups}):
        docs = [json.loads(p.read_text()) for p in paths.glob(results, paths.TIMING, study=study)]
        noise = timing_noise(docs)
        print(f"{study}: spread between jobs (sd of log), ms {noise['ms']:.3f} ({noise['ms_dof']} dof), "
              f"x {noise['x']:.3f} (from {noise['x_from']}, {noise['x_dof']} dof)")
    return worst


def machine_drift(seconds: float) -> dict[str, float]:
    """{workload: max / min of its median over DRIFT_WINDOW_S windows}, each workload timed back to back for
    `seconds` in this one process: how far the machine's own speed moves with nothing else to blame."""
    import torch

    torch.set_num_threads(1)  # as every CPU job runs (steps.job_settings)
    a = torch.rand(192, 192, generator=torch.Generator().manual_seed(0))

    def python_loop() -> int:
        return sum(i * i for i in range(20_000))

    workloads = {"float32 matmul 192x192 (torch, one thread)": lambda: a @ a, "Python loop": python_loop}
    drift = {}
    for name, call in workloads.items():
        medians, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds / len(workloads):
            window, opened = [], time.perf_counter()
            while time.perf_counter() - opened < DRIFT_WINDOW_S:
                t = time.perf_counter()
                call()
                window.append(time.perf_counter() - t)
            medians.append(statistics.median(window))
        drift[name] = max(medians) / min(medians)
        print(f"machine drift, {name}: median over {len(medians)} windows of {DRIFT_WINDOW_S} s, "
              f"max / min {drift[name]:.2f}")
    return drift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", type=Path, default=ROOT / "results")
    parser.add_argument("--run", action="store_true", help="run the embedded default in a copy of this checkout")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="with --run: run in this new folder and keep it (default: a temporary one)")
    parser.add_argument("--drift", nargs="?", type=float, const=DRIFT_SECONDS, default=None, metavar="SECONDS",
                        help=f"measure this machine's own drift for SECONDS (default {DRIFT_SECONDS:g}); "
                             "--run measures it before the run")
    args = parser.parse_args()
    if not args.run:
        if args.drift:
            machine_drift(args.drift)
        else:
            report(args.results)
        return
    drift = machine_drift(args.drift or DRIFT_SECONDS)
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_checkout(ROOT, args.keep or Path(tmp) / "repo")
        start = time.perf_counter()
        proc = snakemake(repo, cores=args.cores)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        worst = report(repo / "results")
        print(f"embedded default, whole DAG ({args.cores} cores): {wall:.1f} s")
        floor = max(drift.values())
        if worst > GOAL and floor > GOAL:
            print(f"this machine's own drift ({floor:.2f}) is above the goal: no run here can resolve it")


if __name__ == "__main__":
    main()
