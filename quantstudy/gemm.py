"""The recipe's GEMMs alone: fp16 against FP8 at a model's own shapes, on a target's backend.

What g of the Amdahl bound (bound.py) is measured from. Each distinct GEMM shape of a variant
(its input as the layer sees it, K, N, bias, Dequantize dtype) becomes a small graph module,
`GemmStack`: as many copies of the layer as the recipe runs at that shape, each on its own
input, so that a call holds the GEMMs of one forward and per-call overhead is spread as in the
model. The fp16 stack holds plain linears in the work precision; the FP8 stack holds the
recipe's own FP8Linear, so each backend runs what its FP8 engine runs: torch._scaled_mm on a GPU
with FP8, fake-quant (quantize, dequantize, then a matmul in the Dequantize dtype) on a CPU, the
exported Q/DQ graph on ONNX Runtime and TensorRT. Both stacks are built and opened by the
target's backend and timed side by side by timing.time_interleaved, like the engines.

g itself is a ratio of GEMM time, not of whole calls: each stack is profiled by the backend's
profiler, and its GEMMs' time is read from the profile's GEMM calls, as f is read from the
baseline's (timing.kernel_profile `gemms`). A whole call of the FP8 stack also holds a quantize
kernel per GEMM and the gaps between small kernels; in the model the quantize fuses into the
kernel before it, and f holds no gaps, so a ratio of whole calls would make g, and the bound,
too low (on the H200 at FNet's batch-1 shapes it put g near 1, and the bound below the measured x).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantstudy import backends, quantization
from quantstudy import timing as qt

# An FP8 GEMM among the ops or kernels a profiled FP8 stack ran (torch._scaled_mm; e4m3 kernels
# and TensorRT tactics). None found: the backend emulates FP8 (dequantize, then a wider GEMM).
FP8_GEMM = re.compile(r"_scaled_mm|e4m3|fp8|f8f8|qqtst", re.I)
DEFINITION = ("g = the fp16 time of a variant's FP8 GEMM calls over their FP8 time; each call at its own shape "
              "(its input as the layer sees it, K, N, bias) in a stack of that shape's GEMMs, fp16 linears against "
              "the recipe's FP8 layers, built and opened by the target's backend, timed side by side, and its GEMM "
              "time read from the backend's profile of each stack (the GEMM calls, as f reads the baseline's)")
PROFILED_CALLS = 10  # calls of each stack in the profile its GEMM time is read from


class GemmStack(nn.Module):
    """Graph module `forward(x0, x1, ...) -> {y0, y1, ...}`: layer i applied to input i."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"y{i}": layer(inputs[f"x{i}"]) for i, layer in enumerate(self.layers)}


