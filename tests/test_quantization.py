"""FP8 fake-quant against a float64 reference, FP8Linear's math, and calibration determinism."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from quantstudy import calibration as qcal, quantization as q, steps_reference, transforms as qtr

from helpers import reference_qdq

E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -7, 0.0123, 3.7])
def test_fake_quant_matches_float64_reference(scale):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 300 * scale,
                   torch.tensor([0.0, -0.0, 448 * scale, 500 * scale, -1e9, 17 * scale, 18 * scale, 19 * scale]),
                   # exact midpoints between neighbours: the ties-to-even cases
                   ((E4M3_GRID[1:120] + E4M3_GRID[2:121]) / 2 * scale).float()])
    s = torch.tensor(scale, dtype=torch.float32)
    got = q.dequantize_fp8(q.quantize_fp8(x, s), s, torch.float64)
    want = reference_qdq(x, scale)
    assert torch.equal(got, want.to(torch.float32).to(torch.float64))


def test_fp8_linear_is_quantize_dequantize_matmul_bias():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(32, 16, generator=g), torch.randn(32, generator=g), torch.randn(4, 16, generator=g)
    layer = q.FP8Linear(w, b, input_amax=float(x.abs().max()), weight_amax=float(w.abs().max()),
                        dequantize_dtype=torch.float32, work_dtype=torch.float32)
    sx, sw = float(x.abs().max()) / 448, float(w.abs().max()) / 448
    want = reference_qdq(x, sx) @ reference_qdq(w, sw).T + b.double()
    assert torch.allclose(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    assert layer.weight.dtype == torch.float8_e4m3fn


def test_select_and_outlier_rule():
    names = ["a.0.intermediate.dense", "a.0.output.dense", "a.1.output.dense", "a.pooler.dense"]
    assert q.select(names, ["a.*.output.dense"]) == ["a.0.output.dense", "a.1.output.dense"]
    amax = {n: {"input_amax": 1.0, "weight_amax": 1.0} for n in names}
    amax["a.1.output.dense"]["input_amax"] = 30.0
    report = qcal.outliers(amax, names[:3], 20)
    assert report["layers"] == ["a.1.output.dense"] and report["largest_ratio"]["input_amax"] == 30.0


def test_the_outlier_rule_reads_weights_too_and_a_scale_at_the_ratio_is_not_an_outlier():
    """Median 1.0 of each kind: a weight amax 25 times it is an outlier, whatever the inputs; an input amax
    exactly 20 times it, with ratio 20, is not ("above ratio x the median")."""
    names = ["h.0.fc", "h.1.fc", "h.2.fc"]
    amax = {n: {"input_amax": 1.0, "weight_amax": 1.0} for n in names}
    amax["h.2.fc"]["weight_amax"] = 25.0
    amax["h.1.fc"]["input_amax"] = 20.0
    report = qcal.outliers(amax, names, 20)
    assert report["layers"] == ["h.2.fc"]
    assert report["largest_ratio"] == {"input_amax": 20.0, "weight_amax": 25.0}


def test_a_variants_exclude_takes_its_layers_out_of_the_recipe():
    names = [f"h.{i}.{k}" for i in range(2) for k in ("q", "o", "fc")]
    recipe = {"quantize": ["h.*.q", "h.*.fc"]}
    assert qtr.fp8_layers(names, recipe, {}, []) == ["h.0.q", "h.0.fc", "h.1.q", "h.1.fc"]
    assert qtr.fp8_layers(names, recipe, {"exclude": ["*.fc"]}, []) == ["h.0.q", "h.1.q"]
    assert qtr.fp8_layers(names, recipe, {"exclude": ["h.1.*"]}, []) == ["h.0.q", "h.0.fc"]


def test_fp32_dequantize_dequantizes_to_fp32():
    """An fp16 graph: its FP8 layer dequantizes to fp16 by the recipe, to fp32 with fp32_dequantize, and so
    stores its scales in that dtype. Worked out apart from FP8Linear: reference_qdq, scales amax / 448
    rounded to the dequantize dtype, the product in it, the output rounded to fp16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    x = torch.randn(4, 16)
    w, b = model[0].weight.detach(), model[0].bias.detach()
    amax = {"amax": {"0": {"input_amax": 3.0, "weight_amax": 0.3}}, "outliers": {"layers": []}}
    recipe = {"quantize": ["0"], "dequantize_dtype": "float16"}

    def expected(dq):
        sx, sw = (float(torch.tensor(a / 448).to(dq)) for a in (3.0, 0.3))
        xq = reference_qdq(x.half().float(), sx).float().to(dq)
        wq = reference_qdq(w, sw).float().to(dq)
        return torch.nn.functional.linear(xq, wq, b.half().to(dq)).half()

    for transforms, dq in (([{"fp8": {}}], torch.float16), ([{"fp8": {}}, {"fp32_dequantize": {}}], torch.float32)):
        variant, summary = qtr.apply_variant(copy.deepcopy(model), {"precision": "float16", "transforms": transforms},
                                             recipe, amax)
        assert summary["dequantize_dtype"] == str(dq).removeprefix("torch."), transforms
        with torch.no_grad():
            got = variant(x.half())
        assert torch.equal(got, expected(dq)), f"{transforms}: not the layer that dequantizes to {dq}"
    assert not torch.equal(expected(torch.float16), expected(torch.float32))  # the two are told apart


