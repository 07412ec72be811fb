"""The Deformable DETR detector engine (`DetectorEngine`): the module the family's one graph runs.

`DetectorEngine` runs the Transformers modules (backbone, input projections, position
embedding, encoder and decoder layers) as DeformableDetrForObjectDetection runs them, with
three differences that keep the math (the first two make the graph exportable with dynamic sizes,
the third keeps its compiled attention fast):
- it builds the encoder's inputs itself: the level shapes as a tensor made from the symbolic
  sizes, and the encoder's reference points as `(arange(h) + 0.5) / h` (bit-equal to
  Transformers' `linspace(0.5, h - 0.5, h) / h`). Transformers' `torch.as_tensor(spatial_shapes_list)`
  and `linspace` over a symbolic size make torch.export specialize height and width to the
  example's;
- the decoder's reference points depend on the weights only, so they are computed once and
  kept as a buffer (an engine builder folds them too), and only the last decoder layer's
  heads run (the others only feed the training loss). The graph then holds exactly the
  write-up's 100 linears: 6 x 6 in the encoder, 6 x 10 in the decoder, the class head and the
  three box-head layers;
- the deformable attention (Transformers' `MultiScaleDeformableAttention`, in the encoder and
  the decoder) is `WeightedStackAttention`: the same products and the same sum, each level's
  samples weighted before the levels are stacked. Compiled, Transformers' order let inductor
  pull part of the bilinear sampling into the sum's kernel in some graphs and not others: the
  project's engine ran 5% slower than Transformers' model at 800 x 800 and 25% faster at
  800 x 1067 on an H200 (results/h200-torch-vs-plain/, results/h200-detr-attention/).

The adapter (quantstudy.families.deformable_detr) builds it; its samples and AP are in
deformable_detr_data and deformable_detr_metrics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Transformers ResNet configs of the timm backbones, for building a real-size model where
# timm is not installed (only to name its linears: the backbone has none).
TIMM_BACKBONES = {"resnet50": {"model_type": "resnet", "embedding_size": 64, "depths": [3, 4, 6, 3],
                               "hidden_sizes": [256, 512, 1024, 2048], "layer_type": "bottleneck"}}


def level_samples(value: torch.Tensor, value_spatial_shapes_list: list[tuple[int, int]],
                  sampling_locations: torch.Tensor) -> list[torch.Tensor]:
    """Each level's bilinear samples [batch*heads, dim, queries, points], as Transformers'
    MultiScaleDeformableAttention takes them (grid_sample, zero padding, align_corners false)."""
    batch, _, heads, dim = value.shape
    values = value.split([h * w for h, w in value_spatial_shapes_list], dim=1)
    grids = 2 * sampling_locations - 1
    samples = []
    for level, (h, w) in enumerate(value_spatial_shapes_list):
        v = values[level].flatten(2).transpose(1, 2).reshape(batch * heads, dim, h, w)
        grid = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        samples.append(nn.functional.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    return samples


class WeightedStackAttention(nn.Module):
    """Transformers' MultiScaleDeformableAttention (same arguments, same products, same sum):
    each level's bilinear samples are multiplied by their attention weights before the levels
    are stacked, not after. The stack then feeds only the sum, so torch.compile writes each
    level's samples whole in that level's kernel and the sum reads one buffer; stacked first, it
    may compute part of the sampling inside the sum's kernel, which ran 2.3x slower on an H200."""

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                sampling_locations, attention_weights, im2col_step=None):
        batch, _, heads, dim = value.shape
        _, queries, _, levels, points, _ = sampling_locations.shape
        weights = attention_weights.transpose(1, 2).reshape(batch * heads, 1, queries, levels, points)
        samples = level_samples(value, value_spatial_shapes_list, sampling_locations)
        weighted = [sampled * weights[:, :, :, level] for level, sampled in enumerate(samples)]
        out = torch.stack(weighted, dim=-2).flatten(-2).sum(-1)
        return out.view(batch, heads * dim, queries).transpose(1, 2).contiguous()


