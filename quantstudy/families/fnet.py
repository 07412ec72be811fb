"""FNet (google/fnet-base, google/fnet-large) as a pooled-feature encoder.

Token mixing is built the way the family's engines build it: the real part of a 2D DFT as
fixed cosine / sine matrices, the sequence axis in fp32 and the hidden axis in the work
precision. Re(F_S X F_H) = C_S X C_H - S_S X S_H, computed as [C_S X, S_S X] @ [C_H; -S_H].
In fp16 the hidden-axis product can pass 65,504 at long windows; `hidden_scale` is the
1/64 probe: scale that GEMM's input down and its fp32 result back up.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from quantstudy.families import register

# Kernel groups of the write-up, in the order its table shows them. A kernel belongs to the
# group of the innermost annotated region it runs in (record_function on CPU), or on a GPU
# is matched by its name.
KERNEL_GROUPS = ["sequence-axis DFT", "other GEMMs", "FP8 feed-forward GEMMs", "other"]
REGIONS = {"fnet.sequence_dft": "sequence-axis DFT", "fnet.hidden_dft": "other GEMMs"}


def _dft_matrices(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(n, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(k, k).remainder(n) / n
    return torch.cos(angle), torch.sin(angle)


class FourierMixing(nn.Module):
    """Real part of the 2D DFT over (sequence, hidden) of a [batch, window, hidden] input."""

    def __init__(self, window: int, hidden_size: int):
        super().__init__()
        cs, ss = _dft_matrices(window)
        ch, sh = _dft_matrices(hidden_size)
        self.register_buffer("seq_cos", cs.float(), persistent=False)
        self.register_buffer("seq_sin", ss.float(), persistent=False)
        self.register_buffer("hidden_mat", torch.cat([ch, -sh], dim=0).float(), persistent=False)
        self.hidden_scale: float | None = None

    def _apply(self, fn, recurse=True):
        # The sequence-axis DFT is fp32 in every build: a dtype cast of the model must not round
        # its matrices, so they are made again in fp32 on whatever device the cast left them.
        super()._apply(fn, recurse)
        cs, ss = _dft_matrices(self.seq_cos.shape[0])
        self.seq_cos = cs.to(torch.float32).to(self.seq_cos.device)
        self.seq_sin = ss.to(torch.float32).to(self.seq_sin.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.dtype
        with record_function("fnet.sequence_dft"):
            xf = x.float()
            # The sequence-axis matrices stay fp32 whatever the model's dtype.
            mixed = torch.cat([torch.matmul(self.seq_cos.float(), xf), torch.matmul(self.seq_sin.float(), xf)], dim=-1)
        with record_function("fnet.hidden_dft"):
            if self.hidden_scale:
                mixed = mixed / self.hidden_scale
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
    """input ids -> last hidden states [batch, window, hidden] (the engine's output)."""

    def __init__(self, fnet: nn.Module):
        super().__init__()
        self.fnet = fnet

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        h = self.fnet.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        for layer in self.fnet.encoder.layer:
            h = layer.fourier(h)[0]
            h = layer.output(layer.intermediate(h), h)
        return h


@register("fnet")
class FNet:
    """Adapter: load, inputs, layer names, tiny checkpoints and kernel groups of FNet."""

    kernel_groups = KERNEL_GROUPS
    regions = REGIONS
    # GPU kernels that no recognised op launched (e.g. Triton GEMM templates), by name.
    kernel_patterns = [("FP8 feed-forward GEMMs", r"(e4m3|fp8|f8f8|qqtst)"),
                       ("other GEMMs", r"(gemm|hmma|xmma|cutlass|nvjet|triton_tem_.*mm)")]

    @staticmethod
    def kernel_group(region: str | None, name: str, device: str, op: dict[str, Any] | None = None,
                     window: int | None = None) -> str:
        """The write-up's kernel group of a profiled CPU op or GPU kernel.

        By region where the eager torch model marks one (record_function). Otherwise by the op
        (a GPU kernel: the op that launched it): torch._scaled_mm is an FP8 GEMM; a GEMM with a
        [window, window] operand (the sequence DFT matrices) is the sequence-axis DFT; other
        GEMMs are the hidden-axis DFT, the embedding projection and non-FP8 feed-forward layers.
        Compiled code and exported graphs (ONNX Runtime, TensorRT) keep no regions, hence the
        shapes.
        """
        import re

        from quantstudy.quantization import FP8_REGION
        from quantstudy.timing import FP8_GEMM_OPS, GEMM_OPS

        op_name = op["name"] if op else (name if device == "cpu" else None)
        if region == FP8_REGION or op_name in FP8_GEMM_OPS:
            return "FP8 feed-forward GEMMs"
        if region in REGIONS:
            return REGIONS[region]
        if op_name in GEMM_OPS:
            shapes = op["shapes"] if op else []
            square = window is not None and any(len(s) >= 2 and s[-2:] == [window, window] for s in shapes)
            return "sequence-axis DFT" if square else "other GEMMs"
        if device == "cpu":
            return "other"
        for group, pattern in FNet.kernel_patterns:
            if re.search(pattern, name, re.I):
                return group
        return "other"

    # --- configuration -------------------------------------------------------------------
    @staticmethod
    def hf_config(architecture: dict[str, Any]):
        from transformers import FNetConfig

        keys = {k: v for k, v in architecture.items() if k not in ("model_type", "source")}
        return FNetConfig(**keys)

    def linear_layer_names(self, architecture: dict[str, Any]) -> list[str]:
        from transformers import FNetForPreTraining

        with torch.device("meta"):
            model = FNetForPreTraining(self.hf_config(architecture))
        return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    # --- loading -------------------------------------------------------------------------
    @staticmethod
    def load_reference(checkpoint: str | Path) -> nn.Module:
        """Transformers FNetForPreTraining in fp32 (its own FFT mixing), the study's reference."""
        from transformers import FNetForPreTraining

        model = FNetForPreTraining.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
        return model.eval()

    @staticmethod
    def tokenizer(checkpoint: str | Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(checkpoint))

    def feature_model(self, checkpoint: str | Path, window: int, reference: nn.Module | None = None) -> FeatureEncoder:
        """The fp32 feature encoder with DFT-matrix mixing, from the checkpoint (or a loaded reference)."""
        ref = reference if reference is not None else self.load_reference(checkpoint)
        fnet = ref.fnet
        cfg = ref.config
        for layer in fnet.encoder.layer:
            block = FourierBlock(window, cfg.hidden_size, cfg.layer_norm_eps)
            block.output.LayerNorm.load_state_dict(layer.fourier.output.LayerNorm.state_dict())
            layer.fourier = block
        return FeatureEncoder(fnet).eval()

    @staticmethod
    def mlm_logits(reference: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """The PyTorch MLM head applied to (engine) features, in fp32."""
        return reference.cls.predictions(features.float())

    # --- inputs --------------------------------------------------------------------------
    @staticmethod
    def encode(tokenizer, texts: list[str], window: int) -> torch.Tensor:
        """[CLS] text [SEP] padded to the window, as the runtime pads."""
        enc = tokenizer(texts, truncation=True, max_length=window, padding="max_length", return_tensors="pt")
        return enc["input_ids"]

    @staticmethod
    def count_tokens(tokenizer, text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def stress_inputs(tokenizer, window: int, count: int, seed: int) -> dict[str, torch.Tensor]:
        """The write-up's stress inputs: random ids, a repeated token, all [MASK], [CLS][SEP]."""
        g = torch.Generator().manual_seed(seed)
        vocab = len(tokenizer)
        cls, sep, pad, mask = (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id,
                               tokenizer.mask_token_id)
        rows, names = [], []
        kinds = ["random ids", "repeated token", "all [MASK]", "[CLS][SEP]"]
        for i in range(count):
            kind = kinds[i % len(kinds)]
            body = window - 2
            if kind == "random ids":
                ids = torch.randint(5, vocab, (body,), generator=g)
            elif kind == "repeated token":
                ids = torch.full((body,), int(torch.randint(5, vocab, (1,), generator=g)))
            elif kind == "all [MASK]":
                ids = torch.full((body,), mask)
            else:
                ids = torch.full((0,), pad)
            row = torch.cat([torch.tensor([cls]), ids, torch.tensor([sep])])
            rows.append(F.pad(row, (0, window - len(row)), value=pad))
            names.append(kind)
        return {"input_ids": torch.stack(rows), "kinds": names}

    # --- measurements --------------------------------------------------------------------
    @staticmethod
    def mixing_peaks(reference: nn.Module, input_ids: torch.Tensor) -> list[float]:
        """Largest |2D Fourier output| per input row in the fp32 reference (the fp16 overflow risk)."""
        peaks = torch.zeros(input_ids.shape[0], device=input_ids.device)

        def hook(_m, _inp, out):
            peaks.copy_(torch.maximum(peaks, out[0].abs().flatten(1).amax(dim=1)))

        handles = [layer.fourier.self.register_forward_hook(hook) for layer in reference.fnet.encoder.layer]
        try:
            with torch.no_grad():
                reference(input_ids=input_ids)
        finally:
            for h in handles:
                h.remove()
        return peaks.tolist()

    # --- tiny checkpoints ----------------------------------------------------------------
    def tiny_checkpoint_files(self, architecture: dict[str, Any], tiny: dict[str, Any]) -> dict[str, bytes]:
        """A random-init FNetForPreTraining (fixed seed) with a word-level tokenizer, as checkpoint files.

        `mixing_input_offset` sets the embedding projection's bias: trained FNet's mixing input
        has a large common offset, which is what makes its 2D DFT pass the fp16 range at 512
        tokens; random init has none, so the tiny model gets one to show the same behaviour.
        """
        from safetensors.torch import save
        from transformers import FNetForPreTraining

        from quantstudy import fixtures

        torch.manual_seed(tiny["seed"])
        cfg = self.hf_config(architecture)
        model = FNetForPreTraining(cfg).eval()
        with torch.no_grad():
            model.fnet.embeddings.projection.bias.fill_(float(tiny.get("mixing_input_offset", 0.0)))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        # Tied weights are stored once, as transformers saves them.
        state.pop("cls.predictions.decoder.weight", None)
        state.pop("cls.predictions.decoder.bias", None)
        files = {"config.json": json.dumps(cfg.to_dict(), indent=1, sort_keys=True).encode(),
                 "model.safetensors": save(state, metadata={"format": "pt"})}
        files.update(fixtures.tokenizer_files(cfg.vocab_size, cfg.max_position_embeddings))
        return files
