"""Checkpoints and datasets at pinned revisions, through the Hugging Face cache.

On a cluster `snapshot_download` fills the cache from the hub; offline (the embedded
default, tests, GPU nodes without network) the same call finds the revision already in the
cache, placed there by `place_in_cache`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "pytorch_model.bin"]


def cache_folder(cache_dir: str | Path, repo_id: str, repo_type: str) -> Path:
    kind = {"model": "models", "dataset": "datasets"}[repo_type]
    return Path(cache_dir) / f"{kind}--{repo_id.replace('/', '--')}"


def place_in_cache(cache_dir: str | Path, repo_id: str, repo_type: str, revision: str,
                   files: dict[str, bytes]) -> Path:
    """Write files as the snapshot of `repo_id` at `revision`, in the Hugging Face cache layout."""
    from quantstudy.artifacts import atomic_write

    folder = cache_folder(cache_dir, repo_id, repo_type)
    snapshot = folder / "snapshots" / revision
    for rel, data in files.items():
        atomic_write(snapshot / rel, data)
    return snapshot


def snapshot(repo_id: str, revision: str, cache_dir: str | Path, repo_type: str = "model",
             patterns: Iterable[str] | None = None, offline: bool = False) -> Path:
    """The local folder of `repo_id` at the pinned `revision`, downloaded unless already cached."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id=repo_id, revision=revision, repo_type=repo_type,
                                 cache_dir=str(cache_dir), allow_patterns=list(patterns) if patterns else None,
                                 local_files_only=offline)
    except Exception as e:  # the hub client raises many kinds; all mean the same thing here
        where = "the local cache (offline)" if offline else "the hub or the local cache"
        raise RuntimeError(f"{repo_type} {repo_id} at {revision} is not in {where} ({cache_dir}): {e}") from e
    return Path(path)
