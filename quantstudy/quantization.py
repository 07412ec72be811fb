"""FP8 recipe: ModelOpt calibration, amax files and the variant transforms.

The only module that imports modelopt. A variant is a precision plus a list of transforms,
applied to a family's graph module. The generic ones:
  fp8             replace the recipe's linear layers by FP8Linear (static per-tensor scales);
                  `include` / `exclude` patterns narrow the recipe, `add` patterns extend it,
                  `keep_edge_blocks: N` keeps the layers of the first and last N blocks in the
                  work precision
  fp32_dequantize the FP8 layers dequantize to fp32 instead of the recipe's dtype
  widen_scales    activation scales widened by `factor` (amax x factor)
  microscaling    the recipe's layers (narrowed as fp8's are) fake-quantized to a block-scaled `format`,
                  nvfp4 or mxfp8 (MicroscaledLinear): quality anywhere, no speed before Blackwell
A family adds its own (FNet: `hidden_scaling`), as fn(model, params) -> summary entries.
A layer that a family's graph module also calls at a named site (`declare_call_sites`,
`linear_call`, e.g. attention projections also applied to relative position embeddings) is
quantized at every call, unless the recipe's `exclude_calls` (or the fp8 transform's, which
overrides it) names the site: those calls then run a plain linear on the work-precision weight.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import statistics
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from quantstudy.kernel_kinds import FP8_REGION  # the region an FP8 layer runs in, as profiles read it
from quantstudy.study import BLACKWELL, Target

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
DTYPES = {"float32": torch.float32, "float16": torch.float16}
TRANSFORMS = {"fp8", "fp32_dequantize", "widen_scales", "microscaling"}  # generic; families add their own

log = logging.getLogger(__name__)


def scale_from_amax(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor scale amax/448, rounded to the dtype the graph stores it in (fp16 Dequantize keeps fp16 scales).

    Clamped after the cast to the dtype's smallest positive value: an fp16 scale of an amax below
    about 1.3e-5 would round to zero, and Q/DQ scales must be positive (TensorRT's parser refuses 0).
    """
    scale = torch.tensor(max(amax, 1e-12) / FP8_MAX, dtype=torch.float32).to(dtype)
    smallest = torch.tensor(2.0 ** -24 if dtype == torch.float16 else torch.finfo(dtype).tiny, dtype=dtype)
    return torch.maximum(scale, smallest).to(torch.float32)


