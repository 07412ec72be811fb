"""The torch backend's CUDA paths: real FP8 GEMMs, torch.compile + CUDA graph replay, kernel profile.

Skipped without a CUDA GPU with FP8 (compute capability 8.9+), so CI (CPU) skips them all; run on
a GPU node with `python -m pytest tests/test_gpu.py -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from quantstudy import quantization as qz, timing as qt
from quantstudy.backends import torch_backend
from quantstudy.config import load_architecture
from quantstudy.families import get as family
from quantstudy.families.base import Setting

from helpers import skip_without_gpu

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def fp8_gpu():
    if not FP8_GPU:
        skip_without_gpu("needs a CUDA GPU with FP8 GEMMs (compute capability 8.9+, e.g. H100/H200/L40S); this "
                         "machine has " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"))

RECIPE = {"quantize": ["fnet.encoder.layer.*.intermediate.dense", "fnet.encoder.layer.*.output.dense"],
          "dequantize_dtype": "float16"}


def _linear(dequantize=torch.float16, bias=True):
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    b = torch.randn(256) if bias else None
    return qz.FP8Linear(w, b, input_amax=4.0, weight_amax=float(w.abs().max()), dequantize_dtype=dequantize,
                        work_dtype=torch.float16).cuda()


@pytest.mark.parametrize("dequantize", [torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_matches_fake_quant(dequantize, bias):
    layer = _linear(dequantize, bias)
    x = (torch.randn(3, 17, 128, device="cuda") * 1.5).half()  # M = 51: not a multiple of 16
    fake = layer(x)
    assert qz.use_fp8_gemm(layer, "cuda") == [""]
    real = layer(x)
    assert real.shape == fake.shape == (3, 17, 256) and real.dtype == torch.float16
    # Same quantized operands; only the accumulation order and output rounding differ.
    torch.testing.assert_close(real.float(), fake.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("weight_scales, activation_scales", [("per_channel", "static"), ("per_tensor", "per_token"),
                                                               ("per_channel", "per_token")])
@pytest.mark.parametrize("dequantize", [torch.float16, torch.float32])
def test_row_wise_scaled_mm_matches_fake_quant(weight_scales, activation_scales, dequantize):
    """Per-channel weights and per-token activations: one row-wise torch._scaled_mm (scale_a [M, 1], scale_b
    [1, N], a bf16 output) gives the fake-quant layer's output to bf16 rounding."""
    torch.manual_seed(0)
    w = torch.randn(256, 128) * torch.logspace(-2, 1, 256).unsqueeze(1)
    layer = qz.FP8Linear(w, torch.randn(256), 4.0, float(w.abs().max()), dequantize, torch.float16,
                         weight_scales=weight_scales, activation_scales=activation_scales).cuda()
    x = (torch.randn(3, 17, 128, device="cuda") * torch.logspace(-1, 1, 17, device="cuda").unsqueeze(1)).half()
    fake = layer(x)
    assert qz.use_fp8_gemm(layer, "cuda") == [""]
    real = layer(x)
    assert real.shape == fake.shape and real.dtype == torch.float16
    torch.testing.assert_close(real.float(), fake.float(), rtol=2e-2, atol=2e-2 * float(fake.abs().max()))


def test_fp8_gemm_skips_shapes_cublaslt_cannot_take():
    layer = qz.FP8Linear(torch.randn(24, 40), None, 1.0, 1.0, torch.float16, torch.float16).cuda()
    assert qz.use_fp8_gemm(layer, "cuda") == [] and not layer.fp8_gemm


def _tiny_fnet(variant: str, window: int = 256):
    fam = family("fnet")
    torch.manual_seed(0)
    from transformers import FNetForPreTraining

    ref = FNetForPreTraining(fam.hf_config(load_architecture("tiny-fnet-base"))).eval()
    model = fam.module(None, "main", Setting(f"w{window}", 1, {"window": window}), reference=ref)
    layers = qz.select(qz.linear_names(model), RECIPE["quantize"])
    amax = {"amax": {n: {"input_amax": 6.0, "weight_amax": 0.1} for n in layers}, "outliers": {"layers": []}}
    spec = {"precision": "float16", "transforms": [{"fp8": {}}] if variant == "fp8" else []}
    model, _ = qz.apply_variant(model, spec, RECIPE, amax, fam.transforms())
    return fam, model


