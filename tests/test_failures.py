"""A failure is a result: each measuring step that raises writes its JSON as failed, with the error.

Each case makes one step raise on its own (its own inputs are bad, the engine it reads is fine)."""

from __future__ import annotations

import json

import pytest

from quantstudy import steps, steps_engines, steps_measure

from helpers import CPU_TORCH, FNET_SETTING, ident

FP16 = {"precision": "float16", "transforms": []}
ARCHITECTURE = {}  # FNet's graphs do not depend on it


@pytest.fixture(scope="module")
def built(tiny_inputs, tmp_path_factory):
    """An fp16 engine of the tiny model, built by the build step."""
    out = tmp_path_factory.mktemp("engine") / "fp16" / "build.json"
    steps_engines.build(ident("fp16"), "fnet", CPU_TORCH, FNET_SETTING, ARCHITECTURE, FP16, tiny_inputs["study"].recipe.as_params(),
                        str(tiny_inputs["checkpoint"]), None, str(out))
    assert json.loads(out.read_text())["status"] == "ok"
    return out


def _failed(path, kind: str, words: str) -> None:
    doc = json.loads(path.read_text())
    assert doc["schema"] == kind and doc["status"] == "failed", doc.get("error")
    assert words in doc["error"] and doc["provenance"]["rule"]


def test_export_failure_is_recorded(tiny_inputs, tmp_path):
    out = tmp_path / "export.json"
    fp8 = {"precision": "float16", "transforms": [{"fp8": {}}]}
    steps_engines.export({k: v for k, v in ident("fp8").items() if k != "target"}, "fnet", FNET_SETTING, ARCHITECTURE, fp8,
                         tiny_inputs["study"].recipe.as_params(), str(tiny_inputs["checkpoint"]), None, str(out))
    _failed(out, "export", "the fp8 transform needs an amax file")


def test_time_failure_is_recorded(tiny_inputs, built, tmp_path):
    out = tmp_path / "timing.json"
    steps_measure.time(ident("fp16"), "fnet", CPU_TORCH, FNET_SETTING, tiny_inputs["study"].recipe.as_params(),
                       {"warmup": 0, "rounds": 0, "calls_per_round": 1}, str(tiny_inputs["checkpoint"]), str(built),
                       str(built), str(out))
    _failed(out, "timing", "timing needs at least one round")


def test_profile_failure_is_recorded(tiny_inputs, built, tmp_path):
    out = tmp_path / "kernels.json"
    steps_measure.profile(ident("fp16"), "fnet", CPU_TORCH, FNET_SETTING, tiny_inputs["study"].recipe.as_params(), 0,
                          str(tiny_inputs["checkpoint"]), str(built), str(out))
    _failed(out, "kernels", "a kernel profile needs at least one call")


def test_evaluate_failure_is_recorded(tiny_inputs, built, tmp_path):
    out = tmp_path / "quality.json"
    missing = tmp_path / "reference.safetensors"  # the reference tensors were never written
    steps_measure.evaluate(ident("fp16"), "fnet", CPU_TORCH, FNET_SETTING, tiny_inputs["study"].recipe.as_params(),
                           tiny_inputs["study"].metrics, {"masking": 0, "stress": 0}, str(tiny_inputs["checkpoint"]),
                           str(built), str(built), str(missing), {}, str(out))
    doc = json.loads(out.read_text())
    assert doc["status"] == "failed" and "reference.safetensors" in doc["error"]


@pytest.mark.parametrize("step", ["build", "time"])
def test_a_job_on_a_host_without_its_targets_card_stops_before_it_measures_and_writes_nothing(
        step, tiny_inputs, built, tmp_path):
    """Not a result: the README would call its numbers the declared card's. `z999` is no card a host has."""
    target = {"target": "z999-torch", "backend": "torch", "device": "cuda", "gpu": "z999"}
    out = tmp_path / f"{step}.json"
    with pytest.raises(steps.WrongCard, match="target z999-torch declares gpu z999, but this job runs on "):
        if step == "build":
            steps_engines.build(ident("fp16"), "fnet", target, FNET_SETTING, ARCHITECTURE, FP16, tiny_inputs["study"].recipe.as_params(),
                                str(tiny_inputs["checkpoint"]), None, str(out))
        else:
            steps_measure.time(ident("fp16"), "fnet", target, FNET_SETTING, tiny_inputs["study"].recipe.as_params(),
                               {"warmup": 0, "rounds": 1, "calls_per_round": 1}, str(tiny_inputs["checkpoint"]), str(built),
                               str(built), str(out))
    assert list(tmp_path.iterdir()) == []


def test_a_failed_row_carries_the_whole_error_text_not_only_the_tracebacks_last_line(tmp_path):
    """A build that fails with a builder's multi-line error (as TensorRT 11.4's on FP8 out_proj): the
    record keeps the traceback; the table row (what a README renders) has every line of the exception,
    none of the frames."""
    from quantstudy import aggregate_rows

    def build_the_plan():
        raise RuntimeError("TensorRT could not build the engine:\n"
                           "[network] Input 0's element type (fp8_e4m3) differs from input 1's element type (half)\n"
                           "builder returned no plan")

    out = tmp_path / "cpu-torch/gpt-neo-125m/p256-c256/fp8-out_proj/build.json"
    out.parent.mkdir(parents=True)
    ident = {"target": "cpu-torch", "model": "gpt-neo-125m", "setting": "p256-c256", "variant": "fp8-out_proj"}
    steps.record_result("build", "build", str(out), ident, {}, {}, build_the_plan, {"spec": {"precision": "float16"}})
    _failed(out, "build", "builder returned no plan")
    row = aggregate_rows.rows_of([str(out)], "build", aggregate_rows.build_rows, []).iloc[0]
    assert row["status"] == "failed"
    assert row["error"] == ("RuntimeError: TensorRT could not build the engine: [network] Input 0's element type "
                            "(fp8_e4m3) differs from input 1's element type (half) builder returned no plan")
