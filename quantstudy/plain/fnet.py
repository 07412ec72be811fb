"""Plain FNet: Transformers' FNetModel (no pooler), in fp16, with its Fourier block replaced.

The block: the sequence-axis DFT in fp32 as one GEMM of the stacked [cos; sin] matrix
([2S, S] @ [S, H]), its two halves side by side ([S, 2H]: C X | S X), then the hidden-axis DFT in
fp16 as one GEMM with [cos; -sin] ([2H, H]): Re(F_S X F_H) = C X C_H - S X S_H. Then HF's
LayerNorm(input + mixing), in the mixing's dtype. With the variant's hidden scaling (the 1/64
probe), the hidden GEMM's input is divided by the factor and its fp32 result multiplied back, so
that the LayerNorm runs in fp32. The recipe's feed-forward layers are FP8 (plain.fp8).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

EXTRA_TRANSFORMS = {"hidden_scaling"}
LAYER_PREFIX = ""  # Encoder holds FNetModel as `fnet`, as the project's graph module does


def _cos_sin(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of 2 pi j k / n, in fp32 (from float64 angles, j k reduced mod n first)."""
    k = torch.arange(n, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(k, k).remainder(n) / n
    return torch.cos(angle).float(), torch.sin(angle).float()


class FourierBlock(nn.Module):
    def __init__(self, hf_block: nn.Module, window: int, hidden: int, hidden_scale: float | None):
        super().__init__()
        cs, ss = _cos_sin(window)
        ch, sh = _cos_sin(hidden)
        self.register_buffer("sequence", torch.cat([cs, ss]))  # [2S, S], stays fp32
        self.register_buffer("hidden", torch.cat([ch, -sh]).half())  # [2H, H]
        self.window, self.hidden_scale = window, hidden_scale
        self.LayerNorm = hf_block.output.LayerNorm

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        b, s, h = x.shape
        y = torch.matmul(self.sequence, x.float())  # [B, 2S, H]: C X over S X
        y = y.view(b, 2, s, h).transpose(1, 2).reshape(b, s, 2 * h)  # [B, S, 2H]: C X | S X
        if self.hidden_scale:
            y = y / self.hidden_scale
        mixed = torch.matmul(y.half(), self.hidden)
        if self.hidden_scale:
            mixed = mixed.float() * self.hidden_scale
        z = x.to(mixed.dtype) + mixed
        ln = self.LayerNorm
        return (F.layer_norm(z, ln.normalized_shape, ln.weight.to(z.dtype), ln.bias.to(z.dtype), ln.eps).to(x.dtype),)

    def _apply(self, fn, recurse=True):
        # The sequence-axis matrix is fp32 in every build: the model's fp16 cast must not round it.
        sequence = self.sequence
        super()._apply(fn, recurse)
        self.sequence = sequence.to(self.sequence.device)
        return self


class Encoder(nn.Module):
    """input_ids -> {"features"}; the FNetModel is `fnet`, as in the project's graph module, so that
    layers have the same names in both."""

    def __init__(self, fnet: nn.Module):
        super().__init__()
        self.fnet = fnet

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"features": self.fnet(input_ids=input_ids).last_hidden_state}


GRAPHS = ("main",)


def model(checkpoint, setting, variant, device, graph: str) -> nn.Module:
    from quantstudy import families

    from quantstudy.plain.fp8 import to_fp16_with_fp8_layers

    fnet = families.get("fnet").load_reference(checkpoint, torch.float32).fnet
    fnet.pooler = None  # the engines output the last hidden states; the pooler is not part of them
    scale = variant.params.get("hidden_scaling", {}).get("factor")
    for layer in fnet.encoder.layer:
        layer.fourier = FourierBlock(layer.fourier, setting["window"], fnet.config.hidden_size, scale)
    encoder = Encoder(fnet)
    return to_fp16_with_fp8_layers(encoder, variant.fp8, variant.dequantize_dtype, device)
