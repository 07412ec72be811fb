"""Audit a rendered study: every number back to its artifacts and pinned inputs.

The chain: the README is exactly what the templates render from tables.json; tables.json
names each JSON it read with its sha256; each of those names its own inputs the same way,
down to checkpoint.json, whose file hashes are checked against the snapshot on disk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from quantstudy.artifacts import DamagedArtifact, now, provenance, read_json, sha256_file, sha256_path, write_json

log = logging.getLogger("quantstudy")


def check_chain(tables_json: str | Path) -> dict[str, Any]:
    """Follow provenance inputs from tables.json; report every missing or changed file."""
    problems: list[str] = []
    seen: set[str] = set()
    todo = [str(tables_json)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if not path.endswith(".json"):
            continue
        try:
            doc = read_json(path)
        except DamagedArtifact as e:
            problems.append(str(e))
            continue
        for name, entry in doc.get("provenance", {}).get("inputs", {}).items():
            p = Path(entry["path"])
            if not p.exists():
                problems.append(f"{path}: input {name} ({p}) is missing")
            elif sha256_path(p) != entry["sha256"]:
                problems.append(f"{path}: input {name} ({p}) changed since it was read")
            else:
                todo.append(str(p))
        if doc.get("schema") == "checkpoint":
            snapshot = Path(doc["snapshot"])
            for rel, digest in doc["files"].items():
                f = snapshot / rel
                if not f.exists() or sha256_file(f) != digest:
                    problems.append(f"{path}: checkpoint file {rel} is missing or differs from its recorded sha256")
    return {"files_checked": len(seen), "problems": problems}


def audit(tables_json: str, readme: str, out: str) -> None:
    from quantstudy import render

    started = now()
    tables = read_json(tables_json, "tables")
    readme_matches = render.render_section(tables) == Path(readme).read_text()
    chain = check_chain(tables_json)
    if not readme_matches:
        chain["problems"].insert(0, f"{readme} is not what the templates render from {tables_json}")
    chain["problems"] += [f"an input could not be read: {d['error']}" for d in tables.get("damaged", [])]
    for p in chain["problems"]:
        log.warning(p)
    log.info("audited %d files: %d problems", chain["files_checked"], len(chain["problems"]))
    write_json(out, "audit", {"ok": not chain["problems"], "readme_matches_tables": readme_matches, **chain,
                              "provenance": provenance("audit", {"tables": tables_json, "readme": readme}, {}, started)})
    if chain["problems"]:  # the run fails; the problems are in the log (Snakemake removes a failed job's output)
        raise AuditFailed(f"the audit of {readme} found {len(chain['problems'])} problems; the first: "
                          f"{chain['problems'][0]}")


class AuditFailed(RuntimeError):
    """A rendered README that cannot be traced to intact artifacts."""
