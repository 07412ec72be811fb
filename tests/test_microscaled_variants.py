"""NVFP4 and MXFP8 variants (`microscaling` transform) through the build, export and evaluate steps:
quality anywhere, no engine on Blackwell targets yet, a width the block does not divide a recorded failure."""

from __future__ import annotations

import json

import pytest

from quantstudy import config as qc, quantization, steps

from helpers import CPU_TORCH, FNET_SETTING, ident

NVFP4 = {"precision": "float16", "transforms": [{"microscaling": {"format": "nvfp4"}}]}
B200 = {"backend": "tensorrt", "device": "cuda", "gpu": "b200", "version": "11.4"}


@pytest.fixture(scope="module")
def calibrated(tiny_inputs, tmp_path_factory):
    """The tiny FNet's reference at 64 tokens and its amax file, made by the steps."""
    out, study = tmp_path_factory.mktemp("micro"), tiny_inputs["study"]
    checkpoint = str(tiny_inputs["checkpoint"])
    samples = {name: str(tiny_inputs["samples"][name]) for name in study.evaluation_samples}
    steps.reference("fnet", "fnet-base", FNET_SETTING, study.metrics, study.seeds, checkpoint, samples,
                    str(out / "reference.json"), str(out / "reference.safetensors"))
    steps.calibrate("fnet", "fnet-base", FNET_SETTING, study.models["fnet-base"].architecture, study.recipe.as_params(),
                    checkpoint, str(tiny_inputs["calibration"]), str(out / "amax.json"))
    return {"out": out, "study": study, "checkpoint": checkpoint, "samples": samples, "amax": str(out / "amax.json")}


def test_an_nvfp4_engine_opens_with_its_calibrated_scales_and_is_evaluated(calibrated):
    """Built by the build step on cpu-torch from the amax file, then opened by the evaluate step, which rebuilds
    its skeleton from the build's record: the NVFP4 layers' activation amax must be in it."""
    c, out = calibrated, calibrated["out"]
    recipe = c["study"].recipe.as_params()
    steps.build(ident("nvfp4"), "fnet", CPU_TORCH, FNET_SETTING, {}, NVFP4, recipe, c["checkpoint"], c["amax"],
                str(out / "nvfp4" / "build.json"))
    build = json.loads((out / "nvfp4" / "build.json").read_text())
    assert build["status"] == "ok", build.get("error")
    assert build["microscaled_layers"] and build["fp8_layers"] == []
    assert set(build["calibration"]["amax"]) == set(build["microscaled_layers"])
    steps.evaluate(ident("nvfp4"), "fnet", CPU_TORCH, FNET_SETTING, recipe, c["study"].metrics, c["study"].seeds,
                   c["checkpoint"], str(out / "nvfp4" / "build.json"), str(out / "reference.json"),
                   str(out / "reference.safetensors"), c["samples"], str(out / "nvfp4" / "quality.json"))
    quality = json.loads((out / "nvfp4" / "quality.json").read_text())
    assert quality["status"] == "ok", quality.get("error")
    # NVFP4 moves the features off the fp32 reference, by much more than nothing and less than everything
    assert 1e-4 < quality["blocks"]["cls"]["relative_error"] < 1


def test_a_microscaled_variants_export_is_a_recorded_failure_with_the_reason(calibrated):
    """The ONNX a TensorRT or ONNX Runtime target builds from has no block-scaled form here: the export step
    records why, rather than write a graph whose fake-quant ops an engine would time as NVFP4."""
    c, out = calibrated, calibrated["out"] / "onnx-nvfp4" / "export.json"
    steps.export({k: v for k, v in ident("nvfp4").items() if k != "target"}, "fnet", FNET_SETTING, {}, NVFP4,
                 c["study"].recipe.as_params(), c["checkpoint"], c["amax"], str(out))
    doc = json.loads(out.read_text())
    assert doc["status"] == "failed" and "NVFP4 layers have no ONNX form here" in doc["error"]


def test_a_width_the_block_does_not_divide_is_the_variants_recorded_failure(tiny_inputs, tmp_path):
    """A tiny FNet 40 wide: its intermediate.dense layers take 40 inputs, no multiple of NVFP4's block of 16
    (output.dense takes 80, which is). The build step writes a failed build.json naming those layers."""
    arch = {**qc.load_architecture("tiny-fnet-base"), "hidden_size": 40, "intermediate_size": 80}
    repo, revision, cache = "quantstudy-tiny/fnet-40", "4" * 40, str(tmp_path / "hf-cache")
    steps.local_hub("fnet", [{"repo": repo, "revision": revision, "architecture": arch, "tiny": {"seed": 0}}], [],
                    cache, str(tmp_path / "local_hub.json"))
    checkpoint = str(tmp_path / "checkpoint.json")
    steps.fetch_checkpoint(repo, revision, cache, True, "tiny-random-init", checkpoint)
    recipe = tiny_inputs["study"].recipe.as_params()
    steps.calibrate("fnet", "fnet-40", FNET_SETTING, arch, recipe, checkpoint, str(tiny_inputs["calibration"]),
                    str(tmp_path / "amax.json"))
    out = tmp_path / "nvfp4" / "build.json"
    steps.build(ident("nvfp4", "fnet-40"), "fnet", CPU_TORCH, FNET_SETTING, arch, NVFP4, recipe, checkpoint,
                str(tmp_path / "amax.json"), str(out))
    doc = json.loads(out.read_text())
    assert doc["status"] == "failed"
    assert "nvfp4 scales blocks of 16" in doc["error"] and "fnet.encoder.layer.0.intermediate.dense (40)" in doc["error"]
    assert "output.dense" not in doc["error"].splitlines()[-1]
    record = json.loads((tmp_path / "nvfp4" / "measurements.json").read_text())
    assert record["status"] == "failed"


def test_a_blackwell_target_records_that_no_backend_builds_a_block_scaled_engine():
    b200 = qc.Target("b200-trt11.4", **B200)
    with pytest.raises(NotImplementedError, match="no backend implements an NVFP4 engine yet: target b200-trt11.4"):
        quantization.refuse_block_scaled_engine(NVFP4, b200)
    quantization.refuse_block_scaled_engine(NVFP4, qc.Target.from_params(CPU_TORCH))  # quality, by fake-quant
    quantization.refuse_block_scaled_engine({"precision": "float16", "transforms": [{"fp8": {}}]}, b200)
