"""DeBERTa-v2/v3's graph module (`FeatureEncoder`): the static-window token-feature encoder.

The graph module runs the Transformers modules (embeddings, projections, layer norms,
feed-forward) and restates DisentangledSelfAttention's forward, the same ops in the same order,
with two changes:
- the relative positions (log buckets) of the static window are computed once, a buffer of
  one bucket per offset i - j that the forward indexes: Transformers builds them in every
  forward, with a CPU tensor inside make_log_bucket_position that breaks CUDA-graph capture of
  an eager forward; the attention scale is a 0-dim buffer for the same reason;
- with share_att_key, query_proj and key_proj also project the relative position embeddings.
  Those calls are the declared call site `relative_positions` (quantization.linear_call), so a
  recipe's `exclude_calls: [relative_positions]` keeps the positional products in the work
  precision while the hidden rows go through FP8.
Dropout is left out: the module is for inference only.
"""

from __future__ import annotations

import torch
from torch import nn

from quantstudy import quantization

POSITIONS = "relative_positions"  # call site of query_proj / key_proj on the relative position embeddings


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, rows, hidden] -> [batch * heads, rows, head size] (DisentangledSelfAttention.transpose_for_scores)."""
    x = x.view(*x.size()[:-1], heads, -1)
    return x.permute(0, 2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))


class RelativeAttention(nn.Module):
    """DisentangledSelfAttention (relative attention, share_att_key) on a static window: the same math,
    with the projections of the relative position embeddings at their own call site.

    Takes over the Transformers module's projections, so the layer names stay
    `...attention.self.query_proj` etc.
    """

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.query_proj, self.key_proj, self.value_proj = attn.query_proj, attn.key_proj, attn.value_proj
        self.heads = attn.num_attention_heads
        self.pos_att_type = list(attn.pos_att_type)
        self.att_span = attn.pos_ebd_size
        factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        # scaled_size_sqrt's value, made once: a buffer cast with the model, not a CPU tensor per call.
        self.register_buffer("scale", torch.sqrt(torch.tensor(attn.attention_head_size, dtype=torch.float) * factor),
                             persistent=False)
        for proj in (self.query_proj, self.key_proj):
            quantization.declare_call_sites(proj, POSITIONS)
        self.fp8_attention = False  # set by the fp8_attention transform (quantization.FP8_ATTENTION)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, output_attentions: bool = False,
                query_states: torch.Tensor | None = None, relative_pos: torch.Tensor | None = None,
                rel_embeddings: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        if output_attentions or query_states is not None:
            raise ValueError("the graph module computes features only (no attentions, no query_states)")
        heads = self.heads
        query = _heads(self.query_proj(hidden_states), heads)
        key = _heads(self.key_proj(hidden_states), heads)
        value = _heads(self.value_proj(hidden_states), heads)
        if self.fp8_attention:
            query, key, value = quantization.fp8_attention_operands(query, key, value)
        scale = self.scale.to(query.dtype)
        scores = torch.bmm(query, key.transpose(-1, -2) / scale)
        scores = scores + self._relative_scores(query, key, relative_pos, rel_embeddings, scale)
        scores = scores.view(-1, heads, scores.size(-2), scores.size(-1))
        scores = scores.masked_fill(~attention_mask.bool(), torch.finfo(query.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        if self.fp8_attention:
            probs = quantization.fp8_probabilities(probs)
        context = torch.bmm(probs.view(-1, probs.size(-2), probs.size(-1)), value)
        context = context.view(-1, heads, context.size(-2), context.size(-1)).permute(0, 2, 1, 3).contiguous()
        return context.view(*context.size()[:-2], -1), None

    def _relative_scores(self, query: torch.Tensor, key: torch.Tensor, relative_pos: torch.Tensor,
                         rel_embeddings: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | int:
        """disentangled_attention_bias: content->position (c2p) and position->content (p2c) scores."""
        span, heads, batch = self.att_span, self.heads, query.size(0) // self.heads
        rel = rel_embeddings[0:span * 2, :].unsqueeze(0)
        pos_query = _heads(quantization.linear_call(self.query_proj, rel, POSITIONS), heads).repeat(batch, 1, 1)
        pos_key = _heads(quantization.linear_call(self.key_proj, rel, POSITIONS), heads).repeat(batch, 1, 1)
        if self.fp8_attention:  # the position products are attention matmuls too
            pos_query, pos_key = quantization.fp8_attention_operands(pos_query, pos_key)
        relative_pos = relative_pos.unsqueeze(1)
        score = 0
        if "c2p" in self.pos_att_type:
            c2p = torch.bmm(query, pos_key.transpose(-1, -2))
            c2p_pos = torch.clamp(relative_pos + span, 0, span * 2 - 1)
            index = c2p_pos.squeeze(0).expand([query.size(0), query.size(1), relative_pos.size(-1)])
            score = score + torch.gather(c2p, dim=-1, index=index) / scale
        if "p2c" in self.pos_att_type:
            p2c_pos = torch.clamp(-relative_pos + span, 0, span * 2 - 1)
            p2c = torch.bmm(key, pos_query.transpose(-1, -2))
            index = p2c_pos.squeeze(0).expand([query.size(0), key.size(-2), key.size(-2)])
            score = score + torch.gather(p2c, dim=-1, index=index).transpose(-1, -2) / scale
        return score


class FeatureEncoder(nn.Module):
    """input_ids, attention_mask [batch, window] -> {"features": last hidden states [batch, window, hidden]}."""

    def __init__(self, deberta: nn.Module, window: int):
        super().__init__()
        from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

        cfg, encoder = deberta.config, deberta.encoder
        unsupported = [what for what, bad in [
            ("relative_attention false", not cfg.relative_attention), ("share_att_key false", not cfg.share_att_key),
            ("a convolution layer (conv_kernel_size)", getattr(cfg, "conv_kernel_size", 0) > 0)] if bad]
        if unsupported:
            raise ValueError(f"the DeBERTa graph module is built for DeBERTa-v3; this config has "
                             f"{', '.join(unsupported)}")
        self.deberta = deberta
        for layer in encoder.layer:
            layer.attention.self = RelativeAttention(layer.attention.self)
        # The log-bucketed relative positions of the static window, with Transformers' own function.
        # They depend on i - j only: the buffer is one bucket per offset, [2 window - 1], from which
        # the forward indexes the [window, window] matrix, so that a compiled attention computes
        # the gather indices in its softmax kernel instead of reading an int64 matrix per head.
        anchor = torch.empty(window, 0)
        matrix = build_relative_position(anchor, anchor, bucket_size=encoder.position_buckets,
                                         max_position=encoder.max_relative_positions)[0]
        by_offset = torch.cat([matrix[0].flip(0), matrix[1:, 0]])  # offsets -(window - 1) .. window - 1
        if matrix.device.type != "meta" and not torch.equal(by_offset[_offsets(window, matrix.device)], matrix):
            raise AssertionError("the relative positions of this window are not a function of i - j")
        self.register_buffer("bucket_by_offset", by_offset, persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        window = (self.bucket_by_offset.shape[0] + 1) // 2
        if input_ids.shape[-1] != window:
            raise ValueError(f"this graph module is built for a window of {window} tokens, not {input_ids.shape[-1]}")
        encoder = self.deberta.encoder
        h = self.deberta.embeddings(input_ids=input_ids, mask=attention_mask)
        mask = encoder.get_attention_mask(attention_mask)
        rel_embeddings = encoder.get_rel_embedding()
        relative_pos = self.bucket_by_offset[_offsets(window, input_ids.device)].unsqueeze(0)  # [1, window, window]
        for layer in encoder.layer:
            h = layer(h, mask, relative_pos=relative_pos, rel_embeddings=rel_embeddings)[0]
        return {"features": h}


def _offsets(window: int, device: torch.device) -> torch.Tensor:
    """[window, window] int64: i - j + window - 1, the index of query i and key j's offset."""
    positions = torch.arange(window, device=device)
    return positions[:, None] - positions[None, :] + (window - 1)


def fp8_attention(model: nn.Module, params: dict) -> dict:
    """The fp8_attention transform: every layer's attention matmuls, content and position products, with FP8
    operands (quantization.FP8_ATTENTION)."""
    layers = [m for m in model.modules() if isinstance(m, RelativeAttention)]
    if not layers:
        raise ValueError("fp8_attention: the model has no DeBERTa relative attention")
    for m in layers:
        m.fp8_attention = True
    return {"fp8_attention": quantization.FP8_ATTENTION + "; the relative-position products too"}
