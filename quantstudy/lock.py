"""The lock step: the revisions a write-up does not pin, resolved once to 40-hex commits.

A study config names each checkpoint and dataset revision as the write-up gives it: a full
commit (pinned), a short hash (`6f5cf0a2`), or nothing (the write-up names no revision). Runs
read only full commits: a short or missing one is looked up in the committed lock file
(config/revisions.lock.yaml, quantstudy.lockfile), and one that is not there stops the run before
any job, with the command that resolves it. That command runs on a machine that reaches the hub:

    python -m quantstudy.lock config/config.yaml config/b200.yaml ...   # run configs, or study specs

It asks the hub (huggingface_hub) for each unresolved revision's commit: a short hash is the one
commit of the repository's branches that begins with it (none or several is an error, never a
guess); a missing revision is the head of the default branch at that moment, recorded with the
time. A partial hash is never passed to the hub as a revision.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from typing import Any, Iterable

import yaml

from quantstudy import config
from quantstudy.lockfile import FULL, LockError, Request, read, requests, write


def match_prefix(prefix: str, commits: Iterable[str], where: str) -> str:
    """The one commit that begins with `prefix`; none or several is an error, never a guess."""
    found = sorted({c for c in commits if c.startswith(prefix)})
    if len(found) == 1:
        return found[0]
    if not found:
        raise LockError(f"{where}: no commit of its branches begins with {prefix!r}")
    raise LockError(f"{where}: {len(found)} commits begin with {prefix!r} ({', '.join(found)}); "
                    "give more digits of the one the write-up means")


def resolve(req: Request, api: Any) -> dict[str, Any]:
    """A lock entry for the request, asking the hub through `api` (a huggingface_hub.HfApi)."""
    import huggingface_hub

    where = req.describe()
    if req.requested is None:
        commit, how = api.repo_info(req.repo, repo_type=req.repo_type).sha, "head of the default branch"
    else:
        refs = api.list_repo_refs(req.repo, repo_type=req.repo_type)
        commits = {c.commit_id for branch in refs.branches
                   for c in api.list_repo_commits(req.repo, repo_type=req.repo_type, revision=branch.ref)}
        commit, how = match_prefix(req.requested, commits, where), "the one commit of its branches with this prefix"
    if not FULL.match(commit or ""):
        raise LockError(f"{where}: the hub answered {commit!r}, not a 40-hex commit")
    return {"type": req.repo_type, "repo": req.repo, "requested": req.requested, "commit": commit, "how": how,
            "resolved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "huggingface_hub": huggingface_hub.__version__}


def requests_of(paths: list[str]) -> list[Request]:
    """Every unresolved revision that these run configs (their studies, overrides merged) or study
    specs name."""
    found: dict[str, Request] = {}
    for p in paths:
        doc = yaml.safe_load(config.workflow_path(p).read_text())
        specs = ([(e["spec"], e.get("overrides")) for e in doc["studies"].values()] if "studies" in doc
                 else [(p, None)])
        for spec, overrides in specs:
            for req in requests(config.merged_study_doc(spec, overrides)):
                found.setdefault(req.key, req)
    return list(found.values())


def main(argv: list[str] | None = None, api: Any = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantstudy.lock", description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", help="run configs (config/*.yaml) or study specs")
    parser.add_argument("--again", action="store_true", help="resolve entries already in the lock once more")
    args = parser.parse_args(argv)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    entries, failed = read(), []
    for req in requests_of(args.configs):
        if req.key in entries and not args.again:
            continue
        try:
            entries[req.key] = resolve(req, api)
            print(f"{req.describe()} -> {entries[req.key]['commit']}")
        except Exception as e:  # a hub error or a LockError: reported per revision, the others go on
            failed.append(f"{req.describe()}: {e}")
    write(entries)
    for f in failed:
        print(f"not resolved: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
