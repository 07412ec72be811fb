"""The Amdahl bound beside x (quantstudy/bound.py): the formula, f from a kernel profile, g from
GEMM timings, and the bound in tables.json and the rendered README, on small cases by hand."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from quantstudy import aggregate_bound, bound

from helpers import skip_without_gpu


def test_bound_formula_on_known_cases():
    assert bound.amdahl_bound(0.5, 2.0) == pytest.approx(4 / 3)
    assert bound.amdahl_bound(0.0, 3.0) == 1.0  # nothing in FP8: nothing gained
    assert bound.amdahl_bound(0.7, 1.0) == 1.0  # FP8 GEMMs no faster: nothing gained
    assert bound.amdahl_bound(1.0, 2.5) == pytest.approx(2.5)  # all GEMMs: g itself
    assert bound.amdahl_bound(0.5, 0.5) == pytest.approx(2 / 3)  # emulated FP8: a bound below 1
    with pytest.raises(ValueError, match="share of time"):
        bound.amdahl_bound(1.5, 2.0)
    with pytest.raises(ValueError, match="speed-up"):
        bound.amdahl_bound(0.5, 0.0)


def test_at_limit_uses_the_declared_threshold():
    """One x, 82.5% of its bound, on both sides of it as the threshold moves (the default is 0.9)."""
    assert bound.at_limit(1.10, 4 / 3, 0.8) is True
    assert bound.at_limit(1.10, 4 / 3, 0.9) is False
    assert bound.at_limit(1.10, 4 / 3) is False
    assert bound.at_limit(1.30, 4 / 3, 0.9) is True  # 97.5%
    assert bound.at_limit(1.30, 4 / 3, 0.99) is False
    assert bound.at_limit(None, 4 / 3) is None


# A baseline profile by hand: 10 ms in all; two up-projections [128, 64, 256] (3 ms), two down
# [128, 256, 64] (2 ms), a hidden-axis GEMM [128, 64, 64] (1 ms), an attention matmul (no dims, 1 ms).
PROFILE_BY_OP = {"total_ms": 10.0, "gemm_names": "op", "gemms": [
    {"name": "aten::linear", "dims": [128, 64, 256], "ms": 3.0, "count": 2.0},
    {"name": "aten::linear", "dims": [128, 256, 64], "ms": 2.0, "count": 2.0},
    {"name": "aten::matmul", "dims": [128, 64, 64], "ms": 1.0, "count": 1.0},
    {"name": "aten::bmm", "dims": None, "ms": 1.0, "count": 1.0}]}
CALLS = [{"layer": f"encoder.layer.{i}.{name}", "dims": dims}
         for i in (0, 1) for name, dims in (("up", [128, 64, 256]), ("down", [128, 256, 64]))]


def test_f_by_shape_is_the_recipe_gemms_share():
    share = bound.recipe_share(PROFILE_BY_OP, CALLS)
    assert share["f"] == pytest.approx(0.5) and share["kind"] == "exact" and share["found"] == 4
    only_up = [c for c in CALLS if c["layer"].endswith("up")]
    assert bound.recipe_share(PROFILE_BY_OP, only_up)["f"] == pytest.approx(0.3)


def test_f_by_shape_splits_a_shape_shared_with_other_gemms():
    # The recipe runs one of the two up-projections in FP8: the other shares its shape.
    share = bound.recipe_share(PROFILE_BY_OP, CALLS[:1])
    assert share["f"] == pytest.approx(0.15) and share["kind"] == "split" and "split by call count" in share["basis"]


def test_f_is_a_lower_bound_where_recipe_gemms_are_missing_from_the_profile():
    profile = copy.deepcopy(PROFILE_BY_OP)
    profile["gemms"][1]["count"] = 1.0  # one down-projection ran in a kernel no op claims
    share = bound.recipe_share(profile, CALLS)
    assert share["kind"] == "incomplete" and "only 3 of the recipe's 4" in share["basis"]


def test_f_by_module_name_needs_the_whole_module_path_and_the_calls_dims():
    profile = {"total_ms": 8.0, "gemm_names": "module", "gemms": [
        {"name": "blocks.0.attn.proj/MatMul", "dims": [196, 32, 32], "ms": 1.0, "count": 1.0},
        {"name": "cls_attn_blocks.0.attn.proj/MatMul", "dims": [1, 32, 32], "ms": 1.0, "count": 1.0},
        # a layer also called at a site the recipe keeps out of FP8 (other rows)
        {"name": "blocks.0.attn.qkv/MatMul", "dims": [196, 32, 96], "ms": 2.0, "count": 1.0},
        {"name": "blocks.0.attn.qkv/MatMul_1", "dims": [16, 32, 96], "ms": 0.5, "count": 1.0},
        # a TensorRT layer that fused a GEMM and its bias add, shape unknown
        {"name": "blocks.0.mlp.fc1/MatMul + blocks.0.mlp.fc1/Add", "dims": None, "ms": 2.0, "count": 1.0}]}
    calls = [{"layer": "blocks.0.attn.proj", "dims": [196, 32, 32]}, {"layer": "blocks.0.attn.qkv", "dims": [196, 32, 96]},
             {"layer": "blocks.0.mlp.fc1", "dims": [196, 32, 128]}]
    share = bound.recipe_share(profile, calls)
    assert share["f"] == pytest.approx(5.0 / 8.0) and share["kind"] == "exact" and share["basis"] == "by module name"
    # Unknown dims under a recipe layer's name that runs twice: counted, and said to be a superset.
    profile["gemms"].append({"name": "blocks.0.mlp.fc1/MatMul_1", "dims": None, "ms": 0.5, "count": 1.0})
    share = bound.recipe_share(profile, calls)
    assert share["kind"] == "superset" and share["f"] == pytest.approx(5.5 / 8.0)


def test_f_needs_a_profile_with_gemm_calls():
    with pytest.raises(ValueError, match="rerun profile"):
        bound.recipe_share({"total_ms": 1.0, "groups_ms": {}}, CALLS)


SHAPES = {"up": {"fp16_gemm_ms": 1.0, "fp8_gemm_ms": 0.5}, "down": {"fp16_gemm_ms": 2.0, "fp8_gemm_ms": 1.5}}


def test_g_is_summed_fp16_time_over_summed_fp8_time():
    calls = [{"layer": "a", "shape": "up"}, {"layer": "b", "shape": "up"}, {"layer": "c", "shape": "down"}]
    g = bound.gemm_speedup(SHAPES, calls)
    assert g == {"fp16_ms": 4.0, "fp8_ms": 2.5, "g": 1.6}
    assert bound.gemm_speedup(SHAPES, calls[:1])["g"] == 2.0


def _gemm_doc(status: str = "ok") -> dict:
    calls = [{"layer": c["layer"], "dims": c["dims"], "shape": "up" if c["layer"].endswith("up") else "down"}
             for c in CALLS]
    doc = {"target": "cpu-torch", "model": "m", "setting": "w128", "status": status,
           "provenance": {"params": {"specs": {"fp8": {}}}}}
    if status == "ok":
        doc["graphs"] = {"main": {"shapes": SHAPES, "variants": {"fp8": {"status": "ok", "calls": calls, "emulated": False,
                                                                          **bound.gemm_speedup(SHAPES, calls)}}}}
    else:
        doc["error"] = "Traceback ...\nRuntimeError: no FP8 GEMM for this shape"
    return doc


def _kernels_doc(status: str = "ok") -> dict:
    doc = {"target": "cpu-torch", "model": "m", "setting": "w128", "variant": "fp16", "status": status}
    if status == "ok":
        doc["graphs"] = {"main": PROFILE_BY_OP}
    else:
        doc["error"] = "Traceback ...\nRuntimeError: profiler crashed"
    return doc


ROW = {"target": "cpu-torch", "model": "m", "setting": "w128", "variant": "fp8", "graph": "main", "x": 1.1}


def test_the_bound_of_a_speed_row_from_its_gemm_and_profile_json():
    gemms = {("cpu-torch", "m", "w128"): ("gemm.json", _gemm_doc())}
    kernels = {("cpu-torch", "m", "w128", "fp16"): ("kernels.json", _kernels_doc())}
    b = aggregate_bound.row_bound(ROW, gemms, kernels, "fp16", 0.9)
    assert b["f"] == pytest.approx(0.5) and b["g"] == pytest.approx(1.5)  # (2 x 1 + 2 x 2) / (2 x 0.5 + 2 x 1.5)
    assert b["bound"] == pytest.approx(1.2) and b["at_limit"] is True  # 1.1 is 92% of 1.2
    assert b["f_source"] == "kernels.json" and b["g_source"] == "gemm.json" and b["bound_note"] is None
    assert aggregate_bound.row_bound(ROW | {"x": 0.9}, gemms, kernels, "fp16", 0.9)["at_limit"] is False
    assert aggregate_bound.row_bound(ROW, gemms, kernels, "fp16", 0.95)["at_limit"] is False  # the study's threshold
    # No FP8 layer in the variant; a failed GEMM job; a failed baseline profile: each says so.
    assert aggregate_bound.row_bound(ROW | {"variant": "fp16"}, gemms, kernels, "fp16", 0.9)["bound_note"] == "no FP8 layer"
    failed = {("cpu-torch", "m", "w128"): ("gemm.json", _gemm_doc("failed"))}
    assert aggregate_bound.row_bound(ROW, failed, kernels, "fp16", 0.9)["bound_note"] == \
        "GEMM timing failed: RuntimeError: no FP8 GEMM for this shape"
    broken = {("cpu-torch", "m", "w128", "fp16"): ("kernels.json", _kernels_doc("failed"))}
    b = aggregate_bound.row_bound(ROW, gemms, broken, "fp16", 0.9)
    assert b["bound"] is None and b["g"] == pytest.approx(1.5)
    assert b["bound_note"] == "profile of the baseline fp16 failed: RuntimeError: profiler crashed"


def test_the_bound_is_rendered_next_to_x_with_its_marker_and_reason():
    """The render path: speed rows carrying the bound (as aggregate writes them) -> the speed table's cells."""
    from quantstudy.render import environment

    macros = environment().get_template("macros.md.j2").module
    gemms = {("cpu-torch", "m", "w128"): ("gemm.json", _gemm_doc())}
    kernels = {("cpu-torch", "m", "w128", "fp16"): ("kernels.json", _kernels_doc())}
    at = ROW | {"status": "ok"} | aggregate_bound.row_bound(ROW, gemms, kernels, "fp16", 0.9)
    assert str(macros.bound_cell(at)) == "1.20: hardware limit (f 50.00%, g 1.50)"
    low = ROW | {"status": "ok", "x": 0.6} | aggregate_bound.row_bound(ROW | {"x": 0.6}, gemms, kernels, "fp16", 0.9)
    assert str(macros.bound_cell(low)) == "1.20: **engine** (x is 50.00% of it) (f 50.00%, g 1.50)"
    failed = ROW | {"status": "ok"} | aggregate_bound.row_bound(
        ROW, gemms, {("cpu-torch", "m", "w128", "fp16"): ("kernels.json", _kernels_doc("failed"))}, "fp16", 0.9)
    assert str(macros.bound_cell(failed)) == "profile of the baseline fp16 failed: RuntimeError: profiler crashed"