def channel_scales(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-output-channel weight scales, shape [out, 1]: each row's amax / 448 (scale_from_amax, row by row)."""
    amax = weight.detach().abs().amax(dim=1, keepdim=True).double().clamp_min(1e-12)
    scale = (amax / FP8_MAX).float().to(dtype)
    smallest = torch.tensor(2.0 ** -24 if dtype == torch.float16 else torch.finfo(dtype).tiny, dtype=dtype)
    return torch.maximum(scale, smallest).to(torch.float32)


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scales, shape [..., 1]: each row's amax / 448 at run time, in fp32
    (ModelOpt's FP8 per-channel-per-token config; torch._scaled_mm's row-wise scale_a)."""
    return (x.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """QuantizeLinear to float8_e4m3fn with saturation: round-to-nearest-even of x/scale, clamped to +-448."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DequantizeLinear: q * scale, produced in `dtype`."""
    return (q.to(torch.float32) * scale).to(dtype)


# A static scale for values within [-1, 1] (softmax outputs, a DFT matrix): 1 maps to E4M3's 448.
UNIT_RANGE_SCALE = 1.0 / FP8_MAX


def fp8_round_trip(x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """x through FP8 E4M3 and back, in x's dtype: at `scale`, or at x's own amax / 448 (a dynamic per-tensor
    scale, as for the operands of an FP8 attention or DFT matmul, which no calibration covers)."""
    # a given scale stays a Python float: a tensor made here would be a host-to-device copy, which CUDA-graph
    # capture refuses (seen on an H100)
    s = scale if scale is not None else x.detach().abs().amax().float().clamp_min(1e-12) / FP8_MAX
    return dequantize_fp8(quantize_fp8(x, s), s, x.dtype)


# What an `fp8_attention` family transform does (GPT-Neo, DeBERTa): the write-ups' untried FP8 attention.
FP8_ATTENTION = ("the attention matmuls' operands through FP8 (fake quant): queries, keys and values at their own "
                 "amax / 448 (dynamic, per tensor), the softmax output at 1/448")


def fp8_attention_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values of an FP8 attention (FP8_ATTENTION): each at its own amax."""
    return tuple(fp8_round_trip(t) for t in tensors)


def fp8_probabilities(probs: torch.Tensor) -> torch.Tensor:
    """An FP8 attention's softmax output, at the static UNIT_RANGE_SCALE."""
    return fp8_round_trip(probs, UNIT_RANGE_SCALE)


def fp8_gemm_supported(device: torch.device | str) -> bool:
    """Whether `device` runs real FP8 GEMMs (torch._scaled_mm): CUDA with compute capability 8.9+."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def declare_call_sites(layer: nn.Module, *sites: str) -> None:
    """Declare that a graph module also calls `layer` at these named sites, through `linear_call`.

    A recipe's `exclude_calls` may keep the calls at a site out of FP8; the plain calls,
    `layer(x)`, are quantized wherever the recipe selects the layer.
    """
    layer.call_sites = tuple(sorted({*getattr(layer, "call_sites", ()), *sites}))


def linear_call(layer: nn.Module, x: torch.Tensor, site: str) -> torch.Tensor:
    """`layer(x)` at a declared call site; an FP8 layer whose variant keeps this site out of FP8
    runs its work-precision linear instead. Any other layer (fp32, fp16, under calibration) is
    called as it is, so calibration sees every call."""
    if site not in getattr(layer, "call_sites", ()):
        raise ValueError(f"{site!r} is not a declared call site of this layer (quantization.declare_call_sites)")
    if site in getattr(layer, "unquantized_calls", ()):
        return layer.work_precision(x)
    return layer(x)


class WorkPrecisionLinear(nn.Module):
    """The calls of an FP8 layer that a variant keeps out of FP8: a plain linear on the
    work-precision weight. A child of its FP8 layer, so that ONNX node names
    (`<layer>.work_precision/MatMul`) and profiles keep it apart from the FP8 GEMM."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# Scale granularity (the fp8 transform's weight_scales / activation_scales): the recipe's per-tensor static
# scales, per-output-channel weight scales, dynamic per-token activation scales.
WEIGHT_SCALES = ("per_tensor", "per_channel")
ACTIVATION_SCALES = ("static", "per_token")


class FP8Linear(nn.Module):
    """activation -> Quantize -> Dequantize(dq) -> MatMul -> + bias, weight FP8 -> Dequantize(dq).

    By default the math is fake-quant through float8_e4m3fn casts (any device). After
    `use_fp8_gemm(model, device)` on a GPU with FP8 (sm_89+) the same math runs as one real FP8
    GEMM, torch._scaled_mm with the static per-tensor scales. The choice is a plain attribute
    set outside forward, so torch.compile sees a constant. Create the layer after the model's
    dtype cast: Module.to(dtype) would turn the FP8 weight into that dtype too.

    `call_sites` are the layer's declared extra call sites; at those in `unquantized_calls`,
    `linear_call` runs `work_precision` (the work-precision weight, no FP8) instead.
    """

    def __init__(self, weight_fp32: torch.Tensor, bias: torch.Tensor | None, input_amax: float,
                 weight_amax: float, dequantize_dtype: torch.dtype, work_dtype: torch.dtype,
                 call_sites: Iterable[str] = (), unquantized_calls: Iterable[str] = (),
                 weight_scales: str = "per_tensor", activation_scales: str = "static"):
        super().__init__()
        if weight_scales not in WEIGHT_SCALES or activation_scales not in ACTIVATION_SCALES:
            raise ValueError(f"scales: weight_scales is one of {', '.join(WEIGHT_SCALES)}, activation_scales one of "
                             f"{', '.join(ACTIVATION_SCALES)}; got {weight_scales!r} and {activation_scales!r}")
        self.in_features, self.out_features = weight_fp32.shape[1], weight_fp32.shape[0]
        self.dequantize_dtype = dequantize_dtype
        self.fp8_gemm = False
        self.weight_scales, self.activation_scales = weight_scales, activation_scales
        self.register_buffer("weight_scale", channel_scales(weight_fp32, dequantize_dtype) if weight_scales == "per_channel"
                             else scale_from_amax(weight_amax, dequantize_dtype))
        # per_token: no static scale, each row's at run time (token_scales)
        self.register_buffer("input_scale", scale_from_amax(input_amax, dequantize_dtype))
        self.register_buffer("weight", quantize_fp8(weight_fp32, self.weight_scale))
        self.bias = nn.Parameter(bias.detach().to(work_dtype)) if bias is not None else None
        self.call_sites = tuple(call_sites)
        self.unquantized_calls = frozenset(unquantized_calls)
        self.work_precision = (WorkPrecisionLinear(weight_fp32.to(work_dtype), self.bias)
                               if self.unquantized_calls else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function(FP8_REGION):
            return self._scaled_mm(x) if self.fp8_gemm else self._fake_quant(x)

    @property
    def row_wise(self) -> bool:
        """Whether its scales are per row (per-channel weights or per-token activations): a row-wise GEMM."""
        return (self.weight_scales, self.activation_scales) != ("per_tensor", "static")

    def _input_scale(self, x: torch.Tensor) -> torch.Tensor:
        return token_scales(x) if self.activation_scales == "per_token" else self.input_scale

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        # cuBLASLt FP8: A row-major [M, K], B column-major [K, N] (the [N, K] weight transposed,
        # no copy), K and N multiples of 16, fp32 scales; the bias must be in the output dtype
        # and fp16 or bf16, so an fp32 output (fp32_dequantize) adds it afterwards. Row-wise scales
        # (scale_a [M, 1], scale_b [1, N]) give a bf16 output, cast to the Dequantize dtype, bias after.
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        scale_a = self._input_scale(x2)
        xq = quantize_fp8(x2, scale_a).contiguous()
        if self.row_wise:
            scale_a = scale_a.expand(x2.shape[0], 1).contiguous()
            scale_b = self.weight_scale.reshape(1, -1).expand(1, self.out_features).contiguous()
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            out = out.to(self.dequantize_dtype)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.reshape(*shape[:-1], self.out_features).to(x.dtype)
        fused_bias = self.bias is not None and self.dequantize_dtype in (torch.float16, torch.bfloat16)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=scale_a, scale_b=self.weight_scale,
                               bias=self.bias.to(self.dequantize_dtype) if fused_bias else None,
                               out_dtype=self.dequantize_dtype)
        if self.bias is not None and not fused_bias:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._input_scale(x)
        xq = dequantize_fp8(quantize_fp8(x, scale), scale, self.dequantize_dtype)
        w = dequantize_fp8(self.weight, self.weight_scale, self.dequantize_dtype)
        b = None if self.bias is None else self.bias.to(self.dequantize_dtype)
        return F.linear(xq, w, b).to(x.dtype)

    def extra_repr(self) -> str:
        gemm = "torch._scaled_mm" if self.fp8_gemm else "fake-quant"
        return (f"in={self.in_features}, out={self.out_features}, dequantize={self.dequantize_dtype}, gemm={gemm}, "
                f"scales={self.weight_scales} weights, {self.activation_scales} activations")


# Block-scaled formats a variant's `microscaling` transform fakes (ModelOpt's QTensor formats): their block
# along the last axis.
MICROSCALING_BLOCK = {"nvfp4": 16, "mxfp8": 32}
E2M1_MAX = 6.0  # largest NVFP4 (E2M1) value


def microscaled(x: torch.Tensor, fmt: str, global_amax: float | None = None) -> torch.Tensor:
    """x quantized to a block-scaled format and back, in float32, by ModelOpt's QTensor (pure torch: any device):
    - nvfp4: E2M1 values in blocks of 16 along the last axis, an E4M3 scale per block, and a per-tensor fp32
      scale amax / (6 x 448), from `global_amax` (a calibrated activation amax) or else x's own;
    - mxfp8: E4M3 values in blocks of 32, a power-of-two (E8M0) scale per block, nothing calibrated."""
    from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor

    block = MICROSCALING_BLOCK.get(fmt)
    if block is None:
        raise ValueError(f"microscaling format {fmt!r} is not one of {', '.join(MICROSCALING_BLOCK)}")
    if x.shape[-1] % block:
        raise ValueError(f"{fmt} scales blocks of {block} along the last axis; this tensor's is {x.shape[-1]} long")
    x = x.float()
    if fmt == "mxfp8":
        q, scale = MXFP8QTensor.quantize(x)
        return q.dequantize(dtype=torch.float32, scale=scale)
    per_tensor = None if global_amax is None else torch.tensor(global_amax / (E2M1_MAX * FP8_MAX), device=x.device)
    q, scale, per_tensor = NVFP4QTensor.quantize(x, block, weights_scaling_factor_2=per_tensor)
    return q.dequantize(dtype=torch.float32, scale=scale, double_scale=per_tensor, block_sizes={-1: block})


class MicroscaledLinear(nn.Module):
    """activation and weight fake-quantized to a block-scaled format (`microscaled`), then a linear in the
    work precision: the quality of an NVFP4 or MXFP8 layer, on any device. The weight is quantized once
    here; the activation on every call, its NVFP4 per-tensor scale from the calibrated input amax (ModelOpt's
    NVFP4_DEFAULT_CFG calibrates it by max). No real block-scaled GEMM runs: speed needs a Blackwell GPU.
    Declared call sites as FP8Linear's: those in `unquantized_calls` run `work_precision` (linear_call)."""

    # ModelOpt's QTensor makes tensors on the host inside each call (MXFP8's exponent bounds), which CUDA-graph
    # capture refuses: a module holding one runs eagerly (backends.torch_backend.Runner reads this).
    cuda_graph_safe = False

    def __init__(self, weight_fp32: torch.Tensor, bias: torch.Tensor | None, fmt: str, input_amax: float,
                 work_dtype: torch.dtype, call_sites: Iterable[str] = (), unquantized_calls: Iterable[str] = ()):
        super().__init__()
        self.fmt, self.input_amax = fmt, float(input_amax)
        self.register_buffer("weight", microscaled(weight_fp32, fmt).to(work_dtype))
        self.bias = nn.Parameter(bias.detach().to(work_dtype)) if bias is not None else None
        self.call_sites = tuple(call_sites)
        self.unquantized_calls = frozenset(unquantized_calls)
        self.work_precision = (WorkPrecisionLinear(weight_fp32.to(work_dtype), self.bias)
                               if self.unquantized_calls else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = microscaled(x, self.fmt, self.input_amax if self.fmt == "nvfp4" else None).to(x.dtype)
        return F.linear(xq, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, format={self.fmt}, fake-quant"


def use_fp8_gemm(model: nn.Module, device: torch.device | str) -> list[str]:
    """Switch the model's FP8 layers to real FP8 GEMMs where `device` has them; returns their names.

    A layer whose shape cuBLASLt cannot take (K or N not a multiple of 16) stays fake-quant.
    """
    on = fp8_gemm_supported(device)
    names = []
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            m.fp8_gemm = on and m.in_features % 16 == 0 and m.out_features % 16 == 0
            if m.fp8_gemm:
                names.append(name)
    return names


def cast_inputs(inputs: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """A variant's inputs: floating tensors (an image, a KV cache) in its work precision, the rest as they are."""
    work = DTYPES[precision]
    return {k: v.to(work) if v.is_floating_point() else v for k, v in inputs.items()}


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def select(names: Iterable[str], include: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """Names matching any include pattern and no exclude pattern (fnmatch, on full module names)."""
    include, exclude = list(include), list(exclude)
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in include)
            and not any(fnmatch.fnmatchcase(n, p) for p in exclude)]


class NotApplicable(ValueError):
    """A calibration method that does not apply to FP8 layers (ModelOpt refuses or skips them): recorded as
    the calibration's failure, never replaced by another method."""


# ModelOpt's calibration methods for FP8 a variant may name (`calibration: {method: ..., <params>}`):
# - max: the largest |x| seen (FP8_DEFAULT_CFG's algorithm; the write-ups' method);
# - mse, local_hessian: ModelOpt's weight-scale searches (activations by max);
# - percentile, histogram_mse: activation amax from a histogram of |x| (percentile: `percentile`, default
#   99.99), weights by max;
# - entropy: the histogram's KL-optimal amax, which 0.47 computes for integer formats only;
# - smoothquant: per-channel smoothing with migration strength `alpha`, which 0.47 applies to int8 only.
CALIBRATION_METHODS = ("max", "mse", "local_hessian", "percentile", "histogram_mse", "entropy", "smoothquant")
HISTOGRAM_METHODS = {"percentile": "percentile", "histogram_mse": "mse", "entropy": "entropy"}


def calibrate(model: nn.Module, batches: list[dict[str, torch.Tensor]],
              progress: Callable[[int, int], None] | None = None,
              method: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """Static per-tensor amax of every linear layer's input and weight by a ModelOpt calibration method
    (CALIBRATION_METHODS; default max, FP8_DEFAULT_CFG's), for FP8. Raises NotApplicable for a method
    that 0.47 does not carry out on FP8 quantizers.

    Calibration collects statistics only, so calibrating all linears gives the recipe layers the
    same amax as enabling them alone; the recipe picks its layers from the result.
    """
    import copy

    import modelopt.torch.quantization as mtq

    spec = dict(method or {"method": "max"})
    name = spec.pop("method")
    if name not in CALIBRATION_METHODS:
        raise ValueError(f"calibration method {name!r} is not one of {', '.join(CALIBRATION_METHODS)}")

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                m(**batch)
                if progress:
                    progress(i + 1, len(batches))

    config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if name in HISTOGRAM_METHODS:
        _histogram_calibrate(model, config, forward_loop, HISTOGRAM_METHODS[name], spec)
    else:
        if name != "max":
            config["algorithm"] = {"method": name, **spec}
        mtq.quantize(model, config, forward_loop)
    if name == "smoothquant" and not any(getattr(m, "_amax_for_smoothing", None) is not None for m in model.modules()):
        raise NotApplicable("ModelOpt 0.47's smoothquant smooths int8 quantizers only: it skipped every FP8 layer "
                            "(\"Only int8 smoothing is supported\")")
    amax = {}
    for layer, module in model.named_modules():
        iq, wq = getattr(module, "input_quantizer", None), getattr(module, "weight_quantizer", None)
        if iq is None or wq is None or getattr(iq, "amax", None) is None or getattr(wq, "amax", None) is None:
            continue
        amax[layer] = {"input_amax": float(iq.amax.float().max()), "weight_amax": float(wq.amax.float().max())}
    return amax


def calibrate_method(model: nn.Module, batches: list[dict[str, torch.Tensor]], method: dict[str, Any],
                     progress: Callable[[int, int], None] | None = None
                     ) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """A variant's own method (`calibrate`) beside max calibration of the same module: its amax, and the
    layers whose input or weight amax it moved from max's. Raises NotApplicable where it moves none: 0.47's
    local_hessian, for one, calibrates no FP8 per-tensor weight, and a method that changes nothing is max."""
    import copy

    reference = calibrate(copy.deepcopy(model), batches)
    amax = calibrate(model, batches, progress, method)
    changed = {kind: sorted(n for n in amax if n in reference
                            and not math.isclose(amax[n][kind], reference[n][kind], rel_tol=1e-6))
               for kind in ("input_amax", "weight_amax")}
    if not any(changed.values()):
        raise NotApplicable(f"{method['method']} gives every layer max calibration's amax: ModelOpt 0.47 "
                            "calibrated nothing else with it on FP8 per-tensor quantizers")
    return amax, changed


def _histogram_calibrate(model: nn.Module, config: dict[str, Any], forward_loop: Callable[[nn.Module], None],
                         method: str, params: dict[str, Any]) -> None:
    """Activation amax from ModelOpt's histogram calibrator (`method`: percentile, mse or entropy), weights by
    max. 0.47's finish_stats_collection passes no method to a histogram calibrator but entropy's, so each
    quantizer loads its amax here, as that function does otherwise."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.model_calib import enable_stats_collection
    from modelopt.torch.quantization.nn import TensorQuantizer

    for entry in config["quant_cfg"]:
        if entry.get("quantizer_name") == "*input_quantizer":
            entry["cfg"] = {**entry["cfg"], "calibrator": "histogram"}
    config["algorithm"] = None  # quantizers inserted, nothing calibrated yet
    mtq.quantize(model, config, forward_loop=None)
    enable_stats_collection(model)
    forward_loop(model)
    for layer, quantizer in model.named_modules():
        if not isinstance(quantizer, TensorQuantizer) or quantizer._disabled:
            continue
        # an input's histogram calibrator by `method`; a weight's max calibrator as it is
        args, kwargs = ((method,), params) if layer.endswith("input_quantizer") else ((), {})
        try:  # as finish_stats_collection: a layer this graph never calls keeps no amax (not ModelOpt's NaN)
            if quantizer._calibrator.compute_amax(*args, **kwargs) is not None:
                quantizer.load_calib_amax(*args, **kwargs)
        except TypeError as e:  # the histogram's bins come from an integer num_bits; FP8's is (4, 3)
            raise NotApplicable(f"ModelOpt 0.47's histogram calibrator computes {method} for integer formats only: "
                                f"on FP8 (num_bits {quantizer.num_bits}) it raised {type(e).__name__}: {e}") from e
        quantizer.enable_quant()
        quantizer.disable_calib()


def outliers(amax: dict[str, dict[str, float]], layers: list[str], ratio: float) -> dict[str, Any]:
    """The outlier rule: a scale above `ratio` x the median of its kind (input or weight) stays fp16."""
    report: dict[str, Any] = {"ratio": ratio, "largest_ratio": {}, "layers": []}
    for kind in ("input_amax", "weight_amax"):
        values = [amax[n][kind] for n in layers]
        median = statistics.median(values) if values else 0.0
        ratios = {n: (amax[n][kind] / median if median > 0 else 0.0) for n in layers}
        report["largest_ratio"][kind] = max(ratios.values(), default=0.0)
        report["layers"] += [n for n, r in ratios.items() if r > ratio and n not in report["layers"]]
    return report


def _block_index(name: str) -> int | None:
    """The block a layer belongs to: the first numeric component of its name (`encoder.layer.3.…`)."""
    return next((int(p) for p in name.split(".") if p.isdigit()), None)


def fp8_layers(model_layers: list[str], recipe: dict[str, Any], params: dict[str, Any],
               outlier_layers: list[str]) -> list[str]:
    """The layers a variant's fp8 transform quantizes: recipe (or its own include) plus its `add`,
    minus excludes, edge blocks and outliers."""
    # `add`: patterns on top of the recipe's (or the variant's own `include`), without repeating them.
    chosen = select(model_layers, [*params.get("include", recipe["quantize"]), *params.get("add", [])],
                    params.get("exclude", []))
    edge = int(params.get("keep_edge_blocks", 0))
    if edge:
        blocks = sorted({b for b in map(_block_index, model_layers) if b is not None})
        kept = set(blocks[:edge] + blocks[-edge:])
        chosen = [n for n in chosen if _block_index(n) not in kept]
    return [n for n in chosen if n not in outlier_layers]


def transform_names(family_transforms: dict[str, Callable] | None = None) -> set[str]:
    return TRANSFORMS | set(family_transforms or {})


def _microscale(model: nn.Module, params: dict[str, Any], recipe: dict[str, Any], amax_doc: dict[str, Any] | None,
                work: torch.dtype, with_fp8: bool) -> dict[str, Any]:
    """The microscaling transform: the recipe's layers (fp8_layers, with the transform's include / exclude /
    add) replaced by MicroscaledLinear in `params["format"]`."""
    if with_fp8:
        raise ValueError("a variant quantizes its layers by fp8 or by microscaling, not both")
    if amax_doc is None:
        raise ValueError("the microscaling transform needs an amax file (NVFP4's per-tensor activation scale)")
    fmt = params.get("format")
    layers = fp8_layers(linear_names(model), recipe, params, amax_doc["outliers"]["layers"])
    if not layers:
        raise ValueError("the microscaling transform selects no layer")
    block = MICROSCALING_BLOCK.get(fmt)
    uneven = [f"{n} ({model.get_submodule(n).in_features})" for n in layers
              if block and model.get_submodule(n).in_features % block]
    if uneven:  # raised, so that the build records it as this variant's failure
        raise ValueError(f"{fmt} scales blocks of {block} along a layer's input width, which these layers' widths "
                         f"are no multiple of: {', '.join(uneven)}")
    # A layer's declared extra call sites (linear_call) are microscaled too, but for those the recipe (or the
    # transform) keeps out, as for its FP8 layers.
    excluded = set(params.get("exclude_calls", recipe.get("exclude_calls", [])))
    unquantized = {}
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        parent, old = model.get_submodule(parent_name), model.get_submodule(name)
        sites = tuple(getattr(old, "call_sites", ()))
        if excluded & set(sites):
            unquantized[name] = sorted(excluded & set(sites))
        setattr(parent, child, MicroscaledLinear(old.weight.detach().float(), old.bias, fmt,
                                                 amax_doc["amax"][name]["input_amax"], work, sites, excluded & set(sites)))
    return {"microscaled_layers": sorted(layers), "microscaling_format": fmt,
            **({"unquantized_calls": unquantized} if unquantized else {})}


def refuse_block_scaled_engine(spec: dict[str, Any], target: Target) -> None:
    """A microscaled variant on a Blackwell target, where it is timed (`timed: blackwell`): no backend builds
    an NVFP4 or MXFP8 engine yet, and MicroscaledLinear's fake-quant would be timed as one. Raised, so that
    the build records it; elsewhere the variant builds as fake-quant, for its quality."""
    formats = [next(iter(t.values())).get("format") for t in spec["transforms"] if "microscaling" in t]
    if formats and target.gpu.lower() in BLACKWELL:
        raise NotImplementedError(
            f"no backend implements an {' / '.join(f.upper() for f in formats)} engine yet: target {target.name} "
            f"({target.gpu}, {target.backend}) would time ModelOpt's fake-quant (block-scaled round trips and a "
            f"{spec['precision']} GEMM), not the block-scaled tensor-core GEMMs a Blackwell GPU runs")


def apply_variant(model: nn.Module, spec: dict[str, Any], recipe: dict[str, Any], amax_doc: dict[str, Any] | None,
                  family_transforms: dict[str, Callable[[nn.Module, dict], dict]] | None = None
                  ) -> tuple[nn.Module, dict[str, Any]]:
    """Turn an fp32 graph module into a variant (precision + transforms). Returns the model and a summary."""
    work = DTYPES[spec["precision"]]
    transforms = [(next(iter(t)), next(iter(t.values())) or {}) for t in spec["transforms"]]
    names = dict(transforms)
    family_transforms = family_transforms or {}
    unknown = sorted(set(names) - transform_names(family_transforms))
    if unknown:
        raise ValueError(f"unknown transform(s) {', '.join(unknown)}")
    summary: dict[str, Any] = {"precision": spec["precision"], "fp8_layers": []}
    fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    call_sites: dict[str, tuple[str, ...]] = {}
    excluded_calls: set[str] = set()
    if "fp8" in names:
        if amax_doc is None:
            raise ValueError("the fp8 transform needs an amax file")
        layers = fp8_layers(linear_names(model), recipe, names["fp8"], amax_doc["outliers"]["layers"])
        if not layers:
            raise ValueError("the fp8 transform selects no layer")
        modules = dict(model.named_modules())
        fp8_weights = {n: (modules[n].weight.detach().float().clone(),
                           None if modules[n].bias is None else modules[n].bias.detach().clone()) for n in layers}
        call_sites = {n: tuple(getattr(modules[n], "call_sites", ())) for n in layers}
        excluded_calls = set(names["fp8"].get("exclude_calls", recipe.get("exclude_calls", [])))
        declared = {s for m in modules.values() for s in getattr(m, "call_sites", ())}
        if excluded_calls - declared:
            raise ValueError(f"exclude_calls names {', '.join(sorted(excluded_calls - declared))}, which no layer "
                             f"declares; declared call sites: {', '.join(sorted(declared)) or 'none'}")
    if "microscaling" in names:  # from the fp32 weights, before the cast
        summary.update(_microscale(model, names["microscaling"], recipe, amax_doc, work, "fp8" in names))
    model = model.to(work)
    dequant = torch.float32 if "fp32_dequantize" in names else DTYPES[recipe["dequantize_dtype"]]
    fp8_params = names.get("fp8") or {}
    granularity = (fp8_params.get("weight_scales", "per_tensor"), fp8_params.get("activation_scales", "static"))
    if granularity != ("per_tensor", "static"):
        summary["fp8_scales"] = {"weights": granularity[0], "activations": granularity[1]}
    widen = float(names.get("widen_scales", {}).get("factor", 1.0))
    for name, (weight, bias) in fp8_weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        a = amax_doc["amax"][name]
        setattr(parent, child, FP8Linear(weight, bias, a["input_amax"] * widen, a["weight_amax"], dequant, work,
                                         call_sites[name], excluded_calls & set(call_sites[name]), *granularity))
    summary["fp8_layers"] = sorted(fp8_weights)
    unquantized = {n: sorted(excluded_calls & set(s)) for n, s in call_sites.items() if excluded_calls & set(s)}
    if unquantized:
        summary["unquantized_calls"] = unquantized
    summary["dequantize_dtype"] = str(dequant).removeprefix("torch.") if fp8_weights else None
    if "widen_scales" in names:
        summary["activation_scale_factor"] = widen
    for name, params in transforms:
        if name in family_transforms:
            summary.update(family_transforms[name](model, params))
    return model.eval(), summary
