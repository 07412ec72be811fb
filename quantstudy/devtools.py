"""Helpers the tests and benchmarks share for driving the workflow from outside (not used by rules)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def copy_checkout(src: str | Path, dest: str | Path) -> Path:
    """Copy a checkout's tracked and new (not ignored) files: what a fresh clone plus local edits holds."""
    src, dest = Path(src), Path(dest)
    files = subprocess.run(["git", "ls-files", "-coz", "--exclude-standard"], cwd=src, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):  # NUL-separated: names with spaces survive
        if (src / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dest / f)
    return dest


def snakemake(workdir: str | Path, *args: str, cores: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", str(cores), *args], cwd=workdir,
                          capture_output=True, text=True)


def planned_jobs(dry_run_output: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, wildcards) of every job a `snakemake -n` output lists."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", dry_run_output):
        m = re.match(r"(?:local)?rule (\w+):", block.strip())
        if m:
            w = re.search(r"wildcards: (.*)", block)
            wildcards = dict(kv.split("=", 1) for kv in w.group(1).split(", ")) if w else {}
            jobs.append((m.group(1), wildcards))
    return jobs
