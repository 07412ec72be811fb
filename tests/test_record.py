"""The measurements record's schema (no empty field), and sample lists as every job reads them."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from quantstudy import artifacts, steps
from quantstudy.artifacts import DamagedArtifact, read_json, write_json

from helpers import rewritten

SHA = "ab" * 32


def _record() -> dict:
    """A measurements record of an FP8 variant on an ONNX target, as the build job writes one."""
    qdq = lambda n, t: {"count": n, "output_types": {t: n}}
    return {
        "status": "ok", "target": "cpu-onnxruntime", "model": "fnet-base", "setting": "w512", "variant": "fp8",
        "backend": {"name": "onnxruntime", "version": "1.32.0", "pinned_version": "none", "device": "cpu"},
        "precision": "float16", "fp8_layers": {"count": 2, "names": ["a.dense", "b.dense"]},
        "fp8_path": "float8e4m3fn QuantizeLinear / DequantizeLinear run by ONNX Runtime's CPU kernels",
        "amax": {"path": "results/fnet/fnet-base/calib/w512/amax.json", "sha256": SHA},
        "onnx": {"main": {"path": "m.onnx", "sha256": SHA, "opset": 21, "QuantizeLinear": qdq(2, "float8_e4m3fn"),
                          "DequantizeLinear": qdq(4, "float16")}},
        "builder": {"graph_optimization_level": "ORT_ENABLE_ALL", "intra_op_num_threads": 1},
        "graphs": {"main": {"engine": "m.onnx", "engine_sha256": SHA, "layers": {
            "fp8_linear": {"layers": 2, "weight": ["float8_e4m3fn"], "activation": ["float8_e4m3fn"],
                           "dequantized_to": ["float16"]},
            "linear": {"layers": 1, "weight": ["float16"], "activation": ["float16"]},
            "other": {"weight": ["float16", "float32"]}}}},
        "provenance": artifacts.provenance("build"),
    }


def _validate(doc: dict) -> None:
    jsonschema.validate({"schema": "measurements", "schema_version": artifacts.SCHEMA_VERSION, **doc},
                        artifacts.load_schema("measurements"))


def test_a_complete_record_is_valid_and_not_applicable_is_said_explicitly(tmp_path):
    write_json(tmp_path / "measurements.json", "measurements", _record())
    torch_fp16 = _record() | {"fp8_layers": {"count": 0, "names": "none"}, "fp8_path": "none", "amax": "none",
                              "onnx": "not exported"}
    torch_fp16["graphs"]["main"]["layers"]["fp8_linear"] = "none"
    _validate(torch_fp16)


@pytest.mark.parametrize("where, empty", [
    (("backend", "version"), ""), (("fp8_layers", "names"), []), (("amax",), None), (("amax",), ""),
    (("onnx",), {}), (("onnx", "main", "QuantizeLinear", "output_types"), {}), (("builder",), {}),
    (("builder", "graph_optimization_level"), ""), (("builder", "intra_op_num_threads"), None),
    (("fp8_path",), ""), (("graphs", "main", "layers", "linear", "weight"), []),
    (("graphs", "main", "layers", "fp8_linear"), ""), (("precision",), None),
])
def test_an_empty_field_fails_the_schema(where, empty):
    doc = _record()
    owner = doc
    for key in where[:-1]:
        owner = owner[key]
    owner[where[-1]] = empty
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc)


@pytest.mark.parametrize("field", ["amax", "onnx", "builder", "fp8_layers", "backend", "graphs"])
def test_a_missing_field_fails_the_schema(field):
    doc = _record()
    del doc[field]
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc)


def test_a_failed_build_has_a_record_that_says_so(tmp_path):
    ident = {"target": "cpu-torch", "model": "m", "setting": "s", "variant": "v"}
    build = tmp_path / "build.json"
    build.write_text("{}")
    from quantstudy import record

    record.failed(ident, "RuntimeError: boom", str(build), str(tmp_path / "measurements.json"), artifacts.now())
    assert read_json(tmp_path / "measurements.json", "measurements")["error"] == "RuntimeError: boom"
    with pytest.raises(jsonschema.ValidationError):
        _validate({"status": "failed", **ident, "provenance": artifacts.provenance("build")})  # no error


def _rewritten(path, tmp_path, change) -> str:
    """The sample list with `change` applied to its samples, its digest made again: only the per-sample
    check can tell."""
    return str(rewritten(path, tmp_path / "calibration.json", lambda body: change(body["samples"])))


def test_every_reader_recomputes_each_samples_hash(tiny_inputs, tmp_path):
    path = tiny_inputs["calibration"]
    samples = steps.read_samples(path, "fnet")
    assert samples and all(len(s["sha256"]) == 64 for s in samples)

    def edit_text(samples):
        samples[1]["text"] += " edited"
    with pytest.raises(DamagedArtifact, match=rf"sample {samples[1]['id']!r} records sha256 .* its content hashes to"):
        steps.read_samples(_rewritten(path, tmp_path, edit_text), "fnet")

    def edit_hash(samples):
        samples[0]["sha256"] = "0" * 64
    with pytest.raises(DamagedArtifact, match="calibration.json: sample .* the list is not the one fetch_dataset drew"):
        steps.read_samples(_rewritten(path, tmp_path, edit_hash), "fnet")

    def duplicate(samples):
        samples.append(copy.deepcopy(samples[0]))
    with pytest.raises(DamagedArtifact, match=f"lists sample {samples[0]['id']!r} twice"):
        steps.read_samples(_rewritten(path, tmp_path, duplicate), "fnet")
