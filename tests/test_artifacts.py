"""A damaged artifact is named where it is read: its path, what is wrong, and how to remake it."""
from __future__ import annotations

import json

import pytest

from quantstudy.artifacts import SCHEMA_VERSION, DamagedArtifact, read_json

REMAKE = "rerun the job that writes it: snakemake --force {}"


@pytest.mark.parametrize("content, problem", [
    ('{"schema": "amax", "schema_v', "not valid JSON (Unterminated string"),
    (json.dumps({"schema": "timing", "schema_version": SCHEMA_VERSION}), "holds a 'timing' artifact, expected 'amax'"),
    (json.dumps({"schema": "amax", "schema_version": 1}), "is a amax artifact of schema version 1, this code reads version 2"),
    (json.dumps({"schema": "amax", "schema_version": SCHEMA_VERSION}), "fails the amax schema at the top level: "),
    ("[1, 2]", "holds a 'list' artifact, expected 'amax'"),
])
def test_a_damaged_artifact_is_named_with_how_to_remake_it(content, problem, tmp_path):
    path = tmp_path / "amax.json"
    path.write_text(content)
    with pytest.raises(DamagedArtifact) as e:
        read_json(path, "amax")
    assert str(e.value).startswith(f"{path}: {problem}") and str(e.value).endswith(REMAKE.format(path))
