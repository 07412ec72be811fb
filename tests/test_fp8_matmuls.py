"""The write-ups' untried FP8 matmuls, as family transforms: GPT-Neo's and DeBERTa's attention
(`fp8_attention`), FNet's hidden-axis DFT (`fp8_hidden_dft`).

Each tiny graph module runs under a torch function mode that records the operands of every matmul;
those of the transformed matmuls must lie on E4M3's grid at their scale (their own amax / 448, or
1/448 for softmax outputs and the DFT matrix), checked against the grid itself, not the code that rounds.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from quantstudy import config, families
from quantstudy.families.base import Setting

from helpers import tiny_checkpoint

# Every finite E4M3 magnitude, from the dtype itself.
E4M3 = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3 = torch.unique(E4M3[torch.isfinite(E4M3)])


def on_e4m3_grid(t: torch.Tensor, scale: float | None = None) -> bool:
    """Whether every value of `t` is an E4M3 value times `scale` (default: t's amax / 448), to fp32 rounding."""
    t = t.detach().double()
    scale = scale if scale is not None else float(t.abs().max()) / 448
    q = (t / scale).abs().flatten()
    nearest = E4M3[torch.searchsorted(E4M3, q).clamp(max=len(E4M3) - 1)]
    below = E4M3[(torch.searchsorted(E4M3, q) - 1).clamp(min=0)]
    gap = torch.minimum((q - nearest).abs(), (q - below).abs())
    return bool((gap <= 1e-5 * q.clamp(min=1e-3)).all())


class Matmuls(TorchFunctionMode):
    """Records (name, operands) of every torch.matmul and torch.bmm call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.Tensor, torch.Tensor]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.bmm, torch.Tensor.matmul):
            self.calls.append((func.__name__, (args[0], args[1])))
        return func(*args, **(kwargs or {}))


def _module(family: str, architecture, setting: Setting, graph: str, tmp_path, transforms):
    fam = families.get(family)
    tmp_path.mkdir(parents=True, exist_ok=True)
    ckpt = tiny_checkpoint(fam, architecture, tmp_path)
    model = fam.module(ckpt, graph, setting).float().eval()
    for name in transforms:
        fam.transforms()[name](model, {})
    return model, fam.example_inputs(ckpt, graph, setting)


def _record(model, inputs) -> Matmuls:
    with torch.no_grad(), Matmuls() as mode:
        model(**inputs)
    return mode


def test_gpt_neo_fp8_attention_puts_q_k_v_and_probabilities_on_the_fp8_grid(tmp_path):
    setting = Setting("p12-c16", 1, {"prefill": 12, "cache": 16})
    arch = {**config.load_architecture("tiny-gpt-neo-125m"), "num_layers": 2, "attention_types": [[["global", "local"], 1]]}
    model, inputs = _module("gpt_neo", arch, setting, "prefill", tmp_path, ["fp8_attention"])
    calls = _record(model, inputs).calls
    assert len(calls) == 2 * 2  # per layer: scores (q k^T), then probabilities times values
    for i in range(0, len(calls), 2):
        (_, (q, kt)), (_, (probs, v)) = calls[i], calls[i + 1]
        assert on_e4m3_grid(q) and on_e4m3_grid(kt) and on_e4m3_grid(v)
        assert on_e4m3_grid(probs, 1 / 448)
    plain, _ = _module("gpt_neo", arch, setting, "prefill", tmp_path / "plain", [])
    (_, (q, _)) = _record(plain, inputs).calls[0]
    assert not on_e4m3_grid(q)  # without the transform, the operands are not rounded


def test_deberta_fp8_attention_rounds_the_content_and_position_products(tmp_path):
    setting = Setting("b2-w24", 2, {"window": 24})
    model, inputs = _module("deberta_v2", "tiny-deberta-v3-base", setting, "main", tmp_path, ["fp8_attention"])
    calls = _record(model, inputs).calls
    layers = len(model.deberta.encoder.layer)
    # per layer: q k^T, c2p (q pos_k^T), p2c (k pos_q^T), probabilities times values
    assert [name for name, _ in calls] == ["bmm"] * 4 * layers
    for i in range(0, len(calls), 4):
        for _, (a, b) in calls[i:i + 3]:
            assert on_e4m3_grid(a) and on_e4m3_grid(b)
        probs, v = calls[i + 3][1]
        assert on_e4m3_grid(probs, 1 / 448) and on_e4m3_grid(v)


def test_fnet_fp8_hidden_dft_rounds_that_gemm_and_leaves_the_sequence_dft_in_fp32(tmp_path):
    setting = Setting("w128", 1, {"window": 128})
    model, inputs = _module("fnet", "tiny-fnet-base", setting, "main", tmp_path, ["fp8_hidden_dft"])
    calls = _record(model, inputs).calls
    assert len(calls) % 2 == 0
    for i in range(0, len(calls), 2):
        (_, (_, x)), (_, (mixed, hidden_mat)) = calls[i], calls[i + 1]
        assert not on_e4m3_grid(x)  # the sequence-axis DFT: fp32, untouched
        assert on_e4m3_grid(mixed) and on_e4m3_grid(hidden_mat, 1 / 448)

