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


LINK = re.compile(r"\]\(([^)\s]+)\)|(?:href|src)=\"([^\"]+)\"")


def dead_links(markdown: str | Path) -> list[str]:
    """The relative links and images of a Markdown file whose target file does not exist (anchors
    ignored): what a reader who clicks it would not find."""
    markdown = Path(markdown)
    dead = []
    for match in LINK.finditer(markdown.read_text()):
        target = (match.group(1) or match.group(2)).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, a URL, a data URI
            continue
        if not (markdown.parent / target).exists():
            dead.append(target)
    return dead


def malformed_tables(markdown: str) -> list[str]:
    """The rows of the Markdown tables in `markdown` whose cell count differs from their header's
    (a row run into the next, a missing cell): each as `line N: expected, found`."""
    def cells(line: str) -> int:
        return len(re.split(r"(?<!\\)\|", line.strip())) - 2

    problems, header = [], None
    for n, line in enumerate(markdown.splitlines(), 1):
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells(line)
        elif cells(line) != header:
            problems.append(f"line {n}: {header} cells expected, {cells(line)} found")
    return problems


def lines_outside_folds(markdown: str) -> int:
    """The lines of a README a reader sees without opening a fold (<details>)."""
    depth = seen = 0
    for line in markdown.splitlines():
        depth += line.count("<details>")
        seen += depth == 0
        depth -= line.count("</details>")
    return seen


def rewrite_json(path: str | Path, edit) -> None:
    """Edit an artifact as a careful forger would: change its values (`edit(doc)`), then recompute its digest."""
    import json

    from quantstudy.artifacts import write_json

    doc = json.loads(Path(path).read_text())
    edit(doc)
    write_json(path, doc["schema"], {k: v for k, v in doc.items() if k not in ("schema", "schema_version",
                                                                              "content_sha256")})


def forge_faster(doc: dict, factor: float) -> None:
    """A timing forged with care: every graph's variant rounds divided by `factor`, and its summary and x made
    again from them as the time job makes them, so that every derived number agrees with the samples."""
    from quantstudy import timing

    for g in doc["graphs"].values():
        g["variant_ms"] = timing.summarize([t / factor for t in g["variant_ms"]["samples_ms"]])
        g.update(timing.speedup(g["baseline_ms"]["samples_ms"], g["variant_ms"]["samples_ms"]))
