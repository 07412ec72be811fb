"""Plain DeBERTa-v3: Transformers' DebertaV2Model as it is, in fp16, the recipe's projections FP8.

Its forward is Transformers' own (relative positions built in every call, attention as
DisentangledSelfAttention computes it). Where the recipe keeps the relative position embeddings'
products in the work precision (`exclude_calls: [relative_positions]`), the attention takes
Transformers' unshared path (share_att_key off: pos_key_proj and pos_query_proj project the
embeddings), given fp16 copies of key_proj and query_proj: the same products, in fp16, while the
FP8 layers take the hidden rows.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

EXTRA_TRANSFORMS: set[str] = set()
LAYER_PREFIX = ""  # Encoder holds DebertaV2Model as `deberta`, as the project's graph module does
POSITIONS = "relative_positions"  # the project's call site of query_proj / key_proj on the embeddings


class Encoder(nn.Module):
    """input_ids, attention_mask -> {"features"}; the DebertaV2Model is `deberta`, as in the project's
    graph module, so that layers have the same names in both."""

    def __init__(self, deberta: nn.Module):
        super().__init__()
        self.deberta = deberta

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"features": self.deberta(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state}


GRAPHS = ("main",)


def model(checkpoint, setting, variant, device, graph: str) -> nn.Module:
    from quantstudy import families

    from quantstudy.plain.fp8 import to_fp16_with_fp8_layers

    encoder = Encoder(families.get("deberta_v2").load_reference(checkpoint, torch.float32))
    positional = {n for n, sites in variant.unquantized_calls.items() if POSITIONS in sites}
    for i, layer in enumerate(encoder.deberta.encoder.layer):
        att = layer.attention.self
        names = {f"deberta.encoder.layer.{i}.attention.self.{p}" for p in ("query_proj", "key_proj")}
        if not names & positional:
            continue
        if names - positional:
            raise ValueError(f"the plain model keeps both or neither of {sorted(names)}' positional calls "
                             f"out of FP8, not one")
        att.pos_key_proj, att.pos_query_proj = copy.deepcopy(att.key_proj), copy.deepcopy(att.query_proj)
        att.share_att_key = False
    return to_fp16_with_fp8_layers(encoder, variant.fp8, variant.dequantize_dtype, device)
