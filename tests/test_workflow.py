"""The workflow itself, through real Snakemake, on the tiny test config (.test/).

One run of the whole DAG, then: a failing variant is rendered as failed while the others
complete; a no-op rerun does nothing; changing one variant's params reruns only its chain.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from quantstudy.devtools import copy_checkout, planned_jobs, snakemake

pytestmark = pytest.mark.workflow


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    """A copy of the repository (tracked and new files) with the test config run once."""
    dest = copy_checkout(ROOT, tmp_path_factory.mktemp("wf") / "repo")
    proc = snakemake(dest, "--configfile", ".test/config.yaml")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dest


def test_failing_variant_is_rendered_and_the_others_complete(workflow_copy):
    variant_dir = workflow_copy / "results/fnet/cpu-torch/fnet-base/w512"
    broken = json.loads((variant_dir / "fp8-broken/build.json").read_text())
    assert broken["status"] == "failed" and "the fp8 transform selects no layer" in broken["error"]
    for name in ("timing", "quality", "kernels"):
        assert json.loads((variant_dir / f"fp8-broken/{name}.json").read_text())["status"] == "failed"
    for variant in ("fp16", "fp16-hs", "fp8", "fp8-no-output-dense"):
        assert json.loads((variant_dir / variant / "quality.json").read_text())["status"] == "ok"
    readme = (workflow_copy / "results/fnet/README.md").read_text()
    assert re.search(r"\| build\.json \| cpu-torch \| fnet-base, w512 \| fp8-broken \| .*selects no layer", readme)
    fp8_row = next(line for line in readme.splitlines() if line.startswith("| fnet-base, 512 | cpu-torch | fp8 |"))
    assert "failed" not in fp8_row and "%" in fp8_row


def test_fp16_overflow_at_512_is_measured(workflow_copy):
    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    issue = tables["known_issue"][0]
    assert issue["window"] == 512 and issue["peak"] > issue["fp16_max"]
    quality = {r["variant"]: r for r in tables["quality"]}
    assert quality["fp16"]["nonfinite_heldout"] == quality["fp16"]["heldout"] > 0
    assert quality["fp16-hs"]["nonfinite"] == 0


def test_noop_rerun_does_nothing(workflow_copy):
    proc = snakemake(workflow_copy, "-n", "--configfile", ".test/config.yaml")
    assert proc.returncode == 0
    assert planned_jobs(proc.stdout + proc.stderr) == []


def test_changing_one_variant_reruns_only_its_chain(workflow_copy):
    config = yaml.safe_load((workflow_copy / ".test/config.yaml").read_text())
    (workflow_copy / ".test/change.yaml").write_text(yaml.safe_dump(
        {"variants": {"fp8-no-output-dense": {"transforms": [{"fp8": {"exclude": ["*.output.dense", "*.0.intermediate.dense"]}}]}}}))
    config["studies"]["fnet"]["overrides"].append(".test/change.yaml")
    (workflow_copy / ".test/changed.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(workflow_copy, "-n", "--configfile", ".test/changed.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout + proc.stderr)
    per_variant = [(rule, w["variant"]) for rule, w in jobs if "variant" in w]
    assert sorted(per_variant) == sorted((r, "fp8-no-output-dense") for r in ("build", "time", "profile", "evaluate"))
    # `all` is the target rule: it runs no code.
    assert sorted(rule for rule, w in jobs if "variant" not in w) == ["aggregate", "all", "audit", "render"]


def test_audit_traces_the_readme_to_pinned_inputs(workflow_copy, monkeypatch):
    report = json.loads((workflow_copy / "results/fnet/audit.json").read_text())
    assert report["ok"] and report["readme_matches_tables"] and report["files_checked"] > 20

    from quantstudy.audit import check_chain

    monkeypatch.chdir(workflow_copy)
    amax = workflow_copy / "results/fnet/fnet-base/calib/w512/amax.json"
    original = amax.read_text()
    try:
        amax.write_text(original.replace('"input_amax": ', '"input_amax": 1', 1))
        problems = check_chain("results/fnet/tables.json")["problems"]
        assert any("amax.json) changed since it was read" in p for p in problems)
    finally:
        amax.write_text(original)
