"""timm XCiT's graph module (`Classifier`) and the timm model it is made from.

The graph module (`Classifier`) holds the timm model's own modules under timm's names
(`blocks.3.attn.qkv`, `cls_attn_blocks.1.attn.k`, `head`), so recipe patterns, amax files and
the timm reference name the same layers. Its forward is timm's Xcit.forward written out, so
that the attention cores and the convolutions are marked for profiles; the math is timm's
(the tests hold it to the timm model's own output).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

ATTENTION_REGION, CONV_REGION = "xcit.attention", "xcit.convolutions"


class Classifier(nn.Module):
    """pixel_values -> {"logits"}: a timm Xcit's modules, under timm's names, run as Xcit.forward
    runs them in eval mode (dropout and drop-path are identities there and are left out)."""

    def __init__(self, xcit: nn.Module):
        super().__init__()
        for name, child in xcit.named_children():
            self.add_module(name, child)
        self.pos_embed = xcit.pos_embed  # None (no child) where a config turns it off
        self.cls_token = xcit.cls_token
        self.global_pool = xcit.global_pool

    @staticmethod
    def _channel_attention(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """timm XCA: attention over channels, from l2-normalized q and k; fused (scaled dot-product
        attention) where timm's module is (`fused_attn`: timm's experimental flag, off by default)."""
        b, n, c = x.shape
        qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, c // attn.num_heads).permute(2, 0, 3, 4, 1)
        with record_function(ATTENTION_REGION):
            q, k, v = qkv.unbind(0)  # [batch, heads, channels per head, tokens]
            q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
            if attn.fused_attn:
                x = nn.functional.scaled_dot_product_attention(q * attn.temperature, k, v, scale=1.0)
            else:
                x = ((q @ k.transpose(-2, -1)) * attn.temperature).softmax(dim=-1) @ v
            x = x.permute(0, 3, 1, 2).reshape(b, n, c)
        return attn.proj(x)

    @staticmethod
    def _class_attention(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """timm ClassAttn: the class token attends to every token; the output is its row only. Fused
        (scaled dot-product attention) where timm's module is (`fused_attn`, on by default): on a
        GPU, a fused attention kernel in place of a scale, two batched GEMMs and a softmax."""
        b, n, c = x.shape
        h = attn.num_heads
        q = attn.q(x[:, 0]).reshape(b, h, 1, c // h)
        k = attn.k(x).reshape(b, n, h, c // h).permute(0, 2, 1, 3)
        v = attn.v(x).reshape(b, n, h, c // h).permute(0, 2, 1, 3)
        with record_function(ATTENTION_REGION):
            if attn.fused_attn:
                x_cls = nn.functional.scaled_dot_product_attention(q, k, v)
            else:
                x_cls = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
            x_cls = x_cls.transpose(1, 2).reshape(b, 1, c)
        return attn.proj(x_cls)

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        x, b = pixel_values, pixel_values.shape[0]
        with record_function(CONV_REGION):
            x, (hp, wp) = self.patch_embed(x)
            if self.pos_embed is not None:
                x = x + self.pos_embed(b, hp, wp).reshape(b, -1, x.shape[1]).permute(0, 2, 1)
        for blk in self.blocks:
            x = x + blk.gamma1 * self._channel_attention(blk.attn, blk.norm1(x))
            with record_function(CONV_REGION):
                x = x + blk.gamma3 * blk.local_mp(blk.norm3(x), hp, wp)
            x = x + blk.gamma2 * blk.mlp(blk.norm2(x))
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
        for blk in self.cls_attn_blocks:
            x_norm1 = blk.norm1(x)
            x = x + blk.gamma1 * torch.cat([self._class_attention(blk.attn, x_norm1), x_norm1[:, 1:]], dim=1)
            x = blk.norm2(x) if blk.tokens_norm else torch.cat([blk.norm2(x[:, 0:1]), x[:, 1:]], dim=1)
            # As timm (and the official XCiT): the residual adds the patch tokens to themselves too.
            x = x + torch.cat([blk.gamma2 * blk.mlp(x[:, 0:1]), x[:, 1:]], dim=1)
        x = self.norm(x)
        pooled = x[:, 1:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return {"logits": self.head(pooled)}


def timm_model(cfg: dict[str, Any]) -> nn.Module:
    """The timm model of a checkpoint config (config.json: architecture, num_classes, model_args), random init."""
    import timm

    return timm.create_model(cfg["architecture"], pretrained=False, num_classes=cfg["num_classes"],
                             global_pool=cfg.get("global_pool", "token"), **cfg.get("model_args", {}))
