"""FNet's graph module (`FeatureEncoder`) and its Fourier mixing, the way the family's engines build it.

Token mixing is built the way the family's engines build it: the real part of a 2D DFT as
fixed cosine / sine matrices, the sequence axis in fp32 and the hidden axis in the work
precision. Re(F_S X F_H) = C_S X C_H - S_S X S_H, computed as two GEMMs: [C_S; S_S] @ X (one
fp32 GEMM of the stacked [2S, S] matrix), its halves set side by side as [C_S X, S_S X], then
@ [C_H; -S_H] in the work precision.
In fp16 the hidden-axis product can pass 65,504 at long windows; `hidden_scale` is the
1/64 probe: scale that GEMM's input down and its fp32 result back up.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from quantstudy import quantization


def _dft_matrices(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(n, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(k, k).remainder(n) / n
    return torch.cos(angle), torch.sin(angle)


class FourierMixing(nn.Module):
    """Real part of the 2D DFT over (sequence, hidden) of a [batch, window, hidden] input."""

    def __init__(self, window: int, hidden_size: int):
        super().__init__()
        ch, sh = _dft_matrices(hidden_size)
        self.register_buffer("sequence_mat", self._sequence_mat(window), persistent=False)  # [2S, S]
        self.register_buffer("hidden_mat", torch.cat([ch, -sh], dim=0).float(), persistent=False)  # [2H, H]
        self.hidden_scale: float | None = None
        self.fp8_hidden_dft = False  # set by the fp8_hidden_dft transform

    @staticmethod
    def _sequence_mat(window: int) -> torch.Tensor:
        # One GEMM of the stacked matrix, not one per half: two GEMMs cost a fifth more at real size.
        cs, ss = _dft_matrices(window)
        return torch.cat([cs, ss], dim=0).float()

    def _apply(self, fn, recurse=True):
        # The sequence-axis DFT is fp32 in every build: a dtype cast of the model must not round
        # its matrix, so it is made again in fp32 on whatever device the cast left it.
        super()._apply(fn, recurse)
        self.sequence_mat = self._sequence_mat(self.sequence_mat.shape[1]).to(self.sequence_mat.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.dtype
        b, s, h = x.shape
        with record_function("fnet.sequence_dft"):
            stacked = torch.matmul(self.sequence_mat, x.float())  # [B, 2S, H]: C_S X over S_S X
            mixed = stacked.view(b, 2, s, h).transpose(1, 2).reshape(b, s, 2 * h)  # [B, S, 2H]: C_S X | S_S X
        with record_function("fnet.hidden_dft"):
            if self.hidden_scale:
                mixed = mixed / self.hidden_scale
            if self.fp8_hidden_dft:  # both operands through FP8: the DFT matrix's entries lie in [-1, 1]
                out = torch.matmul(quantization.fp8_round_trip(mixed.to(work)),
                                   quantization.fp8_round_trip(self.hidden_mat.to(work), quantization.UNIT_RANGE_SCALE))
            else:
                out = torch.matmul(mixed.to(work), self.hidden_mat.to(work))
            if self.hidden_scale:
                out = out.float() * self.hidden_scale
        return out


class MixingOutput(nn.Module):
    """LayerNorm(input + mixing), computed in the mixing's dtype (fp32 under the 1/64 probe)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, mixed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual.to(mixed.dtype) + mixed
        ln = self.LayerNorm
        return F.layer_norm(h, ln.normalized_shape, ln.weight.to(h.dtype), ln.bias.to(h.dtype), ln.eps).to(residual.dtype)


class FourierBlock(nn.Module):
    def __init__(self, window: int, hidden_size: int, eps: float):
        super().__init__()
        self.self = FourierMixing(window, hidden_size)
        self.output = MixingOutput(hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.output(self.self(hidden_states), hidden_states),)


class FeatureEncoder(nn.Module):
    """The engine's graph: input ids -> {"features": last hidden states [batch, window, hidden]}."""

    def __init__(self, fnet: nn.Module):
        super().__init__()
        self.fnet = fnet

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        token_type_ids = torch.zeros_like(input_ids)
        h = self.fnet.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        for layer in self.fnet.encoder.layer:
            h = layer.fourier(h)[0]
            h = layer.output(layer.intermediate(h), h)
        return {"features": h}


def fp8_hidden_dft(model: nn.Module, params: dict[str, Any]) -> dict[str, Any]:
    """The write-up's untried FP8 hidden-axis DFT: that GEMM with FP8 operands (fake quant), the mixed rows at
    their own amax / 448 (dynamic, per tensor), the cos / sin matrix at 1/448. The sequence-axis DFT stays fp32."""
    knobs = [m for m in model.modules() if isinstance(m, FourierMixing)]
    if not knobs:
        raise ValueError("fp8_hidden_dft: the model has no Fourier mixing")
    for m in knobs:
        m.fp8_hidden_dft = True
    return {"fp8_hidden_dft": "the hidden-axis DFT GEMM's operands through FP8: the rows at their own amax / 448, "
                              "the cos / sin matrix at 1/448"}


def hidden_scaling(model: nn.Module, params: dict[str, Any]) -> dict[str, Any]:
    """The 1/64 probe: scale the hidden-axis DFT's input down and its fp32 result back up."""
    factor = float(params["factor"])
    knobs = [m for m in model.modules() if isinstance(m, FourierMixing)]
    if not knobs:
        raise ValueError("hidden_scaling: the model has no Fourier mixing")
    for m in knobs:
        m.hidden_scale = factor
    return {"hidden_scale": factor}
