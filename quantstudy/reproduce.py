"""Re-execute a seeded sample of a study's measurement jobs and compare their numbers.

A hand-edited measurement JSON with a recomputed digest passes every hash check; it does not
survive its job being run again. `reproduce` copies the checkout into a scratch directory (code and
config copied, the study's results hard-linked, the HF cache linked), reruns the chosen `evaluate`
and `time` jobs there through Snakemake (only those rules may run; nothing upstream is rebuilt),
and compares each new JSON with the recorded one within the tolerances below.

    python -m quantstudy.audit reproduce results/fnet [--configfile config/config.yaml]
        [--evaluate 3] [--time 1] [--seed 0] [--jobs results/fnet/.../quality.json ...]
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from quantstudy import compare, devtools, paths
from quantstudy.timing import timing_noise
from quantstudy.artifacts import DamagedArtifact, gpu_name, leaves, now, provenance, read_json, write_json

# How a re-executed job's numbers are compared with the recorded ones: by compare.compare, the one
# comparison (a difference counts when it is significant and beyond a minimum effect).
# - evaluate: every number of quality.json (metric blocks, non-finite counts, probe), exact values. The same
#   engine on the same inputs on one CPU thread sums in one order: bit for bit (minimum effect 0). A GPU
#   may pick another GEMM algorithm or reduction order between processes: relative 1e-5.
# - time: x and the median ms of each graph (compare_timing), with the study's minimum effects
#   (`timing.min_effect`) and its noise between jobs (timing_noise).
QUALITY_TOLERANCE = {"cpu": 0.0, "cuda": 1e-5}
SKIP_KEYS = frozenset({"provenance", "content_sha256", "schema", "schema_version"})


def quality_tolerance(doc: dict[str, Any]) -> float:
    """The minimum effect of a quality number of this job: bit for bit on a CPU, 1e-5 of it on a GPU."""
    return QUALITY_TOLERANCE["cpu" if doc["provenance"]["params"]["target"]["device"] == "cpu" else "cuda"]


def compare_quality(recorded: dict[str, Any], reproduced: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """Every number (or string) of two quality.json whose difference counts beyond `tolerance`, a share of
    the larger magnitude (exact values: no samples, no spread between jobs)."""
    a, b = leaves(recorded, skip=SKIP_KEYS), leaves(reproduced, skip=SKIP_KEYS)
    diffs = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
        if numbers and not compare.compare(compare.exact(x), compare.exact(y), tolerance, kind="difference").counts:
            continue
        if not numbers and x == y:
            continue
        diffs.append({"key": key, "recorded": x, "reproduced": y, "tolerance": tolerance})
    return diffs


def compare_timing(recorded: dict[str, Any], reproduced: dict[str, Any], min_effect: dict[str, float],
                   noise: dict[str, float]) -> list[dict[str, Any]]:
    """x and the median ms of every graph whose change from the record to the re-executed job counts
    (compare.compare, as ratios): beyond `min_effect` ({"x", "ms"}, shares) and beyond the noise, which is
    the re-executed job's rounds (resampled; paired for x) and the study's spread between jobs (`noise`,
    {"x", "ms"}: timing_noise). The record's own rounds decide nothing: a forger could widen them."""
    diffs = []
    for g in sorted(set(recorded.get("graphs", {})) | set(reproduced.get("graphs", {}))):
        r, p = recorded.get("graphs", {}).get(g), reproduced.get("graphs", {}).get(g)
        if r is None or p is None or r.get("x") is None or p.get("x") is None:
            diffs.append({"key": f"graphs.{g}.x", "recorded": r and r.get("x"), "reproduced": p and p.get("x"),
                          "tolerance": None, "change": None})
            continue
        x = compare.speedup_of(p["baseline_ms"]["samples_ms"], p["variant_ms"]["samples_ms"])
        changes = {"x": compare.compare(x.at(r["x"]), x, min_effect["x"], noise["x"])}
        for ms in ("variant_ms", "baseline_ms"):
            m = compare.median_of(p[ms]["samples_ms"])
            changes[f"{ms}.median_ms"] = compare.compare(m.at(r[ms]["median_ms"]), m, min_effect["ms"], noise["ms"])
        for key, change in changes.items():
            if change.counts:
                diffs.append({"key": f"graphs.{g}.{key}", "recorded": change.a, "reproduced": change.b,
                              "tolerance": None, "change": change.as_dict()})
    if recorded.get("engine_sha256") != reproduced.get("engine_sha256"):
        diffs.append({"key": "engine_sha256", "recorded": recorded.get("engine_sha256"),
                      "reproduced": reproduced.get("engine_sha256"), "tolerance": None, "change": None})
    return diffs