def test_fp8_layers_add_extends_the_recipe_without_repeating_it():
    """`add` puts layers on top of the recipe (or of the variant's own include); excludes, edge blocks and
    outliers still apply to the whole."""
    names = [f"h.{i}.{k}" for i in range(3) for k in ("q", "o", "fc")]
    recipe = {"quantize": ["h.*.q", "h.*.fc"]}
    assert qtr.fp8_layers(names, recipe, {"add": ["h.*.o"]}, []) == names
    assert qtr.fp8_layers(names, recipe, {"include": ["h.*.fc"], "add": ["h.*.o"]}, []) == \
        ["h.0.o", "h.0.fc", "h.1.o", "h.1.fc", "h.2.o", "h.2.fc"]
    assert qtr.fp8_layers(names, recipe, {"add": ["h.*.o"], "keep_edge_blocks": 1}, ["h.1.q"]) == ["h.1.o", "h.1.fc"]


def test_amax_file_is_deterministic(tiny_inputs, tmp_path):
    study = tiny_inputs["study"]
    docs = []
    for i in range(2):
        out = tmp_path / f"amax{i}.json"
        steps_reference.calibrate(study.family, "fnet-base", {"name": "w128", "batch": 1, "shape": {"window": 128}},
                                  study.models["fnet-base"].architecture, study.recipe.as_params(), str(tiny_inputs["checkpoint"]),
                                  str(tiny_inputs["calibration"]), str(out))
        docs.append(json.loads(out.read_text()))
    assert docs[0]["amax"] == docs[1]["amax"]
    assert len(docs[0]["recipe_layers"]) == 2 * 2  # intermediate.dense and output.dense of 2 layers
    assert all(v["input_amax"] > 0 for v in docs[0]["amax"].values())
    assert docs[0]["provenance"]["inputs"]["checkpoint"]["sha256"]


