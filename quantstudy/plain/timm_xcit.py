"""Plain XCiT: the timm model as it is (timm's forward: forward_features + forward_head; timm's
class attention through F.scaled_dot_product_attention where timm enables it), in fp16, the
recipe's layers FP8."""

from __future__ import annotations

import torch
from torch import nn

EXTRA_TRANSFORMS: set[str] = set()
LAYER_PREFIX = "xcit."  # the project's graph module holds timm's modules at its top level


class Classifier(nn.Module):
    def __init__(self, xcit: nn.Module):
        super().__init__()
        self.xcit = xcit

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.xcit(pixel_values)}


GRAPHS = ("main",)


def model(checkpoint, setting, variant, device, graph: str) -> nn.Module:
    from quantstudy import families

    from quantstudy.plain.fp8 import to_fp16_with_fp8_layers

    # The project's graph module holds timm's modules under timm's names: the same layer names here.
    xcit = families.get("timm_xcit").load_reference(checkpoint, torch.float32)
    return Classifier(to_fp16_with_fp8_layers(xcit, variant.fp8, variant.dequantize_dtype, device)).eval()