def detectable(reproduced: dict[str, Any], min_effect: dict[str, float], noise: dict[str, float]) -> dict[str, float]:
    """Per graph, the smallest factor on x by which a record may differ from this re-executed job and be
    caught (compare.Change.detectable): what this check can and cannot see."""
    return {g: compare.compare(x.at(x.value), x, min_effect["x"], noise["x"]).detectable()
            for g, p in reproduced.get("graphs", {}).items() if p.get("x") is not None
            for x in [compare.speedup_of(p["baseline_ms"]["samples_ms"], p["variant_ms"]["samples_ms"])]}


def _device_allows(doc: dict[str, Any]) -> str | None:
    """Why this machine cannot re-execute the job, or None: a GPU job needs the recorded GPU model."""
    device = doc["provenance"]["params"]["target"]["device"]
    if device == "cpu":
        return None
    import torch

    recorded = gpu_name(doc["provenance"]["hardware"])
    if not torch.cuda.is_available():
        return f"it ran on {recorded or device}, and this machine has no GPU"
    here = torch.cuda.get_device_name()
    return None if here == recorded else f"it ran on {recorded}, this machine has {here}"


def candidates(study_dir: Path) -> dict[str, list[str]]:
    """The study's finished measurement JSONs by rule ({'evaluate': [...], 'time': [...]}), from tables.json."""
    tables = read_json(paths.in_folder(study_dir, paths.TABLES), "tables")
    found: dict[str, list[str]] = {"evaluate": [], "time": []}
    for table, rule in (("quality", "evaluate"), ("speed", "time")):
        for row in tables[table]:
            # a row of several jobs (repeats) names each in `timing_sources` / `quality_sources`
            sources = row.get("timing_sources") or row.get("quality_sources") or [row.get("source")]
            for source in sources if row.get("status") == "ok" else []:
                if source and source not in found[rule]:
                    found[rule].append(source)
    return found


def choose(study_dir: Path, evaluate: int, time: int, seed: int) -> list[str]:
    """A seeded sample: `evaluate` quality.json and `time` timing.json of the study."""
    rng, found = random.Random(seed), candidates(study_dir)
    return sorted(rng.sample(found["evaluate"], min(evaluate, len(found["evaluate"])))
                  + rng.sample(found["time"], min(time, len(found["time"]))))


# What a scratch copy leaves out or links instead of copying: the venv, git, other studies' results,
# logs and the HF cache (linked).
NOT_COPIED = {".git", ".venv", ".snakemake", "results", "resources", "logs"}


def scratch_copy(study: str, scratch: Path) -> Path:
    """The checkout as it is here (code and config copied), the study's results hard-linked (every
    writer replaces a file by rename, so the originals are never written through a link), Snakemake's
    metadata copied and the HF cache linked."""
    root = Path.cwd()
    scratch.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name not in NOT_COPIED:
            if entry.is_dir():
                shutil.copytree(entry, scratch / entry.name, symlinks=True)
            else:
                shutil.copy2(entry, scratch / entry.name)
    study_dir = paths.STUDY_DIR.format(study=study)
    shutil.copytree(root / study_dir, scratch / study_dir, copy_function=os.link, dirs_exist_ok=True)
    if (root / ".snakemake/metadata").is_dir():
        shutil.copytree(root / ".snakemake/metadata", scratch / ".snakemake/metadata")
    (scratch / "resources").mkdir(exist_ok=True)
    if (root / "resources/hf-cache").exists() and not (scratch / "resources/hf-cache").exists():
        (scratch / "resources/hf-cache").symlink_to((root / "resources/hf-cache").resolve())
    return scratch