def test_widen_scales_multiplies_each_fp8_layers_activation_amax():
    """widen_scales {factor: 1.5}: every FP8 layer's activation scale is 1.5 x amax / 448; the weight
    scale stays as it was (the amax values are set by hand)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    amax = {"amax": {"0": {"input_amax": 2.0, "weight_amax": 0.5}, "2": {"input_amax": 4.0, "weight_amax": 0.25}},
            "outliers": {"layers": []}}
    recipe = {"quantize": ["0", "2"], "dequantize_dtype": "float32"}
    plain, _ = qtr.apply_variant(copy.deepcopy(model), {"precision": "float32", "transforms": [{"fp8": {}}]}, recipe, amax)
    wide, summary = qtr.apply_variant(copy.deepcopy(model), {"precision": "float32", "transforms": [
        {"fp8": {}}, {"widen_scales": {"factor": 1.5}}]}, recipe, amax)
    assert summary["activation_scale_factor"] == 1.5
    for name, input_amax in (("0", 2.0), ("2", 4.0)):
        assert float(plain.get_submodule(name).input_scale) == pytest.approx(input_amax / 448)
        assert float(wide.get_submodule(name).input_scale) == pytest.approx(1.5 * input_amax / 448)
        assert float(wide.get_submodule(name).weight_scale) == float(plain.get_submodule(name).weight_scale)


def test_a_transform_with_when_applies_only_at_the_settings_it_names():
    """FNet's fp8 variant: hidden scaling `when: {window: [512]}` applies at 512 tokens only; fp8 at all."""
    from quantstudy.config import Variant
    from quantstudy.families.base import Setting

    fp8 = Variant("fp8", "float16", (("fp8", {}), ("hidden_scaling", {"factor": 64, "when": {"window": [512]}})))
    at = lambda window: fp8.spec(Setting(f"w{window}", 1, {"window": window}))["transforms"]
    assert at(512) == [{"fp8": {}}, {"hidden_scaling": {"factor": 64}}]
    assert at(128) == at(256) == [{"fp8": {}}]
    assert not Variant("x", "float16", (("fp8", {"when": {"window": [512]}}),)).has_fp8(Setting("w128", 1, {"window": 128}))


def _outlier_stack():
    """Two linears; the first's inputs have 4 of 64 channels 20 times the rest (an outlier tail)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    g = torch.Generator().manual_seed(1)
    batches = [{"input": torch.randn(16, 64, generator=g) * torch.cat([torch.ones(60), torch.full((4,), 20.0)])}
               for _ in range(8)]
    return model, batches


def test_max_calibration_is_the_largest_input_and_weight_seen():
    model, batches = _outlier_stack()
    first = model[0].weight.detach().abs().max()
    inputs = torch.cat([b["input"] for b in batches]).abs().max()
    amax = qcal.calibrate(model, batches)
    assert amax["0"]["input_amax"] == pytest.approx(float(inputs)) and amax["0"]["weight_amax"] == pytest.approx(float(first))


def test_percentile_calibration_is_the_inputs_percentile_within_a_histogram_bin():
    """ModelOpt's histogram calibrator at 99%: the first layer's input amax is the 99th percentile of |x| over
    the calibration inputs, within 2% (its 2048 bins span the range of the batches so far and are merged as
    later batches exceed it: measured 30.48 against 30.13); the weights stay at max."""
    model, batches = _outlier_stack()
    x = torch.cat([b["input"] for b in batches]).abs().flatten().double()
    amax = qcal.calibrate(model, batches, method={"method": "percentile", "percentile": 99.0})
    assert amax["0"]["input_amax"] == pytest.approx(float(torch.quantile(x, 0.99)), rel=0.02)
    assert amax["0"]["input_amax"] < 0.6 * float(x.max())  # the outlier tail clipped, unlike max
    assert amax["0"]["weight_amax"] == pytest.approx(float(model[0].weight.detach().abs().max()))


def _e4m3_fake_quant(x: torch.Tensor, amax: float) -> torch.Tensor:
    """x to FP8 E4M3 at scale amax / 448 and back, in float32 (saturating)."""
    scale = amax / 448.0
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def test_mse_calibration_picks_the_weight_amax_of_least_squared_error_and_keeps_inputs_at_max():
    """ModelOpt's mse: from max, each weight's amax is max|w| times the one of 39 evenly spaced multipliers from
    0.25 to 4 whose FP8 round trip has the least squared error; activations stay at max calibration's."""
    model, batches = _outlier_stack()
    w = model[0].weight.detach().float()
    candidates = torch.linspace(0.25, 4.0, 39) * w.abs().max()
    errors = torch.stack([((_e4m3_fake_quant(w, float(a)) - w) ** 2).sum() for a in candidates])
    best = float(candidates[errors.argmin()])
    assert best != pytest.approx(float(w.abs().max()))  # the hand-computed case moves the weight amax
    by_max = qcal.calibrate(copy.deepcopy(model), batches)
    amax = qcal.calibrate(model, batches, method={"method": "mse"})
    assert amax["0"]["weight_amax"] == pytest.approx(best, rel=1e-5)
    assert amax["0"]["input_amax"] == by_max["0"]["input_amax"]