@pytest.mark.parametrize("name", ["torch", "onnxruntime", "torch-cuda", "tensorrt"])
def test_gemm_timing_runs_what_each_backends_fp8_engine_runs(name, one_cpu_thread):
    """g is of the GEMM the backend's FP8 engine runs: torch._scaled_mm on a GPU with FP8, a TensorRT
    FP8 tactic; emulated (dequantize, then a wider GEMM) on the CPU backends, where g < 1 is the answer.
    Two shapes, one with two calls: each timed as a stack of its calls; per-GEMM time = the GEMM calls in
    each stack's profile / copies, the FP8 stack's quantize (and dequantize) ops left out."""
    from helpers import backend_or_skip, target_for

    from quantstudy import gemm

    backend_or_skip(name)
    calls = [{"layer": f"l{i}", "input_shape": [1, 32, 64], "dims": [32, 64, 128], "bias": True,
              "dequantize_dtype": "float16"} for i in (0, 1)]
    calls.append({"layer": "l2", "input_shape": [1, 32, 128], "dims": [32, 128, 64], "bias": False,
                  "dequantize_dtype": "float16"})
    shapes = gemm.time_calls({"fp8": calls}, {"fp8": "float16"}, target_for(name),
                             {"warmup": 2, "rounds": 3, "calls_per_round": 2})
    assert sorted((s["dims"], s["copies"]) for s in shapes.values()) == [([32, 64, 128], 2), ([32, 128, 64], 1)]
    for s in shapes.values():
        for stack in ("fp16", "fp8"):
            gemms = s["gemm_profile"][stack]["gemms"]
            assert sum(e["count"] for e in gemms) == pytest.approx(s["copies"]), gemms
            assert s[f"{stack}_gemm_ms"] == pytest.approx(sum(e["ms"] for e in gemms) / s["copies"])
            assert not any("quantize" in e["name"].lower() for e in gemms), gemms
        assert s["g"] == pytest.approx(s["fp16_gemm_ms"] / s["fp8_gemm_ms"])
        assert s["emulated"] == (name in ("torch", "onnxruntime")), s["fp8_ran"]
        if name == "torch-cuda":
            assert s["fp8_gemm"] == "torch._scaled_mm"
        if name == "onnxruntime":
            assert {"onnxruntime::QuantizeLinear", "onnxruntime::DequantizeLinear"} <= {r["name"] for r in s["fp8_ran"]}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_profiled_gemm_calls_are_per_forward_like_the_total(device):
    """A forward that is one projection: its GEMM calls hold the whole profiled time, per forward
    (ms and count), at any number of profiled calls; f read from them is 1."""
    import torch

    from quantstudy import timing

    if device == "cuda" and not torch.cuda.is_available():
        skip_without_gpu("the CUDA profile needs a GPU; torch sees none here")

    class OneProjection:
        def __init__(self):
            self.device = torch.device(device)
            self.layer = torch.nn.Linear(256, 512).to(self.device)
            self.x = torch.randn(64, 256, device=self.device)

        @torch.no_grad()
        def profile_call(self):
            self.layer(self.x)

        def synchronize(self):
            if device == "cuda":
                torch.cuda.synchronize()

    for calls in (1, 4):
        profile = timing.kernel_profile(OneProjection(), calls, lambda *a: "all", set())
        assert [(e["dims"], e["count"]) for e in profile["gemms"]] == [([64, 256, 512], 1.0)], profile["gemms"]
        assert profile["gemms"][0]["ms"] == pytest.approx(profile["total_ms"]), (calls, profile)
        share = bound.recipe_share(profile, [{"layer": "layer", "dims": [64, 256, 512]}])
        assert share["f"] == pytest.approx(1.0) and share["kind"] == "exact"


