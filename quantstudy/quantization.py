"""FP8 recipe: ModelOpt calibration, amax files and the variant transforms.

The only module that imports modelopt. A variant is a precision plus a list of transforms,
applied in order to a family's feature model:
  fp8             replace the recipe's linear layers by FP8Linear (static per-tensor scales)
  fp32_dequantize the FP8 layers dequantize to fp32 instead of the recipe's dtype
  hidden_scaling  set `hidden_scale` on every module that has one (FNet's 1/64 probe)
"""

from __future__ import annotations

import fnmatch
import logging
import statistics
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
DTYPES = {"float32": torch.float32, "float16": torch.float16}
FP8_REGION = "quantstudy.fp8_gemm"  # profiler region of an FP8 layer (quantize + GEMM)
TRANSFORMS = {"fp8", "fp32_dequantize", "hidden_scaling"}

log = logging.getLogger(__name__)


def scale_from_amax(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor scale amax/448, rounded to the dtype the graph stores it in (fp16 Dequantize keeps fp16 scales)."""
    return torch.tensor(max(amax, 1e-12) / FP8_MAX, dtype=torch.float32).to(dtype).to(torch.float32)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """QuantizeLinear to float8_e4m3fn with saturation: round-to-nearest-even of x/scale, clamped to +-448."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DequantizeLinear: q * scale, produced in `dtype`."""
    return (q.to(torch.float32) * scale).to(dtype)


def fp8_gemm_supported(device: torch.device | str) -> bool:
    """Whether `device` runs real FP8 GEMMs (torch._scaled_mm): CUDA with compute capability 8.9+."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    """activation -> Quantize -> Dequantize(dq) -> MatMul -> + bias, weight FP8 -> Dequantize(dq).

    By default the math is fake-quant through float8_e4m3fn casts (any device). After
    `use_fp8_gemm(model, device)` on a GPU with FP8 (sm_89+) the same math runs as one real FP8
    GEMM, torch._scaled_mm with the static per-tensor scales. The choice is a plain attribute
    set outside forward, so torch.compile sees a constant. Create the layer after the model's
    dtype cast: Module.to(dtype) would turn the FP8 weight into that dtype too.
    """

    def __init__(self, weight_fp32: torch.Tensor, bias: torch.Tensor | None, input_amax: float,
                 weight_amax: float, dequantize_dtype: torch.dtype, work_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = weight_fp32.shape[1], weight_fp32.shape[0]
        self.dequantize_dtype = dequantize_dtype
        self.fp8_gemm = False
        self.register_buffer("weight_scale", scale_from_amax(weight_amax, dequantize_dtype))
        self.register_buffer("input_scale", scale_from_amax(input_amax, dequantize_dtype))
        self.register_buffer("weight", quantize_fp8(weight_fp32, self.weight_scale))
        self.bias = nn.Parameter(bias.detach().to(work_dtype)) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function(FP8_REGION):
            return self._scaled_mm(x) if self.fp8_gemm else self._fake_quant(x)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        # cuBLASLt FP8: A row-major [M, K], B column-major [K, N] (the [N, K] weight transposed,
        # no copy), K and N multiples of 16, fp32 scales; the bias must be in the output dtype
        # and fp16 or bf16, so an fp32 output (fp32_dequantize) adds it afterwards.
        shape = x.shape
        xq = quantize_fp8(x.reshape(-1, self.in_features), self.input_scale).contiguous()
        fused_bias = self.bias is not None and self.dequantize_dtype in (torch.float16, torch.bfloat16)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                               bias=self.bias.to(self.dequantize_dtype) if fused_bias else None,
                               out_dtype=self.dequantize_dtype)
        if self.bias is not None and not fused_bias:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        xq = dequantize_fp8(quantize_fp8(x, self.input_scale), self.input_scale, self.dequantize_dtype)
        w = dequantize_fp8(self.weight, self.weight_scale, self.dequantize_dtype)
        b = None if self.bias is None else self.bias.to(self.dequantize_dtype)
        return F.linear(xq, w, b).to(x.dtype)

    def extra_repr(self) -> str:
        gemm = "torch._scaled_mm" if self.fp8_gemm else "fake-quant"
        return f"in={self.in_features}, out={self.out_features}, dequantize={self.dequantize_dtype}, gemm={gemm}"


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


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def select(names: Iterable[str], include: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """Names matching any include pattern and no exclude pattern (fnmatch, on full module names)."""
    include, exclude = list(include), list(exclude)
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in include)
            and not any(fnmatch.fnmatchcase(n, p) for p in exclude)]


def calibrate(model: nn.Module, batches: list[dict[str, torch.Tensor]],
              progress: Callable[[int, int], None] | None = None) -> dict[str, dict[str, float]]:
    """Static per-tensor amax of every linear layer's input and weight: ModelOpt FP8_DEFAULT_CFG, max.

    Calibration collects statistics only, so calibrating all linears gives the recipe layers the
    same amax as enabling them alone; the recipe picks its layers from the result.
    """
    import modelopt.torch.quantization as mtq

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                m(**batch)
                if progress:
                    progress(i + 1, len(batches))

    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)
    amax = {}
    for name, module in model.named_modules():
        iq, wq = getattr(module, "input_quantizer", None), getattr(module, "weight_quantizer", None)
        if iq is None or wq is None or getattr(iq, "amax", None) is None or getattr(wq, "amax", None) is None:
            continue
        amax[name] = {"input_amax": float(iq.amax.float().max()), "weight_amax": float(wq.amax.float().max())}
    return amax


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


def fp8_layers(model_layers: list[str], recipe: dict[str, Any], params: dict[str, Any],
               outlier_layers: list[str]) -> list[str]:
    """The layers a variant's fp8 transform quantizes: recipe (or its own include) minus excludes and outliers."""
    chosen = select(model_layers, params.get("include", recipe["quantize"]), params.get("exclude", []))
    return [n for n in chosen if n not in outlier_layers]


def apply_variant(model: nn.Module, spec: dict[str, Any], recipe: dict[str, Any],
                  amax_doc: dict[str, Any] | None) -> tuple[nn.Module, dict[str, Any]]:
    """Turn an fp32 feature model into a variant (precision + transforms). Returns the model and a summary."""
    work = DTYPES[spec["precision"]]
    transforms = [(next(iter(t)), next(iter(t.values())) or {}) for t in spec["transforms"]]
    names = dict(transforms)
    summary: dict[str, Any] = {"precision": spec["precision"], "fp8_layers": [], "hidden_scale": None}
    fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    if "fp8" in names:
        if amax_doc is None:
            raise ValueError("the fp8 transform needs an amax file")
        layers = fp8_layers(linear_names(model), recipe, names["fp8"], amax_doc["outliers"]["layers"])
        if not layers:
            raise ValueError("the fp8 transform selects no layer")
        modules = dict(model.named_modules())
        fp8_weights = {n: (modules[n].weight.detach().float().clone(),
                           None if modules[n].bias is None else modules[n].bias.detach().clone()) for n in layers}
    model = model.to(work)
    dequant = torch.float32 if "fp32_dequantize" in names else DTYPES[recipe["dequantize_dtype"]]
    for name, (weight, bias) in fp8_weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        a = amax_doc["amax"][name]
        setattr(parent, child, FP8Linear(weight, bias, a["input_amax"], a["weight_amax"], dequant, work))
    summary["fp8_layers"] = sorted(fp8_weights)
    summary["dequantize_dtype"] = str(dequant).removeprefix("torch.") if fp8_weights else None
    if "hidden_scaling" in names:
        factor = float(names["hidden_scaling"]["factor"])
        knobs = [m for m in model.modules() if hasattr(m, "hidden_scale")]
        if not knobs:
            raise ValueError("hidden_scaling: the model has no module with a hidden_scale")
        for m in knobs:
            m.hidden_scale = factor
        summary["hidden_scale"] = factor
    return model.eval(), summary