def test_a_variants_method_reports_the_layers_it_moved_from_max():
    model, batches = _outlier_stack()
    amax, changed = qcal.calibrate_method(model, batches, {"method": "percentile", "percentile": 99.0})
    assert changed == {"input_amax": ["0", "2"], "weight_amax": []}


def test_a_method_that_moves_no_amax_is_not_applicable():
    """0.47's local_hessian calibrates no FP8 per-tensor weight: every amax stays max's, so it is no method here."""
    model, batches = _outlier_stack()
    with pytest.raises(qcal.NotApplicable, match="local_hessian gives every layer max calibration's amax"):
        qcal.calibrate_method(model, batches, {"method": "local_hessian"})


@pytest.mark.parametrize("method", [{"method": "entropy"}, {"method": "histogram_mse"},
                                    {"method": "smoothquant", "alpha": 0.5}])
def test_a_method_modelopt_does_not_apply_to_fp8_says_so(method):
    model, batches = _outlier_stack()
    with pytest.raises(qcal.NotApplicable, match="ModelOpt 0.47"):
        qcal.calibrate(model, batches, method=method)


def test_an_unknown_calibration_method_is_refused():
    model, batches = _outlier_stack()
    with pytest.raises(ValueError, match="not one of max, mse"):
        qcal.calibrate(model, batches, method={"method": "minmax"})


def test_nvfp4_rounds_each_value_to_the_e2m1_grid_times_its_block_scale():
    """A block of 16 with amax 6 and a calibrated amax of 6 x 448: per-tensor scale 1, block scale 6 / 6 = 1, so
    each value goes to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (2.6 -> 3, 0.7 -> 0.5, 5.2 -> 6, 0.2 -> 0).
    With a calibrated amax ten times larger the per-tensor scale is 10 and the block scale 0.1, which E4M3
    holds as 0.1015625 (1.625 x 2^-4): 6 comes back as 6 x 1.015625 = 6.09375."""
    x = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, 2.6, 0.7, -6, -0.4, 5.2, 1.2, 0.2, 3.4]])
    want = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, 3, 0.5, -6, -0.5, 6, 1, 0, 3]])
    assert torch.equal(q.microscaled(x, "nvfp4", 6 * 448), want)
    assert q.microscaled(x, "nvfp4", 6 * 448 * 10)[0, 7].item() == 6.09375
    with pytest.raises(ValueError, match="blocks of 16"):
        q.microscaled(torch.ones(2, 24), "nvfp4")


def test_mxfp8_scales_each_block_of_32_by_a_power_of_two():
    """32 powers of two, 2^-24 to 2^7: the block's scale is 2^(7 - 8) (E4M3's largest exponent is 8), so x /
    scale runs 2^-23 to 2^8 and every value below E4M3's smallest subnormal, 2^-9 (x < 2^-10), flushes to 0:
    the 14 smallest; the 18 others come back exact."""
    y = torch.tensor([[2.0 ** k for k in range(-24, 8)]])
    got = q.microscaled(y, "mxfp8")
    assert torch.equal(got[0, :14], torch.zeros(14)) and torch.equal(got[0, 14:], y[0, 14:])