def recipe_calls(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Every FP8 GEMM call of a variant module on these inputs, in order: its layer, the input's
    shape as the layer sees it, dims [M, K, N] (M: the input's rows), bias and Dequantize dtype.
    Calls a variant keeps out of FP8 (`exclude_calls`) run the layer's work-precision child, not
    the FP8 layer, and are not counted."""
    calls: list[dict[str, Any]] = []

    def hook(module, args, name):
        x = args[0]
        calls.append({"layer": name, "input_shape": list(x.shape),
                      "dims": [math.prod(x.shape[:-1]), module.in_features, module.out_features],
                      "bias": module.bias is not None,
                      "dequantize_dtype": str(module.dequantize_dtype).removeprefix("torch."),
                      **({"scales": [module.weight_scales, module.activation_scales]} if module.row_wise else {})})

    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: hook(m, args, name))
             for name, m in model.named_modules() if isinstance(m, quantization.FP8Linear)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return calls


def shape_key(call: dict[str, Any]) -> str:
    """The name of a call's GEMM shape in gemm.json, e.g. `1x128x64 @ 64x256 +bias -> float16`."""
    m, k, n = call["dims"]
    scales = f" ({' weights, '.join(call['scales'])} activations)" if call.get("scales") else ""
    return (f"{'x'.join(map(str, call['input_shape']))} @ {k}x{n}{' +bias' if call['bias'] else ''}"
            f" -> {call['dequantize_dtype']}{scales}")


def _stack(shapes: list[tuple[dict[str, Any], int, str]], precision: str, seed: int) -> tuple[GemmStack, dict]:
    """The fp16 or FP8 stack of some shapes ((call, copies, work precision) each, their layers in that
    order) and its example inputs, the same for the same seed: a torch engine is opened into a second,
    identical stack, and export changes the one it gets."""
    gen = torch.Generator().manual_seed(seed)
    layers, inputs = [], {}
    for call, copies, work in shapes:
        _, k, n = call["dims"]
        work_dtype = quantization.DTYPES[work]
        for _ in range(copies):
            weight = torch.randn(n, k, generator=gen) / math.sqrt(k)
            bias = torch.randn(n, generator=gen) * 0.1 if call["bias"] else None
            x = torch.randn(*call["input_shape"], generator=gen)
            inputs[f"x{len(layers)}"] = x.to(work_dtype)
            if precision == "fp8":
                layers.append(quantization.FP8Linear(weight, bias, float(x.abs().max()), float(weight.abs().max()),
                                                     quantization.DTYPES[call["dequantize_dtype"]], work_dtype,
                                                     *([(), (), *call["scales"]] if call.get("scales") else [])))
            else:
                linear = nn.Linear(k, n, bias=bias is not None)
                with torch.no_grad():
                    linear.weight.copy_(weight)
                    if bias is not None:
                        linear.bias.copy_(bias)
                layers.append(linear.to(work_dtype))
    return GemmStack(layers).eval(), inputs


def _engines(shapes: list[tuple[dict[str, Any], int, str]], precision: str, target, folder: Path,
             seed: int) -> list:
    """One runner per shape, built and opened by the target's backend as the build and time steps do.
    A module backend runs the stack uncompiled: a GEMM alone gains nothing from torch.compile (it
    calls the same cuBLAS GEMM and torch._scaled_mm), and this job compiles nothing.
    A backend that builds from ONNX gets one export of all the shapes, cut into a graph per shape
    (onnx.utils.extract_model keeps the exported nodes as they are): an export costs seconds, a cut
    milliseconds."""
    from quantstudy import export

    backend = backends.get(target.backend)
    if backend.builds_from == "module":
        target = dataclasses.replace(target, compile=False)
        runners = []
        for i, shape in enumerate(shapes):
            module, example = _stack([shape], precision, seed)
            backend.build(module, folder / f"shape{i}", target, backends.Shapes((example,)))
            runners.append(backend.open(folder / f"shape{i}", example, target, _stack([shape], precision, seed)[0]))
        return runners
    import onnx.utils

    module, example = _stack(shapes, precision, seed)
    whole = export.export(module, example, folder / "onnx")["onnx"]
    runners, first = [], 0
    for i, (_, copies, _) in enumerate(shapes):
        names = range(first, first + copies)
        first += copies
        cut = folder / f"shape{i}" / "onnx" / export.ONNX_FILE
        cut.parent.mkdir(parents=True)
        onnx.utils.extract_model(whole, str(cut), [f"x{j}" for j in names], [f"y{j}" for j in names])
        cut_example = {f"x{j}": example[f"x{j}"] for j in names}
        backend.build(cut, folder / f"shape{i}" / "engine", target, backends.Shapes((cut_example,)))
        runners.append(backend.open(folder / f"shape{i}" / "engine", cut_example, target))
    return runners


def _profile(backend: backends.Backend, runner: backends.Runner) -> dict[str, Any]:
    """The backend's profile of PROFILED_CALLS calls of a stack, every op or kernel its own group."""
    return backend.profile(runner, PROFILED_CALLS, lambda region, name, device, op: name, {quantization.FP8_REGION})


def _gemm_ms(profile: dict[str, Any], copies: int, stack: str) -> float:
    """Per GEMM: the time of the profile's GEMM calls (ms per call of the stack) over the stack's copies."""
    count = sum(e["count"] for e in profile["gemms"])
    ms = sum(e["ms"] for e in profile["gemms"])
    if count < copies or ms <= 0:
        raise ValueError(f"the {stack} stack's profile holds {count:g} GEMM calls ({ms:g} ms) of its {copies}: "
                         f"its GEMM time cannot be read from it")
    return ms / copies


def time_shapes(shapes: list[tuple[dict[str, Any], int, str]], target, timing: dict[str, int],
                seed: int = 0, log=None, spans: list | None = None) -> list[dict[str, Any]]:
    """fp16 against FP8 at each GEMM shape ((call, copies, work precision): `copies` GEMMs a call),
    timed side by side on the target's backend (per-call summaries) and profiled: per-GEMM time of
    each stack's GEMM calls, their ratio g, and what ran the FP8 GEMM (`fp8_gemm`: the op or kernel;
    None where the backend emulates FP8)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="quantstudy-gemm-") as tmp:
        with qt.device_lock(target.device, shared=True):  # building is CPU work: not while another job measures
            engines = {p: _engines(shapes, p, target, Path(tmp) / p, seed) for p in ("fp16", "fp8")}
        measured = []
        with qt.measuring(target.device) as span:  # one turn for every shape: other jobs do not start between them
            for i, (call, _, _) in enumerate(shapes):
                runners = {p: engines[p][i] for p in engines}
                # rounds of one call: a stack of `copies` GEMMs is a call long enough (min_round_ms is the engines')
                result = qt.time_interleaved(runners, timing["warmup"], timing["rounds"], timing["calls_per_round"],
                                             (lambda line: log(f"{shape_key(call)}: {line}")) if log else None)
                measured.append((result, {p: _profile(backends.get(target.backend), r) for p, r in runners.items()}))
        if spans is not None:  # when the stacks were measured (a gemm.json's `measuring`)
            spans.append(span)
        for i, ((call, copies, work), (result, profiles)) in enumerate(zip(shapes, measured)):
            runners = {p: engines[p][i] for p in engines}
            # What the FP8 stack ran: its ops or kernels by name, with ms per call (top 8).
            ran = [{"name": n, "ms": ms} for n, ms in
                   sorted(profiles["fp8"]["groups_ms"].items(), key=lambda kv: -kv[1])[:8]]
            if runners["fp8"].fp8_gemm is not None:  # the runner knows which of its layers run _scaled_mm
                fp8_gemm = "torch._scaled_mm" if runners["fp8"].fp8_gemm else None
            else:
                fp8_gemm = next((r["name"] for r in ran if FP8_GEMM.search(r["name"])), None)
            fp16_ms, fp8_ms = (_gemm_ms(profiles[p], copies, p) for p in ("fp16", "fp8"))
            results.append({"input_shape": call["input_shape"], "dims": call["dims"], "bias": call["bias"],
                            "dequantize_dtype": call["dequantize_dtype"], "work_precision": work, "copies": copies,
                            "fp16_ms": result["fp16"], "fp8_ms": result["fp8"], "fp16_gemm_ms": fp16_ms,
                            "fp8_gemm_ms": fp8_ms, "g": fp16_ms / fp8_ms, "fp8_gemm": fp8_gemm,
                            "emulated": fp8_gemm is None, "fp8_ran": ran,
                            "gemm_profile": {p: {"calls": PROFILED_CALLS, "gemms": profiles[p]["gemms"]} for p in profiles}})
    return results


def time_calls(calls_by_variant: dict[str, list[dict[str, Any]]], work: dict[str, str], target,
               timing: dict[str, int], log=None, spans: list | None = None) -> dict[str, dict[str, Any]]:
    """{shape key: time_shapes(...)} over the distinct shapes of several variants' calls; a shape's
    copies are the most calls any one variant makes at it. `work`: each variant's precision; `spans`:
    where to record when the stacks were measured."""
    shapes: dict[str, tuple[dict[str, Any], int, str]] = {}
    for variant, calls in calls_by_variant.items():
        counts: dict[str, int] = {}
        for c in calls:
            counts[shape_key(c)] = counts.get(shape_key(c), 0) + 1
        for key, n in counts.items():
            first = next(c for c in calls if shape_key(c) == key)
            if key in shapes and shapes[key][2] != work[variant]:
                raise ValueError(f"GEMM shape {key} runs in {shapes[key][2]} and {work[variant]} in two variants")
            shapes[key] = (first, max(n, shapes.get(key, (None, 0))[1]), work[variant])
    return dict(zip(shapes, time_shapes(list(shapes.values()), target, timing, log=log, spans=spans))) if shapes else {}
