"""The `.test/` scenarios (the snakemake-workflows habit): several small run configs, each dry-run, so
that every family's rules resolve in CI, not only the FNet study the workflow tests run; and the second run
config, config/questions.yaml over the embedded default."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT

# Every run config under .test/ (a file with `studies:`); the others there are study overrides.
SCENARIOS = sorted(p for p in (ROOT / ".test").glob("*.yaml") if "studies" in (yaml.safe_load(p.read_text()) or {}))


def test_the_scenarios_cover_every_registered_family():
    from quantstudy import config as qc, families

    covered = {s.family for p in SCENARIOS for s in qc.load_run(yaml.safe_load(p.read_text()), against_code=False).studies.values()}
    assert covered == set(families.names())


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.stem)
def test_a_scenario_dry_runs(scenario):
    """`snakemake -n --configfile .test/<scenario>.yaml` resolves, planning each of its studies' README
    and audit on its targets and on no other. In the checkout, whose config/ the rules name as inputs
    (config/published/...); a dry run writes no result, and --forceall plans every job whatever results
    the checkout already holds (after the main job, the embedded default's)."""
    run = yaml.safe_load(scenario.read_text())
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--forceall", "--cores", "1",
                           "--configfile", str(scenario)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for study in run["studies"]:
        assert f"results/{study}/README.md" in proc.stdout and f"results/{study}/audit.json" in proc.stdout
    planned = {line.split("/")[2] for line in proc.stdout.splitlines() if line.strip().startswith("output: results/")
               and line.count("/") > 4 and "/timing" in line}
    assert planned and planned <= set(run["targets"])


def test_the_questions_config_dry_runs_its_microscaled_variants_as_quality_only_with_their_amax():
    """`snakemake -n --configfile config/config.yaml config/questions.yaml` (the second run config): each
    study's nvfp4 and mxfp8 builds read their amax file and are evaluated; on these CPU targets nothing times
    or profiles them, and none is exported for the ONNX target."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--forceall", "--cores", "1", "--configfile",
                           "config/config.yaml", "config/questions.yaml"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [dict(line.strip().split(": ", 1) for line in block.splitlines()[1:] if ": " in line)
            | {"rule": block.split(":", 1)[0]} for block in proc.stdout.split("\nrule ")[1:]]
    micro = lambda job: re.search(r"/(nvfp4|mxfp8)/", job.get("output", ""))  # noqa: E731
    studies = yaml.safe_load((ROOT / "config/questions.yaml").read_text())["studies"]
    for study in studies:
        builds = [j for j in jobs if j["rule"] == "build" and micro(j) and f"results/{study}/" in j["output"]]
        assert {micro(j).group(1) for j in builds} == {"nvfp4", "mxfp8"}, study
        assert all("/calib/" in j["input"] and "amax.json" in j["input"] for j in builds), builds
        assert any(j["rule"] == "evaluate" and micro(j) and f"results/{study}/" in j["output"] for j in jobs), study
    assert not [j["output"] for j in jobs if j["rule"] in ("time", "profile", "export") and micro(j)]
