"""Committed evidence runs: their rendered README is what the templates make of their tables.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantstudy import artifacts, render

from conftest import ROOT

# Each tables.json inside an evidence folder results/<machine-backend>/ has its rendered README.md
# beside it (the workflow's own results/<study>/tables.json is one level up, and not evidence).
EVIDENCE = sorted(ROOT.glob("results/*/*/**/tables.json"))


@pytest.mark.parametrize("tables", EVIDENCE, ids=[str(p.relative_to(ROOT)) for p in EVIDENCE])
def test_evidence_readme_renders_from_its_tables(tables: Path):
    version = json.loads(tables.read_text())["schema_version"]
    if version != artifacts.SCHEMA_VERSION:  # its README was rendered by the code of its own schema
        pytest.skip(f"{tables.relative_to(ROOT)} is schema version {version}, the templates render "
                    f"version {artifacts.SCHEMA_VERSION}: rerun that evidence to re-render it")
    rendered = render.render_section(artifacts.read_json(tables, "tables"))
    assert rendered == (tables.parent / "README.md").read_text(), (
        f"re-render it: python -m quantstudy.render {tables.relative_to(ROOT)}")


def test_there_is_evidence():
    assert EVIDENCE, "no committed evidence run under results/"
