"""Quality against another variant's engine (`quality_against`), through the real evaluate step.

An engine measured against itself agrees exactly; against another engine it does not; a
comparison engine that failed to build fails the evaluation with the reason. (The rule wiring
runs in the workflow test's config, which measures every variant against fp16-hs.)"""
from __future__ import annotations

import json

import pytest

from quantstudy import steps_engines, steps_measure, steps_reference

from helpers import CPU_TORCH, FNET_SETTING, ident

SPECS = {"fp16": {"precision": "float16", "transforms": []},
         "fp32": {"precision": "float32", "transforms": []},
         "fp8-broken": {"precision": "float16", "transforms": [{"fp8": {"exclude": ["*"]}}]}}


@pytest.fixture(scope="module")
def measured(tiny_inputs, tmp_path_factory):
    """fp16, fp32 and a failed build of the tiny FNet, and the reference at 64 tokens. The failed build
    has a calibrated amax file: it fails for its `exclude: ["*"]`, nothing else."""
    out, study = tmp_path_factory.mktemp("against"), tiny_inputs["study"]
    checkpoint = str(tiny_inputs["checkpoint"])
    samples = {name: str(tiny_inputs["samples"][name]) for name in study.evaluation_samples}
    steps_reference.reference("fnet", "fnet-base", FNET_SETTING, study.metrics, study.seeds, checkpoint, samples,
                              str(out / "reference.json"), str(out / "reference.safetensors"))
    steps_reference.calibrate("fnet", "fnet-base", FNET_SETTING, study.models["fnet-base"].architecture, study.recipe.as_params(),
                              checkpoint, str(tiny_inputs["calibration"]), str(out / "amax.json"))
    builds = {}
    for variant, spec in SPECS.items():
        builds[variant] = str(out / variant / "build.json")
        steps_engines.build(ident(variant), "fnet", CPU_TORCH, FNET_SETTING, {}, spec, study.recipe.as_params(), checkpoint,
                            str(out / "amax.json") if "fp8" in variant else None, builds[variant])
    return {"out": out, "study": study, "checkpoint": checkpoint, "samples": samples, "builds": builds}


def evaluate(m, variant: str, against: dict[str, str], out) -> dict:
    study = m["study"]
    steps_measure.evaluate(ident(variant), "fnet", CPU_TORCH, FNET_SETTING, study.recipe.as_params(), study.metrics, study.seeds,
                           m["checkpoint"], m["builds"][variant], str(m["out"] / "reference.json"),
                           str(m["out"] / "reference.safetensors"), m["samples"], str(out), against_builds=against)
    return json.loads(out.read_text())


def test_an_engine_against_itself_agrees_exactly(measured, tmp_path):
    doc = evaluate(measured, "fp16", {"fp16": measured["builds"]["fp16"]}, tmp_path / "quality.json")
    assert doc["status"] == "ok", doc.get("error")
    vs = doc["blocks"]["cls_vs_fp16"]
    assert vs["relative_error"] == 0 and vs["cosine_min"] == pytest.approx(1, abs=1e-12) and vs["rows"] > 0
    assert doc["provenance"]["inputs"]["against_fp16"]["path"] == measured["builds"]["fp16"]


def test_an_engine_against_another_differs_by_its_rounding(measured, tmp_path):
    doc = evaluate(measured, "fp16", {"fp32": measured["builds"]["fp32"]}, tmp_path / "quality.json")
    vs = doc["blocks"]["cls_vs_fp32"]
    # fp16 against fp32 features: an fp16 rounding away, not equal and not unrelated
    assert 0 < vs["relative_error"] < 0.05 and vs["cosine_min"] > 0.99
    # against the fp32 engine, as against the fp32 reference (the same model in fp32)
    assert vs["relative_error"] == pytest.approx(doc["blocks"]["cls"]["relative_error"], rel=0.05)


def test_a_failed_comparison_engine_fails_the_evaluation(measured, tmp_path):
    broken = json.loads(open(measured["builds"]["fp8-broken"]).read())
    assert broken["status"] == "failed" and "the fp8 transform selects no layer" in broken["error"], broken.get("error")
    doc = evaluate(measured, "fp16", {"fp8-broken": measured["builds"]["fp8-broken"]}, tmp_path / "quality.json")
    assert doc["status"] == "failed" and "the build of fp8-broken failed" in doc["error"]


def test_the_reference_records_the_dtype_it_ran_in(measured):
    doc = json.loads((measured["out"] / "reference.json").read_text())
    assert doc["dtype"] == "float32" and doc["provenance"]["params"]["dtype"] == "float32"
