"""Plain GPT-Neo: Transformers' GPTNeoForCausalLM forward as it is (eager attention: unscaled scores
and their softmax in fp32) over Transformers' StaticCache, in fp16, the recipe's layers FP8. Both
graphs take and give what the project's engines do:

- prefill: a fresh static cache of the setting's length, filled by the forward (zeros past the prompt);
- decode: a static cache whose buffers are the graph's past_* inputs; Transformers writes the new
  token's key and value into them in place at `position` (StaticLayer's index_copy_), so the
  present_* outputs are those buffers. A batch shares one position (Transformers' cache keeps one
  length), as the setting's example inputs do.

Exact only where no local layer's window is shorter than the cache: Transformers' GPT-Neo masks a
local layer by the band rows that end at the cache length, which is the query's own row only in a
full cache. gpt-neo-125m's window is 256, the study's cache 256; a setting past the window is refused.
"""

from __future__ import annotations

import torch
from torch import nn

EXTRA_TRANSFORMS: set[str] = set()
LAYER_PREFIX = "lm."  # the GPTNeoForCausalLM is `lm`; the project's graph module holds its children


def _presents(cache) -> dict[str, torch.Tensor]:
    return {f"present_{kind}_{i}": getattr(layer, f"{kind}s") for i, layer in enumerate(cache.layers)
            for kind in ("key", "value")}


class Prefill(nn.Module):
    def __init__(self, lm: nn.Module, cache: int):
        super().__init__()
        self.lm, self.cache = lm, cache

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers import StaticCache

        cache = StaticCache(config=self.lm.config, max_cache_len=self.cache)
        logits = self.lm(input_ids=input_ids, past_key_values=cache, use_cache=True).logits
        return {"logits": logits, **_presents(cache)}


class Decode(Prefill):
    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, **past: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers import StaticCache

        cache = StaticCache(config=self.lm.config, max_cache_len=self.cache)
        for i, layer in enumerate(cache.layers):
            # The past buffers as the cache's own (what StaticLayer's lazy initialization would allocate).
            layer.keys, layer.values = past[f"past_key_{i}"], past[f"past_value_{i}"]
            layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
            layer.cumulative_length = position[0].clone()  # where update writes; it adds to it in place
            layer.is_initialized = True
        logits = self.lm(input_ids=input_ids, past_key_values=cache, position_ids=position[:, None],
                         use_cache=True).logits
        return {"logits": logits, **_presents(cache)}


GRAPHS = {"prefill": Prefill, "decode": Decode}


def model(checkpoint, setting, variant, device, graph: str) -> nn.Module:
    from quantstudy import families

    from plain.fp8 import to_fp16_with_fp8_layers

    lm = families.get("gpt_neo").load_reference(checkpoint, torch.float32)
    cfg = lm.config
    if "local" in cfg.attention_layers and setting["cache"] > cfg.window_size:
        raise ValueError(f"plain gpt_neo: a cache of {setting['cache']} is longer than the local window "
                         f"{cfg.window_size}, where Transformers' static-cache GPT-Neo masks local layers wrongly")
    lm = to_fp16_with_fp8_layers(lm, variant.fp8, variant.dequantize_dtype, device)
    return GRAPHS[graph](lm, setting["cache"]).eval()
