"""The lock step: short or missing revisions resolve to full commits once, and runs read only the lock.

The hub cannot be reached here, so the resolution runs against `Hub`, a repository history held in
memory behind the three HfApi calls the lock step makes (repo_info, list_repo_refs,
list_repo_commits), answering with huggingface_hub's own types.
"""

from __future__ import annotations

import pytest
import yaml
from huggingface_hub.hf_api import GitCommitInfo, GitRefInfo, GitRefs

from quantstudy import config as qc
from quantstudy import lock, lockfile

from helpers import ROOT, dry_run_with_studies, study_doc

HEAD = "6f5cf0a2" + "1" * 32
OLD = "6f5cf0b7" + "2" * 32
BRANCH = "b3546ea6" + "3" * 32


class Hub:
    """One model repository: `main` (HEAD, OLD) and a branch `v2` (BRANCH); records what it was asked."""

    def __init__(self):
        self.asked: list[tuple[str, str | None]] = []
        self.history = {"refs/heads/main": [HEAD, OLD], "refs/heads/v2": [BRANCH, OLD]}

    def repo_info(self, repo_id, repo_type=None, revision=None):
        self.asked.append(("repo_info", revision))
        return type("Info", (), {"sha": HEAD})()

    def list_repo_refs(self, repo_id, repo_type=None):
        self.asked.append(("list_repo_refs", None))
        return GitRefs(branches=[GitRefInfo(name=ref.rsplit("/", 1)[-1], ref=ref, target_commit=commits[0])
                                 for ref, commits in self.history.items()], converts=[], tags=[])

    def list_repo_commits(self, repo_id, repo_type=None, revision=None):
        self.asked.append(("list_repo_commits", revision))
        return [GitCommitInfo(commit_id=c, authors=[], created_at="2026-01-01T00:00:00Z", title="", message="",
                              formatted_title=None, formatted_message=None) for c in self.history[revision]]


@pytest.fixture
def lock_file(tmp_path, monkeypatch):
    path = tmp_path / "revisions.lock.yaml"
    monkeypatch.setattr(lockfile, "LOCK_FILE", path)
    return path


def study_with(tmp_path, revision) -> str:
    """The embedded-default FNet study with fnet-base's checkpoint at `revision` (None: no revision)."""
    doc = study_doc()
    checkpoint = doc["models"]["fnet-base"]["checkpoint"]
    del doc["models"]["fnet-base"]["tiny"]  # a hub checkpoint, not a generated one
    checkpoint["repo"] = "org/model"
    checkpoint.pop("revision")
    if revision is not None:
        checkpoint["revision"] = revision
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_unique_prefix_resolves_and_none_or_several_are_errors():
    commits = [HEAD, OLD, BRANCH]
    assert lock.match_prefix("6f5cf0a2", commits, "m") == HEAD
    with pytest.raises(lockfile.LockError, match="no commit of its branches begins with 'abcdef0'"):
        lock.match_prefix("abcdef0", commits, "m")
    with pytest.raises(lockfile.LockError, match="2 commits begin with '6f5cf0'"):
        lock.match_prefix("6f5cf0", commits, "m")


@pytest.mark.parametrize("revision", ["main", "v1.0", "6f5cf0", "6F5CF0A2"])
def test_a_branch_tag_or_too_short_hash_is_never_a_lock_request(revision):
    with pytest.raises(lockfile.LockError, match=f"revision '{revision}' is not pinned"):
        lockfile.request("model", "org/model", revision)


def test_a_full_commit_needs_no_lock():
    assert lockfile.request("model", "org/model", HEAD) is None


def test_an_unresolved_revision_stops_the_config_with_the_command(tmp_path, lock_file):
    spec = study_with(tmp_path, "6f5cf0a2")
    with pytest.raises(qc.ConfigError) as e:
        qc.load_study(spec, against_code=False)
    message = str(e.value)
    assert "model org/model (short hash '6f5cf0a2')" in message
    assert f"run `python -m quantstudy.lock {spec}`" in message
    assert "a short hash is never used as a revision" in message


def test_snakemake_stops_on_an_unresolved_revision_before_any_job(tmp_path, lock_file):
    # The run reads the checkout's lock file, which has no entry for org/model.
    proc = dry_run_with_studies(tmp_path, {"fnet": {"spec": study_with(tmp_path, None)}})
    assert proc.returncode != 0
    assert "unresolved revisions" in proc.stdout + proc.stderr
    assert "model org/model (no revision)" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("revision, expected", [("6f5cf0a2", HEAD), ("b3546ea6", BRANCH), (None, HEAD)])
def test_the_lock_step_writes_full_commits_that_runs_then_read(tmp_path, lock_file, revision, expected):
    spec = study_with(tmp_path, revision)
    hub = Hub()
    assert lock.main([spec], api=hub) == 0
    entries = yaml.safe_load(lock_file.read_text())["revisions"]
    assert [(e["repo"], e["requested"], e["commit"]) for e in entries] == [("org/model", revision, expected)]
    # Only branch refs (or nothing: the default branch) are passed to the hub as revisions, never the short hash.
    assert {r for _, r in hub.asked} <= {None, "refs/heads/main", "refs/heads/v2"}
    study = qc.load_study(spec, against_code=False)
    assert study.models["fnet-base"].revision == expected
    assert study.document["models"]["fnet-base"]["checkpoint"]["revision"] == expected  # what tables.json records
    # Resolved once: a second call asks the hub nothing.
    hub.asked.clear()
    assert lock.main([spec], api=hub) == 0 and hub.asked == []


def test_a_short_hash_the_hub_does_not_have_is_reported_and_not_locked(tmp_path, lock_file, capsys):
    spec = study_with(tmp_path, "abcdef01")
    assert lock.main([spec], api=Hub()) == 1
    assert "not resolved: model org/model (short hash 'abcdef01'): " in capsys.readouterr().err
    assert yaml.safe_load(lock_file.read_text())["revisions"] == []


def test_a_lock_entry_that_does_not_match_its_short_hash_is_refused(tmp_path, lock_file):
    spec = study_with(tmp_path, "6f5cf0a2")
    lockfile.write({lockfile.Request("model", "org/model", "6f5cf0a2").key:
                {"type": "model", "repo": "org/model", "requested": "6f5cf0a2", "commit": BRANCH}})
    with pytest.raises(qc.ConfigError, match=f"has commit '{BRANCH}', which is not a full commit beginning with 6f5cf0a2"):
        qc.load_study(spec, against_code=False)


def test_the_checkouts_lock_file_is_well_formed():
    """Every committed entry is a full commit that begins with what was asked for."""
    for key, entry in lockfile.read(ROOT / "config" / "revisions.lock.yaml").items():
        req = lockfile.Request(entry["type"], entry["repo"], entry.get("requested"))
        assert req.key == key and lockfile.FULL.match(entry["commit"])
        assert not req.requested or entry["commit"].startswith(req.requested)
