"""Plain Deformable DETR: Transformers' DeformableDetrForObjectDetection forward as it is (its pixel
mask all ones, as for one unpadded image), in fp16, the recipe's layers FP8; the logits and boxes of
its last decoder layer. Transformers also runs the class and box heads of the five other decoder
layers (they feed only the training loss), which the project's engine leaves out."""

from __future__ import annotations

import torch
from torch import nn

EXTRA_TRANSFORMS: set[str] = set()
LAYER_PREFIX = "detr."  # the detector is `detr`; the project's engine holds its `model` and heads
GRAPHS = ("main",)


class Detector(nn.Module):
    def __init__(self, detr: nn.Module):
        super().__init__()
        self.detr = detr

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.detr(pixel_values=pixel_values)
        return {"logits": out.logits, "pred_boxes": out.pred_boxes}


def model(checkpoint, setting, variant, device, graph: str) -> nn.Module:
    from quantstudy import families

    from quantstudy.plain.fp8 import to_fp16_with_fp8_layers

    detr = families.get("deformable_detr").load_reference(checkpoint, torch.float32)
    return Detector(to_fp16_with_fp8_layers(detr, variant.fp8, variant.dequantize_dtype, device)).eval()
