"""FP8 numerics and the layers a variant is made of: per-tensor, per-channel and per-token FP8 scales, the
quantize / dequantize round trip, FP8Linear (fake-quant, or a real FP8 GEMM where the GPU has one),
MicroscaledLinear (NVFP4 / MXFP8 by ModelOpt's QTensor), the call sites a family's graph module declares,
and the recipe's layers by name (linear_names, select).

A layer that a family's graph module also calls at a named site (`declare_call_sites`,
`linear_call`, e.g. attention projections also applied to relative position embeddings) is
quantized at every call, unless the recipe's `exclude_calls` (or the fp8 transform's, which
overrides it) names the site: those calls then run a plain linear on the work-precision weight.
The transforms that put these layers into a graph module are in transforms.py; ModelOpt's
calibration, which gives them their scales, in calibration.py.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from quantstudy.kernel_kinds import FP8_REGION  # the region an FP8 layer runs in, as profiles read it

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
DTYPES = {"float32": torch.float32, "float16": torch.float16}

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
