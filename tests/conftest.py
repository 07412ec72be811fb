"""Shared fixtures: the tiny study's pinned inputs, made by the package's own steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quantstudy import config as qc, steps

ROOT = Path(__file__).resolve().parent.parent
TEST_CONFIG = ROOT / ".test" / "config.yaml"


@pytest.fixture(scope="session")
def test_run() -> qc.Run:
    return qc.load_run(yaml.safe_load(TEST_CONFIG.read_text()))


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory, test_run):
    """Tiny checkpoint and calibration samples in a fresh local HF cache (local_hub, fetch_*)."""
    out = tmp_path_factory.mktemp("tiny")
    study = test_run.studies["fnet"]
    cache = str(out / "hf-cache")
    steps.local_hub(study.family, cache_dir=cache, out=str(out / "local_hub.json"), **study.local_hub_specs())
    model = study.models["fnet-base"]
    steps.fetch_checkpoint(model.repo, model.revision, cache, True, test_run.weights, str(out / "checkpoint.json"))
    spec = study.raw["samples"]["calibration"]
    steps.fetch_dataset("calibration", spec, study.raw["datasets"][spec["dataset"]], study.family, cache, True,
                        str(out / "checkpoint.json"), str(out / "calibration.json"))
    return {"dir": out, "study": study, "checkpoint": out / "checkpoint.json",
            "calibration": out / "calibration.json"}