class DetectorEngine(nn.Module):
    """pixel_values [batch, 3, height, width] -> logits [batch, queries, labels], pred_boxes [batch, queries, 4].

    The modules keep their Transformers names (`model.encoder.layers.0.self_attn.value_proj`,
    ...), so recipe patterns read like the reference model's. See the module docstring for
    what differs from `DeformableDetrForObjectDetection.forward`.
    """

    def __init__(self, detector: nn.Module):
        super().__init__()
        cfg = detector.config
        if cfg.two_stage or cfg.with_box_refine:
            raise ValueError("deformable_detr: the engine is the one-stage model without box refinement "
                             "(two_stage and with_box_refine false)")
        self.model = detector.model
        self.class_embed = detector.class_embed[-1]
        self.bbox_embed = detector.bbox_embed[-1]
        with torch.no_grad():
            query_pos = self.model.query_position_embeddings.weight[:, :cfg.d_model]
            self.register_buffer("reference_points", self.model.reference_points(query_pos).sigmoid())
        del self.model.reference_points
        for layer in self.model.encoder.layers:
            layer.self_attn.attn = WeightedStackAttention()
        for layer in self.model.decoder.layers:
            layer.encoder_attn.attn = WeightedStackAttention()

    def _levels(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The feature maps of every level, projected to d_model (Transformers' order)."""
        m = self.model
        features = m.backbone.model(x)
        features = list(features.feature_maps if isinstance(features, dict) else features)
        sources = [m.input_proj[level](f) for level, f in enumerate(features)]
        # The extra levels: strided 3x3 convolutions on the last backbone map, then on each other.
        for level in range(len(sources), m.config.num_feature_levels):
            sources.append(m.input_proj[level](features[-1] if level == len(features) else sources[-1]))
        return sources

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.models.deformable_detr.modeling_deformable_detr import inverse_sigmoid

        m = self.model
        x = pixel_values
        flat, position, shapes = [], [], []
        for level, source in enumerate(self._levels(x)):
            batch, channels, h, w = source.shape
            pos = m.position_embedding(shape=source.shape, device=x.device, dtype=x.dtype).to(source.dtype)
            flat.append(source.flatten(2).transpose(1, 2))
            position.append(pos.flatten(2).transpose(1, 2) + m.level_embed[level].view(1, 1, -1))
            shapes.append((h, w))
        hidden = torch.cat(flat, 1)
        position = torch.cat(position, 1)
        levels = len(shapes)
        points, spatial_shapes, level_start = encoder_geometry(shapes, batch, x.device, x.dtype)
        for layer in m.encoder.layers:
            hidden = layer(hidden, None, spatial_position_embeddings=position, reference_points=points,
                           spatial_shapes=spatial_shapes, spatial_shapes_list=shapes, level_start_index=level_start)
        query_pos, decoded = (q.unsqueeze(0).expand(batch, -1, -1)
                              for q in torch.split(m.query_position_embeddings.weight, channels, dim=1))
        reference = self.reference_points.to(x.dtype)
        points = reference[None, :, None].expand(batch, -1, levels, 2)
        for layer in m.decoder.layers:
            decoded = layer(decoded, query_pos, points, spatial_shapes, shapes, level_start,
                            encoder_hidden_states=hidden, encoder_attention_mask=None)
        delta = self.bbox_embed(decoded)
        # Two-coordinate reference points move the box centre only (as Transformers does).
        centre = delta[..., :2] + inverse_sigmoid(reference).unsqueeze(0)
        boxes = torch.cat([centre, delta[..., 2:]], -1).sigmoid()
        return {"logits": self.class_embed(decoded), "pred_boxes": boxes}


def encoder_geometry(shapes: list[tuple[Any, Any]], batch: int, device: Any, dtype: Any
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The encoder's inputs that depend on the level sizes only (ints, or symbolic under export):
    every level's reference points [batch, tokens, levels, 2] (cell centres; Transformers
    multiplies them by the valid ratios, all 1), the level shapes [levels, 2] and their start
    indices [levels]."""
    grids = []
    for h, w in shapes:
        ys = (torch.arange(h, device=device, dtype=dtype) + 0.5) / h
        xs = (torch.arange(w, device=device, dtype=dtype) + 0.5) / w
        grids.append(torch.stack([xs[None, :].expand(h, w), ys[:, None].expand(h, w)], -1).reshape(1, h * w, 2))
    points = torch.cat(grids, 1)[:, :, None].expand(batch, -1, len(shapes), 2)
    # Filled on the device, not copied from host memory: a CUDA graph cannot capture that copy.
    spatial_shapes = torch.stack([torch.stack([torch.full((), size, dtype=torch.long, device=device) for size in hw])
                                  for hw in shapes])
    level_start = torch.cat((spatial_shapes.new_zeros((1,)), spatial_shapes.prod(1).cumsum(0)[:-1]))
    return points, spatial_shapes, level_start


def transformers_backbone(timm_config: Any) -> dict[str, Any]:
    """Architecture keys that replace a timm backbone by its Transformers ResNet equivalent (same feature maps)."""
    name = timm_config.backbone
    if name not in TIMM_BACKBONES:
        raise ValueError(f"deformable_detr: no Transformers equivalent of the timm backbone {name!r} "
                         f"(known: {', '.join(TIMM_BACKBONES)})")
    # timm's feature index i (0 = stem) is the Transformers ResNet's stage i.
    stages = [f"stage{i}" for i in timm_config.out_indices]
    return {"use_timm_backbone": False, "backbone": None, "use_pretrained_backbone": False,
            "backbone_config": {**TIMM_BACKBONES[name], "num_channels": timm_config.num_channels,
                                "out_features": stages}}
