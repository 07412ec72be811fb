"""GPT-Neo's graph modules: `Prefill` and `Decode`, Transformers' layers over a static KV cache.

What the two engines compute, and why every shape is static, is in the family's adapter
(quantstudy.families.gpt_neo); this module holds the modules that compute it, the attention mask
of a local or a global layer, and how one graph's caches feed the next decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from quantstudy import quantization

ATTENTION_REGION = "gpt_neo.attention"


def _allowed(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys a query sees: causal, and in a local layer only the last `window` positions."""
    ok = key_pos <= query_pos
    if window is not None:
        ok = ok & (query_pos - key_pos < window)
    return ok


class StaticCacheDecoder(nn.Module):
    """GPTNeoForCausalLM's layers over a static KV cache: the math both engines share.

    Holds Transformers' `transformer` and `lm_head` as they are (their names are the recipe's);
    attention is computed here, from the attention modules' projections.
    """

    def __init__(self, model: nn.Module, cache: int):
        super().__init__()
        cfg = model.config
        if cache > cfg.max_position_embeddings:
            raise ValueError(f"gpt_neo: a cache of {cache} is longer than the model's "
                             f"{cfg.max_position_embeddings} positions")
        self.transformer, self.lm_head = model.transformer, model.lm_head
        self.cache, self.heads = cache, cfg.num_heads
        # None: global attention; an int: a local layer's window.
        self.windows = [cfg.window_size if t == "local" else None for t in cfg.attention_layers]
        for block in self.transformer.h:
            # Transformers' [positions, positions] mask buffers: the masks are made from positions here.
            del block.attn.attention.bias
        self.fp8_attention = False  # set by the fp8_attention transform (quantization.FP8_ATTENTION)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, -1).transpose(1, 2)  # [batch, heads, seq, head_dim]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        if self.fp8_attention:
            q, k, v = quantization.fp8_attention_operands(q, k, v)
        # Unscaled scores and their softmax in fp32 (as Transformers): fp16 would overflow.
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2))
        scores = torch.where(allowed, scores, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.fp8_attention:
            probs = quantization.fp8_probabilities(probs)
        out = torch.matmul(probs, v)
        b, _, s, _ = out.shape
        return out.transpose(1, 2).reshape(b, s, -1)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor],
             update) -> dict[str, torch.Tensor]:
        """Embeddings, blocks, final norm and lm_head. `update(i, k, v)` of layer i's new keys and
        values -> (keys, values) to attend to, and (present key, present value) to output."""
        t = self.transformer
        h = t.wte(input_ids) + t.wpe(positions)
        caches: dict[str, torch.Tensor] = {}
        for i, block in enumerate(t.h):
            attn = block.attn.attention
            x = block.ln_1(h)
            q, k, v = self._heads(attn.q_proj(x)), self._heads(attn.k_proj(x)), self._heads(attn.v_proj(x))
            with record_function(ATTENTION_REGION):
                keys, values, caches[f"present_key_{i}"], caches[f"present_value_{i}"] = update(i, k, v)
                a = self._attend(q, keys, values, masks[i])
            h = h + attn.out_proj(a)
            h = h + block.mlp(block.ln_2(h))
        return {"logits": self.lm_head(t.ln_f(h)), **caches}


class Prefill(StaticCacheDecoder):
    """input_ids [batch, n] (n <= cache; the engine's n is the setting's prefill) -> logits and the
    prompt's keys and values in zeroed static caches."""

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        n = input_ids.shape[1]
        positions = torch.arange(n, device=input_ids.device)
        query, key = positions[:, None], positions[None, :]
        masks = [_allowed(query, key, w) for w in self.windows]
        pad = (0, 0, 0, self.cache - n)  # the sequence axis, up to the cache length

        def update(_i, k, v):
            # Attend to the prompt's own keys; the cache is the same rows, zero-padded.
            return k, v, F.pad(k, pad), F.pad(v, pad)
        return self._run(input_ids, positions[None, :], masks, update)


class Decode(StaticCacheDecoder):
    """One new token at `position` over static caches: logits and the caches with its key and value."""

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, **past: torch.Tensor) -> dict[str, torch.Tensor]:
        b = input_ids.shape[0]
        key = torch.arange(self.cache, device=input_ids.device)
        query = position.view(b, 1, 1, 1)
        masks = [_allowed(query, key, w) for w in self.windows]  # [batch, 1, 1, cache]

        def update(i, k, v):
            # Write the new row at `position` of the fixed buffer (a copy in eager torch; an engine
            # may alias the output to its input buffer).
            index = position.view(b, 1, 1, 1).expand(b, k.shape[1], 1, k.shape[3])
            keys = past[f"past_key_{i}"].scatter(2, index, k)
            values = past[f"past_value_{i}"].scatter(2, index, v)
            return keys, values, keys, values
        return self._run(input_ids, position[:, None], masks, update)


GRAPHS = {"prefill": Prefill, "decode": Decode}


def fp8_attention(model: nn.Module, params: dict) -> dict:
    """The fp8_attention transform: every layer's attention matmuls with FP8 operands (quantization.FP8_ATTENTION)."""
    if not isinstance(model, StaticCacheDecoder):
        raise ValueError("fp8_attention: the model is not GPT-Neo's graph module")
    model.fp8_attention = True
    return {"fp8_attention": quantization.FP8_ATTENTION}


def as_past(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A graph's present_* outputs as the next decode's past_* inputs."""
    return {k.replace("present_", "past_"): v for k, v in outputs.items() if k.startswith("present_")}
