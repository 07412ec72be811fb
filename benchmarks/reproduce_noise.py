"""Does `audit reproduce` pass honest re-executions and catch forgeries of the size its noise model claims?

    .venv/bin/python benchmarks/reproduce_noise.py [--repo DIR] [--jobs 10] [--seed 0]

Runs the embedded default in a copy of this checkout (or uses DIR, a copy that has run it), then re-executes
`--jobs` timing jobs drawn with the seed across the five studies through `audit reproduce` (the real
re-execution, through Snakemake in a scratch copy) and counts those that agree with their records. Against
each re-executed job it then sets the record forged with care (devtools.forge_faster: the variant's rounds
divided by a factor, its medians and x made again from them), as a forger who also re-aggregated the study
would leave it, and counts the factors caught. Prints the smallest factor caught in every job, and the
factor the noise model claims to detect (reproduce.detectable) in each.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
from pathlib import Path

from quantstudy import paths, reproduce
from quantstudy.artifacts import read_json
from quantstudy.devtools import copy_checkout, forge_faster, snakemake

ROOT = Path(__file__).resolve().parent.parent
FACTORS = (1.1, 1.2, 1.3, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, help="a copy of the checkout that has run the embedded default")
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.repo
        if repo is None:
            repo = copy_checkout(ROOT, Path(tmp) / "repo")
            proc = snakemake(repo, cores=2)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
        run(repo.resolve(), args.jobs, args.seed, Path(tmp))


def run(repo: Path, jobs: int, seed: int, tmp: Path) -> None:
    import os

    os.chdir(repo)  # reproduce works from the checkout's root, as the audit command does
    studies = [p.parent.name for p in paths.glob(paths.RESULTS, paths.TABLES)]
    pool = [(s, t) for s in studies for t in reproduce.candidates(Path(paths.STUDY_DIR.format(study=s)))["time"]]
    chosen = random.Random(seed).sample(pool, min(jobs, len(pool)))
    honest, caught, claimed, at_claim = 0, {f: 0 for f in FACTORS}, [], 0
    for study in sorted({s for s, _ in chosen}):
        jobs_of_study = [t for s, t in chosen if s == study]
        study_dir = Path(paths.STUDY_DIR.format(study=study))
        report = reproduce.reproduce(study_dir, "config/config.yaml", jobs_of_study, tmp / f"scratch-{study}")
        noise, min_effect = report["timing_noise"], report["min_effect"]
        for job in report["jobs"]:
            honest += job["ok"]
            print(f"{'agrees' if job['ok'] else 'DIFFERS'}: {job['path']}"
                  + "".join(f"\n    {d['key']}: recorded {d['recorded']:.4g}, reproduced {d['reproduced']:.4g}"
                            for d in job.get("differences", [])))
            rerun = read_json(Path(report["scratch"]) / job["path"], "timing")
            recorded = read_json(job["path"], "timing")
            claim = max(job["detectable_x"].values())
            claimed.append(claim)
            forged = copy.deepcopy(recorded)
            forge_faster(forged, claim * 1.001)  # just beyond the size this check claims to catch
            at_claim += bool(reproduce.compare_timing(forged, rerun, min_effect, noise))
            for factor in FACTORS:
                forged = copy.deepcopy(recorded)
                forge_faster(forged, factor)
                caught[factor] += bool(reproduce.compare_timing(forged, rerun, min_effect, noise))
        print(f"{study}: spread between jobs {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in noise.items()})}")
    n = len(chosen)
    print(f"\nhonest re-executions that agree with their records: {honest} of {n}")
    for factor in FACTORS:
        print(f"forged {factor:g} times faster: caught in {caught[factor]} of {n}")
    smallest = next((f for f in FACTORS if caught[f] == n), None)
    print(f"smallest forgery factor caught in every job: {smallest}")
    print(f"factor the noise model claims to detect: {min(claimed):.3f} to {max(claimed):.3f} (per job)")
    print(f"forged by the factor each job's check claims to detect: caught in {at_claim} of {n}")


if __name__ == "__main__":
    main()
