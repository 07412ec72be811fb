"""The lock file (config/revisions.lock.yaml): the commits that revisions a config leaves unpinned resolve to.

A study config names each checkpoint and dataset revision as the write-up gives it: a full commit
(pinned), a short hash, or nothing. Config loading (quantstudy.config) reads the commit of each of
the others from this file and stops the run where one is missing; the lock step (quantstudy.lock,
on a machine that reaches the hub) writes them. This module is what both read: it imports neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from quantstudy.artifacts import atomic_write

ROOT = Path(__file__).resolve().parent.parent
LOCK_FILE = ROOT / "config" / "revisions.lock.yaml"
FULL = re.compile(r"^[0-9a-f]{40}$")
SHORT = re.compile(r"^[0-9a-f]{7,39}$")


class LockError(ValueError):
    """A revision that cannot be resolved, worded for the person running the lock step."""


@dataclass(frozen=True)
class Request:
    """One revision a config names that is not a full commit."""

    repo_type: str  # model | dataset
    repo: str
    requested: str | None  # a short hash, or None: the write-up names no revision

    @property
    def key(self) -> str:
        return f"{self.repo_type}:{self.repo}@{self.requested or '(none)'}"

    def describe(self) -> str:
        what = f"short hash {self.requested!r}" if self.requested else "no revision"
        return f"{self.repo_type} {self.repo} ({what})"


def request(repo_type: str, repo: str, revision: str | None) -> Request | None:
    """The lock request of a config's revision; None for a full commit, which needs none."""
    if revision is not None and FULL.match(revision):
        return None
    if revision is not None and not SHORT.match(revision):
        raise LockError(f"{repo_type} {repo}: revision {revision!r} is not pinned: give the full 40-hex commit, "
                        "a short hash of at least 7 hex digits to resolve with the lock step, or none")
    return Request(repo_type, repo, revision)


def read(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The lock file's entries by key (see Request.key); an absent file holds none."""
    path = path or LOCK_FILE
    if not path.exists():
        return {}
    entries = (yaml.safe_load(path.read_text()) or {}).get("revisions") or []
    return {Request(e["type"], e["repo"], e.get("requested")).key: e for e in entries}


def locked_commit(req: Request, entries: dict[str, dict[str, Any]]) -> str | None:
    """The locked commit of a request, None if the lock lacks it. A locked commit that is not a
    full hash, or does not begin with the short hash asked for, is an error in the lock file."""
    entry = entries.get(req.key)
    if entry is None:
        return None
    commit = str(entry.get("commit", ""))
    if not FULL.match(commit) or (req.requested and not commit.startswith(req.requested)):
        raise LockError(f"{shown(LOCK_FILE)}: the entry of {req.describe()} has commit {commit!r}, which is not a "
                        f"full commit{' beginning with ' + req.requested if req.requested else ''}; "
                        f"resolve it again: {command()}")
    return commit


def shown(path: Path) -> str:
    """A path as a message shows it: relative to the checkout where it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def command(paths: Iterable[str] = ()) -> str:
    return " ".join(["python -m quantstudy.lock", *(paths or ["<run or study config> ..."])])


def write(entries: dict[str, dict[str, Any]], path: Path | None = None) -> None:
    header = ("# Revisions the study configs give as short hashes or not at all, resolved to full commits by\n"
              "# `python -m quantstudy.lock` (huggingface_hub, on a machine that reaches the hub). Runs read\n"
              "# only this file for them; edit it only through that command.\n")
    body = yaml.safe_dump({"revisions": [entries[k] for k in sorted(entries)]}, sort_keys=False)
    atomic_write(path or LOCK_FILE, header + body)


def pinned(doc: dict[str, Any]):
    """(repo type, the entry that names a repo and revision) of each checkpoint and dataset."""
    for m in (doc.get("models") or {}).values():
        yield "model", m["checkpoint"]
    for d in (doc.get("datasets") or {}).values():
        yield "dataset", d


def requests(doc: dict[str, Any]) -> list[Request]:
    """The revisions of a study doc that are not full commits (short or none): the lock step's work."""
    return [r for kind, e in pinned(doc) if (r := request(kind, e["repo"], e.get("revision")))]