def reproduce(study_dir: str | Path, configfile: str, jobs: list[str], scratch: str | Path | None = None,
              cores: int = 2, out: str | Path | None = None) -> dict[str, Any]:
    """Re-execute `jobs` (measurement JSON paths of one study) in a scratch copy and compare."""
    from quantstudy import config

    started, study_dir = now(), Path(study_dir)
    scratch = Path(scratch or tempfile.mkdtemp(prefix=f"reproduce-{study_dir.name}-"))
    report: dict[str, Any] = {"study": study_dir.name, "configfile": configfile, "scratch": str(scratch),
                              "jobs": [], "skipped": []}
    min_effect = config.run_of_study(configfile, study_dir.name).studies[study_dir.name].timing.min_effect
    recorded, runnable = {}, []
    for path in jobs:
        try:
            recorded[path] = read_json(path)
        except DamagedArtifact as e:  # refused on read already: nothing to reproduce it against
            report["skipped"].append({"path": path, "why": e.problem})
            continue
        why = _device_allows(recorded[path])
        if why:
            report["skipped"].append({"path": path, "why": why})
        else:
            runnable.append(path)
    if any(recorded[p]["provenance"]["rule"] == "time" for p in runnable):
        noise = timing_noise([read_json(p, "timing") for p in candidates(study_dir)["time"]])
        report["timing_noise"], report["min_effect"] = noise, min_effect
    if runnable:
        scratch_copy(study_dir.name, scratch)
        rules = sorted({recorded[p]["provenance"]["rule"] for p in runnable})
        # Only the measurement rules may run, on the recorded inputs: a changed param or code of an
        # upstream rule must not rebuild what is being checked (mtime alone decides what is stale).
        proc = devtools.snakemake(scratch, "--configfile", configfile, "--forcerun", *rules, "--allowed-rules",
                                  *rules, "--rerun-triggers", "mtime", "--keep-going", "--", *runnable, cores=cores)
        report["snakemake_exit"] = proc.returncode
        if proc.returncode != 0:
            report["snakemake_error"] = proc.stderr[-3000:]
    for path in runnable:
        job = {"path": path, "rule": recorded[path]["provenance"]["rule"],
               "recorded_commit": recorded[path]["provenance"].get("workflow_commit")}
        try:
            new = read_json(scratch / path)
        except (DamagedArtifact, FileNotFoundError) as e:
            job.update(ok=False, problem=f"the re-executed job wrote no readable result: {e}")
            report["jobs"].append(job)
            continue
        job["reproduced_commit"] = new["provenance"].get("workflow_commit")
        if new.get("status") != "ok":
            job.update(ok=False, problem=f"the re-executed job failed: {new.get('error', '')[-500:]}")
        elif job["rule"] == "evaluate":
            job["differences"] = compare_quality(recorded[path], new, quality_tolerance(new))
            job["ok"] = not job["differences"]
        else:
            job["differences"] = compare_timing(recorded[path], new, min_effect, noise)
            job["detectable_x"] = detectable(new, min_effect, noise)
            job["ok"] = not job["differences"]
        report["jobs"].append(job)
    report["ok"] = bool(report["jobs"]) and all(j["ok"] for j in report["jobs"])
    report["provenance"] = provenance("reproduce", {p: p for p in recorded}, {"configfile": configfile}, started)
    write_json(out or scratch / paths.REPRODUCE, "reproduce", report)
    return report


def _why(d: dict[str, Any]) -> str:
    """How far apart a difference is and what it is measured against."""
    c = d.get("change")
    if c is not None:
        return (f" (x {c['estimate']:.3f}, {c['level']:.0%} interval {c['low']:.3f} to {c['high']:.3f}, "
                f"minimum effect {c['min_effect']:g})")
    return f" (tolerance {d['tolerance']:g})" if d.get("tolerance") is not None else ""


def summary(report: dict[str, Any]) -> str:
    """The report for a person: one line per job, each difference under it."""
    lines = [f"reproduced {len(report['jobs'])} jobs of {report['study']} in {report['scratch']}"]
    for j in report["jobs"]:
        lines.append(f"  {'ok ' if j['ok'] else 'DIFFERS'} {j['rule']}: {j['path']}")
        if j.get("problem"):
            lines.append(f"      {j['problem']}")
        for d in j.get("differences", [])[:10]:
            lines.append(f"      {d['key']}: recorded {d['recorded']!r}, reproduced {d['reproduced']!r}" + _why(d))
        for g, factor in j.get("detectable_x", {}).items():
            lines.append(f"      {g}: catches a record whose x is {factor:.2f} times off or more")
        if len(j.get("differences", [])) > 10:
            lines.append(f"      ... and {len(j['differences']) - 10} more")
    for s in report["skipped"]:
        lines.append(f"  skipped {s['path']}: {s['why']}")
    lines.append("every re-executed job agrees with its record" if report["ok"] else
                 "the records and the re-executed jobs differ" if report["jobs"] else "nothing was re-executed")
    return "\n".join(lines)