def test_a_cpu_profile_keeps_its_median_session_so_one_slow_call_does_not_count(monkeypatch):
    """A CPU profile sums op self time, so a call slowed by another job on the core would count whole.
    A forward whose second profiled call does a large extra GEMM (as a preempted call takes longer):
    the kept session is one of the fast ones, and every session's total is recorded."""
    import torch

    from quantstudy import timing

    class SlowOnce:
        device = torch.device("cpu")

        def __init__(self):
            self.layer, self.x, self.calls = torch.nn.Linear(256, 256), torch.randn(64, 256), 0
            self.big = torch.randn(1536, 1536)

        @torch.no_grad()
        def profile_call(self):
            self.calls += 1
            self.layer(self.x)
            if self.calls == 4:  # the second session's profiled call (each session has a warm-up call first)
                self.big @ self.big

        def synchronize(self):
            pass

    monkeypatch.setattr(timing, "CPU_SESSIONS", 3)  # one on a machine measuring alone; the median of three here
    profile = timing.kernel_profile(SlowOnce(), 1, lambda *a: "all", set())
    totals = profile["sessions_total_ms"]
    assert len(totals) == timing.CPU_SESSIONS == 3 and totals == sorted(totals)
    assert totals[-1] > 3 * totals[1]  # the slow session
    assert profile["total_ms"] == totals[1]


