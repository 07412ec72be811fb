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


def _static_cache(lm: nn.Module, cache: int, buffers: list[tuple[torch.Tensor, torch.Tensor]], start: torch.Tensor):
    """Transformers' StaticCache over the given (keys, values) buffers of each layer, writing from
    position `start`: what StaticLayer's lazy initialization would set up, without its CPU counter
    (a host-to-device copy, which a CUDA graph cannot capture)."""
    from transformers import StaticCache

    static = StaticCache(config=lm.config, max_cache_len=cache)
    for layer, (keys, values) in zip(static.layers, buffers, strict=True):
        layer.keys, layer.values = keys, values
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.cumulative_length = start.clone()  # update adds to it in place
        layer.is_initialized = True
    return static


def _outputs(logits: torch.Tensor, static) -> dict[str, torch.Tensor]:
    return {"logits": logits, **{f"present_{kind}_{i}": getattr(layer, f"{kind}s") for i, layer in
                                 enumerate(static.layers) for kind in ("key", "value")}}


class Prefill(nn.Module):
    def __init__(self, lm: nn.Module, cache: int):
        super().__init__()
        self.lm, self.cache = lm, cache

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.lm.config
        shape = (input_ids.shape[0], cfg.num_heads, self.cache, cfg.hidden_size // cfg.num_heads)
        zeros = lambda: torch.zeros(shape, dtype=self.lm.dtype, device=input_ids.device)
        static = _static_cache(self.lm, self.cache, [(zeros(), zeros()) for _ in range(cfg.num_layers)],
                               torch.zeros((), dtype=torch.int64, device=input_ids.device))
        return _outputs(self.lm(input_ids=input_ids, past_key_values=static, use_cache=True).logits, static)


class Decode(Prefill):
    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, **past: torch.Tensor) -> dict[str, torch.Tensor]:
        buffers = [(past[f"past_key_{i}"], past[f"past_value_{i}"]) for i in range(self.lm.config.num_layers)]
        static = _static_cache(self.lm, self.cache, buffers, position[0])
        logits = self.lm(input_ids=input_ids, past_key_values=static, position_ids=position[:, None],
                         use_cache=True).logits
        return _outputs(logits, static)


GRAPHS = {"prefill": Prefill, "decode": Decode}


def model(checkpoint, setting, variant, device, graph: str) -> nn.Module:
    from quantstudy import families

    from quantstudy.plain.fp8 import to_fp16_with_fp8_layers

    lm = families.get("gpt_neo").load_reference(checkpoint, torch.float32)
    cfg = lm.config
    if "local" in cfg.attention_layers and setting["cache"] > cfg.window_size:
        raise ValueError(f"plain gpt_neo: a cache of {setting['cache']} is longer than the local window "
                         f"{cfg.window_size}, where Transformers' static-cache GPT-Neo masks local layers wrongly")
    lm = to_fp16_with_fp8_layers(lm, variant.fp8, variant.dequantize_dtype, device)
    return GRAPHS[graph](lm, setting["cache"]).eval()
