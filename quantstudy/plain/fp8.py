"""A minimal FP8 linear layer with static per-tensor scales, and the swap of a model's layers for it.

On a GPU with FP8 (sm_89+) the layer is one torch._scaled_mm: the activation quantized to
float8_e4m3fn at its calibrated scale, the weight stored in float8_e4m3fn at amax / 448, fp32
accumulation, the bias added in the GEMM, an fp16 result. Elsewhere (the CPU) it computes the
same rounding as the project's CPU path does (fake-quant): quantize, dequantize to fp16, fp16
linear, so that the two implementations' outputs can be compared there too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantstudy.quantization import FP8_MAX, scale_from_amax

FP8 = torch.float8_e4m3fn


class FP8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_amax: float, weight_amax: float,
                 out_dtype: torch.dtype, scaled_mm: bool):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.out_dtype, self.scaled_mm = out_dtype, scaled_mm
        # The recipe's scales as the engines store them (amax / 448, rounded to the dequantize dtype).
        self.register_buffer("input_scale", scale_from_amax(input_amax, out_dtype))
        self.register_buffer("weight_scale", scale_from_amax(weight_amax, out_dtype))
        self.register_buffer("weight", (weight.float() / self.weight_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = (x.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if self.scaled_mm:
            # cuBLASLt: A row-major [M, K], B column-major (the [N, K] weight transposed, no copy).
            out = torch._scaled_mm(q.reshape(-1, self.in_features).contiguous(), self.weight.t(), scale_a=self.input_scale,
                                   scale_b=self.weight_scale, bias=self.bias, out_dtype=self.out_dtype)
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        xd = (q.float() * self.input_scale).to(self.out_dtype)
        wd = (self.weight.float() * self.weight_scale).to(self.out_dtype)
        return F.linear(xd, wd, self.bias).to(x.dtype)


def fp8_gemm_on(device: torch.device | str) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def to_fp16_with_fp8_layers(model: nn.Module, layers: dict[str, dict[str, Any]], dequantize_dtype: str,
                            device: torch.device | str) -> nn.Module:
    """Cast an fp32 model to fp16 and put FP8Linear in place of `layers` ({name in the model: amax}),
    each made from its fp32 weight (quantizing the fp16-rounded weight would round twice).

    A layer cuBLASLt cannot take (K or N not a multiple of 16: tiny models only) keeps the CPU path,
    as the project's engines keep it.
    """
    modules = dict(model.named_modules())
    missing = sorted(n for n in layers if not isinstance(modules.get(n), nn.Linear))
    if missing:
        raise ValueError(f"the plain model has no linear layer named {missing[:3]} ({len(missing)} missing)")
    fp32 = {n: (modules[n].weight.detach().float().clone(),
                None if modules[n].bias is None else modules[n].bias.detach().float().clone()) for n in layers}
    model = model.half()  # before the swap: a dtype cast would turn the FP8 weights into fp16
    on_gpu = fp8_gemm_on(device)
    for name, (weight, bias) in fp32.items():
        parent, _, child = name.rpartition(".")
        gemm = on_gpu and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
        setattr(model.get_submodule(parent), child,
                FP8Linear(weight, bias, layers[name]["input_amax"], layers[name]["weight_amax"],
                          getattr(torch, dequantize_dtype), gemm))
    return model.to(device).eval()