REPEAT_RUN = Path(__file__).resolve().parent.parent / "results/h200-torch-repeats/w128-bound"


def test_the_committed_h200_repeat_run_renders_the_bound_that_its_json_gives():
    """results/h200-torch-repeats/w128-bound/ (fnet-base w128 on one H200, two timing jobs per engine):
    the fp8 row's bound, recomputed here from the gemm.json and baseline kernels.json that its rules
    wrote, is the one in tables.json and in the rendered README; real FP8 GEMMs (g > 1, not emulated)
    and x within 1% across the two jobs, and x no higher than the bound allows."""
    from quantstudy import artifacts

    results = REPEAT_RUN / "results"
    tables = artifacts.read_json(results / "fnet/tables.json", "tables")
    (row,) = [r for r in tables["speed"] if r["variant"] == "fp8"]
    gemms = {("h200-torch", "fnet-base", "w128"): (row["g_source"], artifacts.read_json(
        results.parent / row["g_source"], "gemm"))}
    kernels = {("h200-torch", "fnet-base", "w128", "fp16"): (row["f_source"], artifacts.read_json(
        results.parent / row["f_source"], "kernels"))}
    again = aggregate_bound.row_bound(row, gemms, kernels, "fp16", tables["bound"]["at_limit"])
    assert {k: again[k] for k in aggregate_bound.BOUND_COLUMNS} == {k: row[k] for k in aggregate_bound.BOUND_COLUMNS}
    assert row["bound"] == pytest.approx(1 / ((1 - row["f"]) + row["f"] / row["g"]))  # Amdahl, by hand
    assert row["g"] > 1 and row["fp8_emulated"] is False and 0 < row["f"] < 1
    assert row["x"] <= row["bound"] * 1.01 and row["x_jobs_spread"] < 0.01 and len(row["x_by_repeat"]) == 2
    # The README's cell, written out here from the row: bound, verdict, f and g as the page prints them.
    cell = f"| {row['bound']:.2f}: hardware limit (f {100 * row['f']:.2f}%, g {row['g']:.2f}) |"
    assert row["at_limit"] is True and cell == "| 1.12: hardware limit (f 41.96%, g 1.34) |"
    assert cell in (results / "fnet/README.md").read_text()