def test_the_microscaling_transform_replaces_the_recipes_layers_and_reads_the_calibrated_amax():
    model, batches = _outlier_stack()
    amax = {"amax": qcal.calibrate(copy.deepcopy(model), batches), "outliers": {"layers": []}}
    x = batches[0]["input"]
    spec = {"precision": "float32", "transforms": [{"microscaling": {"format": "nvfp4", "exclude": ["2"]}}]}
    got, summary = qtr.apply_variant(copy.deepcopy(model), spec, {"quantize": ["*"], "dequantize_dtype": "float32"}, amax)
    assert summary["microscaled_layers"] == ["0"] and summary["microscaling_format"] == "nvfp4"
    first = q.microscaled(x, "nvfp4", amax["amax"]["0"]["input_amax"]) @ q.microscaled(model[0].weight.detach(), "nvfp4").T
    want = model[2](model[1](first + model[0].bias))
    assert torch.allclose(got(x), want, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        qtr.apply_variant(copy.deepcopy(model),
                          {"precision": "float32", "transforms": [{"fp8": {}}, {"microscaling": {"format": "mxfp8"}}]},
                          {"quantize": ["*"], "dequantize_dtype": "float32"}, amax)


def test_per_channel_and_per_token_scales_round_each_row_by_its_own_amax():
    """fp8 {weight_scales: per_channel, activation_scales: per_token}: the weight's row r is FP8 at max|w_r| / 448
    (rounded to the fp16 Dequantize), the input's row t at max|x_t| / 448 in fp32, each against the float64
    reference; per tensor, the smallest weight row falls below FP8's subnormals."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 16, generator=g, dtype=torch.float64) * torch.tensor([1e-4, 1e-2, 0.1, 1, 10, 100]).unsqueeze(1).double()
    x = torch.randn(3, 16, generator=g, dtype=torch.float64) * torch.tensor([[0.01], [1.0], [50.0]]).double()
    layer = q.FP8Linear(w.float(), None, input_amax=1.0, weight_amax=1.0, dequantize_dtype=torch.float32,
                        work_dtype=torch.float32, weight_scales="per_channel", activation_scales="per_token")
    w_scale = [float(r.abs().max()) / 448 for r in w]
    x_scale = [float(torch.tensor(float(r.abs().max()), dtype=torch.float32)) / 448 for r in x]
    w_ref = torch.stack([reference_qdq(r, float(torch.tensor(s, dtype=torch.float32))) for r, s in zip(w, w_scale)])
    x_ref = torch.stack([reference_qdq(r, float(torch.tensor(s, dtype=torch.float32))) for r, s in zip(x, x_scale)])
    want = x_ref @ w_ref.T
    got = layer(x.float()).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    per_tensor = q.FP8Linear(w.float(), None, float(x.abs().max()), float(w.abs().max()), torch.float32, torch.float32)
    exact = x @ w.T  # the output of weight row 0 (1e-4 against 100 per tensor: below FP8's subnormals)
    magnitude = x.abs() @ w.abs().T  # the dot products' size, without their cancellation
    relative = lambda y: float(((y - exact)[:, 0].abs() / magnitude[:, 0]).max())
    assert relative(got) < 0.1 and not per_tensor(x.float())[:, 0].any()  # per tensor: every such output is 0


def test_an_fp8_round_trip_scales_by_the_tensors_own_amax_or_a_given_scale():
    """Dynamic per-tensor: amax 448 maps to scale 1, where E4M3 keeps 3 mantissa bits (17 -> 16, 19 -> 20);
    at the probability scale 1/448, 1.0 and 0.5 stay exact and 0.3 rounds as the float64 reference does."""
    x = torch.tensor([448.0, 17.0, 19.0, -3.0])
    assert q.fp8_round_trip(x).tolist() == [448.0, 16.0, 20.0, -3.0]
    assert q.fp8_round_trip(x / 8).tolist() == [56.0, 2.0, 2.5, -0.375]  # the same grid, scaled
    p = torch.tensor([1.0, 0.5, 0.3], dtype=torch.float64)
    got = q.fp8_round_trip(p, q.UNIT_RANGE_SCALE)
    assert got.dtype == torch.float64 and got[:2].tolist() == [1.0, 0.5]
    assert got[2].item() == pytest.approx(reference_qdq(p[2:], q.UNIT_RANGE_SCALE).item(), rel=1e-6)