@pytest.fixture(scope="module")
def fp8_runner():
    fam, model = _tiny_fnet("fp8")
    model = model.cuda()
    qz.use_fp8_gemm(model, "cuda")
    ids = {"input_ids": torch.randint(5, 500, (1, 256))}
    eager = model(input_ids=ids["input_ids"].cuda())["features"].float()
    return fam, torch_backend.Runner(model, ids, "cuda", compile=True), ids, eager


def test_runner_compiles_and_replays_a_cuda_graph(fp8_runner):
    _, runner, ids, eager = fp8_runner
    assert runner.graph is not None and len(runner.fp8_gemm) == 4
    out = runner(ids)["features"].float()
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
    other = torch.randint(5, 500, (1, 256))
    runner.static_inputs["input_ids"].copy_(other.cuda())
    runner.replay()
    runner.synchronize()
    assert not torch.equal(runner.static_outputs["features"].float(), out.cuda())  # the graph reads its static input
    result = qt.time_interleaved({"a": runner, "b": runner}, warmup=2, rounds=3, calls=5)
    assert result["a"]["median_ms"] > 0 and len(result["a"]["samples_ms"]) == 3


def test_fp8_proof_names_the_fp8_gemm_kernels(fp8_runner):
    _, runner, _, _ = fp8_runner
    proof = qt.fp8_proof(runner)
    print(proof)
    assert proof["gemm"] == "torch._scaled_mm" and proof["fp8_gemm_layers"] == 4
    assert proof["kernels"], "no kernel launched by torch._scaled_mm was seen"
    assert proof["calls_per_forward"] == 4
    assert all("Float8_e4m3fn" in d for d in proof["op_dtypes"])  # dtypes are recorded from torch 2.13 on


def test_kernel_profile_has_the_write_up_groups(fp8_runner):
    import functools

    fam, runner, _, _ = fp8_runner
    classify = functools.partial(fam.kernel_group, setting=Setting("w256", 1, {"window": 256}))
    prof = qt.kernel_profile(runner, 5, classify, set(fam.regions) | {qz.FP8_REGION})
    print(prof["groups_ms"])
    for k in prof["top_kernels"]:
        print(f"{k['group']:24s} {k['ms']:.4f} {k['op']} {k['name'][:100]}")
    assert set(prof["groups_ms"]) <= set(fam.kernel_groups)
    for group in ("sequence-axis DFT", "other GEMMs", "FP8 feed-forward GEMMs"):
        assert prof["groups_ms"].get(group, 0) > 0, group


def test_fp16_variant_has_no_fp8_kernels():
    _, model = _tiny_fnet("fp16")
    runner = torch_backend.Runner(model.cuda(), {"input_ids": torch.randint(5, 500, (1, 256))}, "cuda", compile=True)
    proof = qt.fp8_proof(runner)
    assert proof["fp8_gemm_layers"] == 0 and proof["kernels"] == []


def test_every_gpu_artifact_describes_its_gpu():
    """The provenance of a GPU job: model, driver, CUDA, clocks and the active clock event reasons."""
    from quantstudy import artifacts

    hw = artifacts.hardware()
    system = hw["gpu_system"]
    assert "error" not in system, system
    assert system["name"] == torch.cuda.get_device_name(0)
    assert system["driver"] and system["cuda_driver"]
    assert all(system["clocks_mhz"].values()) and all(system["max_clocks_mhz"].values())
    assert isinstance(system["clock_event_reasons_active"], list)


@pytest.mark.parametrize("fmt,config", [("nvfp4", "NVFP4_DEFAULT_CFG"), ("mxfp8", "MXFP8_DEFAULT_CFG")])
def test_the_cpu_microscaling_path_matches_modelopts_cuda_fake_quant(fmt, config):
    """The embedded default's NVFP4 / MXFP8 quality (MicroscaledLinear, ModelOpt's QTensor on the CPU) against
    ModelOpt's own CUDA fake-quant (mtq.quantize with its preset) of the same layers on the same inputs:
    the outputs agree to within 1e-3 of their norm (both round to the same grid with the same scales;
    the tolerance takes in a rounding tie broken the other way in a few elements)."""
    import copy

    import modelopt.torch.quantization as mtq
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128))
    spread = torch.cat([torch.ones(248), torch.full((8,), 20.0)])  # outlier channels
    batches = [torch.randn(32, 256) * spread for _ in range(4)]
    cuda = copy.deepcopy(model).cuda()
    mtq.quantize(cuda, copy.deepcopy(getattr(mtq, config)), lambda m: [m(b.cuda()) for b in batches])
    amax = {"amax": qz.calibrate(copy.deepcopy(model), [{"input": b} for b in batches]), "outliers": {"layers": []}}
    ours, _ = qz.apply_variant(copy.deepcopy(model), {"precision": "float32", "transforms": [{"microscaling": {"format": fmt}}]},
                               {"quantize": ["*"], "dequantize_dtype": "float32"}, amax)
    with torch.no_grad():
        got, want = ours(batches[0]), cuda(batches[0].cuda()).cpu()
    assert float((got - want).norm() / want.norm()) <= 1e-3