@pytest.mark.parametrize("timed_ms,withheld", [(10.0, False), (15.0, False), (6.7, False), (15.1, True), (6.6, True)])
def test_a_profile_far_from_its_timing_withholds_the_bound(timed_ms, withheld):
    """The baseline's profile totals 10 ms a call: against a timed median of 6.7 to 15 ms (within 1.5 x
    either way) the bound is computed; further apart the profile is no split of the timed call and the
    bound is withheld, saying why."""
    import pandas as pd

    gemms = {("cpu-torch", "m", "w128"): ("gemm.json", _gemm_doc())}
    kernels = {("cpu-torch", "m", "w128", "fp16"): ("kernels.json", _kernels_doc())}
    key = {"target": "cpu-torch", "model": "m", "setting": "w128", "graph": "main", "variant": "fp16", "status": "ok"}
    judged = aggregate_bound.with_timed(pd.DataFrame([{**key, "total_ms": 10.0}]),
                                        pd.DataFrame([{**key, "variant_ms": timed_ms}]), {"w128": "fp16"}, "fp8").iloc[0].to_dict()
    b = aggregate_bound.row_bound(ROW, gemms, kernels, "fp16", 0.9,
                                  {("cpu-torch", "m", "w128", "main", "fp16"): judged})
    if withheld:
        assert b["bound"] is None and b["bound_note"].startswith("withheld: the baseline's profile totals 10 ms a call")
        assert f"the {timed_ms:.3g} ms its timing measured" in b["bound_note"]
    else:
        assert b["bound"] == pytest.approx(1.2) and b["bound_note"] is None


