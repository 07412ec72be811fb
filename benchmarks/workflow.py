"""Prints the embedded default's wall time, the no-op rerun time and the job count of a one-variant change.

    .venv/bin/python benchmarks/workflow.py [--cores 2]

Runs in a temporary copy of this checkout, so the checkout's own results are untouched.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import yaml

from quantstudy.devtools import copy_checkout, planned_jobs, snakemake

ROOT = Path(__file__).resolve().parent.parent


def timed(workdir: Path, *args: str, cores: int) -> tuple[float, str]:
    start = time.perf_counter()
    proc = snakemake(workdir, *args, cores=cores)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return time.perf_counter() - start, proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=2)
    cores = parser.parse_args().cores
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_checkout(ROOT, Path(tmp) / "repo")
        full, out = timed(repo, cores=cores)
        logs = list((repo / "logs").rglob("*.log"))
        forked = sum("job server worker" in f.read_text(errors="replace") for f in logs)
        jobs = len(planned_jobs(timed(repo, "-n", "--forceall", cores=cores)[1]))
        noop, _ = timed(repo, cores=cores)
        config = yaml.safe_load((repo / "config/config.yaml").read_text())
        (repo / "change.yaml").write_text(yaml.safe_dump(
            {"variants": {"fp8-no-output-dense": {"transforms": [{"fp8": {"exclude": ["*.output.dense", "*.0.*"]}}]}}}))
        config["studies"]["fnet"]["overrides"] = [config["studies"]["fnet"]["overrides"], "change.yaml"]
        (repo / "changed.yaml").write_text(yaml.safe_dump(config, sort_keys=False))  # target order is a param
        changed = planned_jobs(timed(repo, "-n", "--configfile", "changed.yaml", cores=cores)[1])
    print(f"embedded default, whole DAG ({jobs} jobs, {cores} cores): {full:.1f} s")
    # A job whose Python or checkout differs from the server's runs in its own process (a PYTHONPATH
    # that puts another checkout first does that to every job).
    print(f"jobs forked from the local job server: {forked} of {len(logs)} job logs")
    print(f"no-op rerun: {noop:.1f} s")
    print(f"one variant's params changed (fp8-no-output-dense): {len(changed)} jobs "
          f"{dict(collections.Counter(rule for rule, _ in changed))}")


if __name__ == "__main__":
    main()