class _RoundTrips(torch.nn.Module):
    """An FP8 attention's operands (quantization.fp8_attention_operands / fp8_probabilities) in one forward."""

    def forward(self, x):
        q, k = qz.fp8_attention_operands(x, x * 2)
        return {"y": qz.fp8_probabilities(torch.softmax(q @ k.transpose(-1, -2), dim=-1))}


def test_fp8_attention_operands_are_captured_in_a_cuda_graph():
    """Seen on an H100: a scale made as a tensor inside forward is a host-to-device copy, refused by capture."""
    x = torch.randn(2, 16, 32, device="cuda")
    runner = torch_backend.Runner(_RoundTrips().cuda(), {"x": x}, device="cuda")
    assert runner.graph is not None
    torch.testing.assert_close(runner({"x": x})["y"], _RoundTrips()(x)["y"])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_a_microscaled_layer_runs_eagerly_on_cuda_and_matches_the_cpu(fmt):
    """ModelOpt's QTensor makes host tensors in its forward: the runner does not capture such a module."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 64), torch.randn(4, 64)
    layer = qz.MicroscaledLinear(w, None, fmt, float(x.abs().max()), torch.float32)
    cpu = layer(x)
    runner = torch_backend.Runner(layer.cuda(), {"input": x.cuda()}, device="cuda")
    assert runner.graph is None
    got = runner.model(x.cuda())
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-3, atol=1e-3)


def test_gpt_neo_scores_arc_and_checks_decode_where_the_engine_ran(tmp_path, monkeypatch):
    """GPT-Neo's ARC scores, non-finite rows and decode check with the outputs left on the GPU
    (batched_run's on_device, as the family's evaluation asks): the same as the same fp32 modules give
    on the CPU, and the outputs asked for on the device stay there."""
    from quantstudy import metrics as qm, steps_measure
    from quantstudy.families import gpt_neo_metrics

    from helpers import tiny_checkpoint

    fam = family("gpt_neo")
    arch = {**load_architecture("tiny-gpt-neo-125m"), "num_layers": 2, "attention_types": [[["global", "local"], 1]],
            "window_size": 8}
    checkpoint, setting = tiny_checkpoint(fam, arch, tmp_path), Setting("p12-c16", 1, {"prefill": 12, "cache": 16})

    def harness(device):
        modules = {g: fam.module(checkpoint, g, setting).to(device) for g in ("prefill", "decode")}
        engine = lambda m: (lambda inputs: m(**{k: v.to(device) for k, v in inputs.items()}))
        return steps_measure.batched_run({g: engine(m) for g, m in modules.items()}, setting.batch)

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 on both devices
    ids = torch.randint(0, 511, (4, 12), generator=torch.Generator().manual_seed(0))
    results = {}
    with torch.no_grad():
        for device, on_device in (("cpu", False), ("cuda", True)):
            run = harness(device)
            out = run({"input_ids": ids}, graph="prefill", on_device=on_device)
            assert out["logits"].is_cuda == on_device
            scores = [qm.continuation_loglik(out["logits"][r], ids[r], 6, 12) for r in range(4)]
            prompts = (ids[:2].clone(), torch.tensor([4, 9]))
            decode, nonfinite = gpt_neo_metrics.decode_check(run, *prompts, 12, 16, steps=8, tolerance=0.0)
            results[device] = (scores, gpt_neo_metrics.bad_rows(out), decode, nonfinite)
        assert not harness("cuda")({"input_ids": ids}, graph="prefill")["logits"].is_cuda
    (cpu_scores, cpu_bad, cpu_decode, cpu_nonfinite), (gpu_scores, gpu_bad, gpu_decode, gpu_nonfinite) = results.values()
    assert gpu_scores == pytest.approx(cpu_scores, rel=1e-4)
    assert gpu_bad == cpu_bad == 0 and gpu_nonfinite == cpu_nonfinite == {"bad": 0, "of": 2 + 2 * 11}
    assert gpu_decode["steps"] == cpu_decode["steps"] == 11 and gpu_decode["same_token"] == 11