def test_each_profile_row_carries_its_timing_and_whether_they_agree():
    """kernels rows get the timed median of the same target, model, setting, graph and variant; a 933 ms
    profile against 38.5 ms timed (seen on a tiny DeBERTa at batch 32) disagrees; a failed timing gives none."""
    import pandas as pd

    key = {"target": "t", "model": "m", "setting": "s", "graph": "main"}
    kernels = pd.DataFrame([{**key, "variant": "fp16", "status": "ok", "total_ms": 933.0},
                            {**key, "variant": "fp8", "status": "ok", "total_ms": 40.0},
                            {**key, "variant": "fp32", "status": "ok", "total_ms": 50.0}])
    speed = pd.DataFrame([{**key, "variant": "fp16", "status": "ok", "variant_ms": 38.5},
                          {**key, "variant": "fp8", "status": "ok", "variant_ms": 38.5},
                          {**key, "variant": "fp32", "status": "failed", "variant_ms": None}])
    rows = aggregate_bound.with_timed(kernels, speed, {"s": "fp16"}, "fp8").set_index("variant")
    assert rows.loc["fp16", "profile_agrees"] is False and rows.loc["fp16", "profile_vs_timed"] == pytest.approx(933 / 38.5)
    assert rows.loc["fp8", "profile_agrees"] is True and rows.loc["fp8", "timed_ms"] == 38.5
    assert rows.loc["fp32", "profile_agrees"] is None


def test_a_baselines_profile_is_set_beside_the_time_the_speed_table_shows():
    """One time per baseline engine on a page: the one timed beside the candidate (the speed table's
    baseline ms), not the baseline's own job (DeBERTa base b32: 2.185 ms beside fp8, 3.345 ms alone)."""
    import pandas as pd

    key = {"target": "t", "model": "m", "setting": "s", "graph": "main", "status": "ok"}
    kernels = pd.DataFrame([{**key, "variant": "fp16", "total_ms": 2.5}, {**key, "variant": "fp8", "total_ms": 2.0}])
    speed = pd.DataFrame([{**key, "variant": "fp16", "variant_ms": 3.345, "baseline_ms": 3.345},
                          {**key, "variant": "fp8", "variant_ms": 1.9, "baseline_ms": 2.185}])
    rows = aggregate_bound.with_timed(kernels, speed, {"s": "fp16"}, "fp8").set_index("variant")
    assert rows.loc["fp16", "timed_ms"] == 2.185 and rows.loc["fp8", "timed_ms"] == 1.9


def test_a_row_wise_fp8_layer_is_its_own_gemm_shape_timed_with_its_scales():
    """g of a per-channel-per-token variant times row-wise GEMMs: its calls name their scales, so its shape is
    not the per-tensor recipe's, and the GEMM stack rebuilds its layers with those scales."""
    import torch

    from quantstudy import gemm, quantization

    def calls(**granularity):
        layer = quantization.FP8Linear(torch.randn(32, 16), None, 1.0, 1.0, torch.float16, torch.float16, **granularity)
        return gemm.recipe_calls(torch.nn.Sequential(layer), {"input": torch.randn(4, 16).half()})

    [tensor], [rows] = calls(), calls(weight_scales="per_channel", activation_scales="per_token")
    assert gemm.shape_key(tensor) == "4x16 @ 16x32 -> float16"
    assert gemm.shape_key(rows) == "4x16 @ 16x32 -> float16 (per_channel weights, per_token activations)"
    stack, _ = gemm._stack([(rows, 1, "float16")], "fp8", seed=0)
    assert (stack.layers[0].weight_scales, stack.layers[0].activation_scales) == ("per_channel", "per_token")
