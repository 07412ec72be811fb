"""Deformable DETR (SenseTime/deformable-detr) as one detector engine: pixels -> logits, boxes.

The engine is the write-up's: batch 1, dynamic height and width (one ONNX serves 800 x 800
and 800 x 1067), input `pixel_values` (as the image processor makes them, in the variant's
precision) and outputs `logits` and `pred_boxes`. It takes no pixel mask: a batch of one
image resized by the processor is never padded, so the mask is all ones, and an all-ones mask
changes nothing (Transformers' valid ratios are exactly 1 and its masked fills are no-ops).
All sizes share the engine, so they share one amax file: the study calibrates by no shape key
(`calibrate_by: []`), and calibration images keep the processor's own resize.

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

Export: quantstudy.export.export (torch.onnx.export(dynamo=True)) with dynamic height and
width works for fp32, fp16 and FP8 Q/DQ; the multi-scale deformable attention becomes
GridSample (opset 16+), which ONNX Runtime CPU runs. The legacy exporter is not needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantstudy import kernel_kinds
from quantstudy.families import base, register

log = logging.getLogger(__name__)

# Kernel-time groups of the write-up, in the order it names them: the GEMMs (all linears and
# the decoder's self-attention products), GridSample (the deformable attention), the fused
# normalization and elementwise kernels, the backbone and input-projection convolutions, and
# Quantize: the FP8 layers' activation Quantize (and Dequantize) work, apart from their GEMMs, as
# the write-up sets the Quantize fused into the encoder's deformable sums against the GEMM time saved.
KERNEL_GROUPS = ["GEMM", "GridSample", "normalization and elementwise", "convolution", "Quantize", "other"]
REGIONS: dict[str, str] = {}  # the ops are recognisable by name; no record_function regions

# A CPU op (or the op that launched a GPU kernel) by name: torch (`aten::...`) and ONNX
# Runtime (`onnxruntime::<OpType>`) names.
OP_PATTERNS = [("Quantize", r"::(quantize|dequantize)linear$"),
               ("GridSample", r"grid_sampler|::gridsample$"),
               ("convolution", r"conv"),
               ("normalization and elementwise",
                r"norm|softmax|::(add|sub|mul|div|neg|relu|sigmoid|exp|log|sin|cos|pow|sqrt|rsqrt|reciprocal|clamp"
                r"|clamp_min|masked_fill|where|cast|_to_copy|copy)_?$")]
# A GPU kernel whose op is unknown (compiled code, TensorRT), by its name. Quantize first (an FP8
# GEMM's name may say e4m3 too, a Quantize kernel's says quantize); convolutions before GEMMs:
# cuDNN's implicit-GEMM kernels would otherwise read as GEMMs.
KERNEL_PATTERNS = [("Quantize", r"quantiz"),
                   ("GridSample", r"grid_?sampl"),
                   ("convolution", r"conv|fprop|implicit"),
                   ("GEMM", r"gemm|hmma|xmma|cutlass|nvjet|e4m3|fp8|triton_tem_.*mm"),
                   ("normalization and elementwise",
                    r"norm|elementwise|vectorized|reduce|softmax|pointwise|__myl_|triton_(poi|per|red)_")]

# Dynamic height and width: every image the checkpoint's processor makes (longest edge
# 1333) down to 65, the smallest size whose coarsest (stride-64) level has two cells; a
# one-cell level makes torch.export specialize the sizes.
SIZE_MIN, SIZE_MAX = 65, 1333

# The tiny checkpoint's processor: the real one (shortest edge 800, longest 1333) scaled by
# 0.12, so that a 4:3 image becomes 96 x 128 as it becomes 800 x 1067 at real size.
TINY_PROCESSOR_SIZE = {"shortest_edge": 96, "longest_edge": 160}

# Transformers ResNet configs of the timm backbones, for building a real-size model where
# timm is not installed (only to name its linears: the backbone has none).
TIMM_BACKBONES = {"resnet50": {"model_type": "resnet", "embedding_size": 64, "depths": [3, 4, 6, 3],
                               "hidden_sizes": [256, 512, 1024, 2048], "layer_type": "bottleneck"}}

EVAL_CHUNK = 16  # images decoded and run at a time


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


@register("deformable_detr")
class DeformableDetr:
    """Adapter: the Deformable DETR detector engine, its inputs, layer names and kernel groups."""

    kernel_groups = KERNEL_GROUPS
    metrics_schema = base.metrics_schema({"score_threshold": base.SHARE, "match_iou": base.SHARE,
                                          "ap_resamples": base.COUNT})
    seeds = ()
    regions = REGIONS

    # --- configuration and loading -------------------------------------------------------
    @staticmethod
    def hf_config(architecture: dict[str, Any]):
        """DeformableDetrConfig of a recorded architecture (the real one names a timm backbone)."""
        from transformers import DeformableDetrConfig

        return DeformableDetrConfig(**{k: v for k, v in architecture.items() if k not in ("model_type", "source")})

    def hf_config_without_timm(self, architecture: dict[str, Any]):
        """hf_config with a timm backbone replaced by its Transformers equivalent (the same
        feature maps; timm need not be installed): for building the model without weights."""
        cfg = self.hf_config(architecture)
        if cfg.backbone_config.model_type == "timm_backbone":
            cfg = self.hf_config({**architecture, **transformers_backbone(cfg.backbone_config)})
        return cfg

    @staticmethod
    def load_reference(checkpoint: str | Path, dtype: Any = torch.float32) -> nn.Module:
        """Transformers DeformableDetrForObjectDetection at `checkpoint`, in `dtype`, eval mode."""
        from transformers import DeformableDetrForObjectDetection

        return DeformableDetrForObjectDetection.from_pretrained(str(checkpoint), dtype=dtype).eval()

    @staticmethod
    def processor(checkpoint: str | Path):
        """The checkpoint's DeformableDetrImageProcessor, PIL backend.

        Pinned to the PIL backend: `AutoImageProcessor` picks the torchvision one where
        torchvision imports (GPU nodes) and PIL elsewhere, and the two resize differently.
        """
        from transformers.models.deformable_detr.image_processing_pil_deformable_detr import (
            DeformableDetrImageProcessorPil)

        return DeformableDetrImageProcessorPil.from_pretrained(str(checkpoint))

    def quantizable_layers(self, architecture: dict[str, Any]) -> list[str]:
        """The engine's linear layers, named as in DetectorEngine, built on the meta device.

        A timm backbone is replaced by its Transformers equivalent (timm need not be
        installed): neither has a linear layer, so the names are the same.
        """
        from transformers import DeformableDetrForObjectDetection

        with torch.device("meta"):
            engine = DetectorEngine(DeformableDetrForObjectDetection(self.hf_config_without_timm(architecture)))
        return [n for n, m in engine.named_modules() if isinstance(m, nn.Linear)]

    @staticmethod
    def check_setting(setting: base.Setting) -> list[str]:
        """A setting is {height, width} within the engine's dynamic range, at batch 1."""
        problems = []
        if set(setting.shape) != {"height", "width"}:
            problems.append(f"setting {setting.name}: a detector setting's shape is {{height, width}}, "
                            f"not {{{', '.join(sorted(setting.shape))}}}")
        if setting.batch != 1:
            problems.append(f"setting {setting.name}: the detector engine is batch 1 (images of different "
                            f"sizes would need padding and a pixel mask), not {setting.batch}")
        for key in ("height", "width"):
            size = setting.shape.get(key)
            if isinstance(size, int) and not SIZE_MIN <= size <= SIZE_MAX:
                problems.append(f"setting {setting.name}: {key} {size} is outside the engine's dynamic range "
                                f"{SIZE_MIN} to {SIZE_MAX}")
        return problems

    # --- embedded default ----------------------------------------------------------------
    def tiny_checkpoint_files(self, architecture: dict[str, Any], tiny: dict[str, Any]) -> dict[str, bytes]:
        """A random-init DeformableDetrForObjectDetection (seed `tiny["seed"]`) with its image processor config.

        Transformers initialises the sampling-offset and attention-weight projections to zero
        (training starts from a fixed sampling grid); a trained model's depend on the image,
        so the tiny model gets random weights there and its GridSample coordinates move with
        the input as they do in the real model.
        """
        from transformers import DeformableDetrForObjectDetection

        torch.manual_seed(tiny["seed"])
        # Random weights throughout: a timm backbone's pretrained weights would be a download.
        cfg = self.hf_config({**architecture, "use_pretrained_backbone": False})
        model = DeformableDetrForObjectDetection(cfg).eval()
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith((".sampling_offsets", ".attention_weights")):
                    nn.init.normal_(module.weight, std=cfg.d_model ** -0.5)
        processor = {"image_processor_type": "DeformableDetrImageProcessor", "format": "coco_detection",
                     "do_resize": True, "size": TINY_PROCESSOR_SIZE, "resample": 2, "do_rescale": True,
                     "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.485, 0.456, 0.406],
                     "image_std": [0.229, 0.224, 0.225], "do_pad": True}
        with tempfile.TemporaryDirectory() as tmp:
            # save_pretrained stores the tied prediction heads once, as from_pretrained expects.
            model.save_pretrained(tmp)
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
        files["preprocessor_config.json"] = json.dumps(processor, indent=1, sort_keys=True).encode()
        return files

    def tiny_dataset_files(self, files: dict[str, str], tiny: dict[str, Any],
                           architecture: dict[str, Any]) -> dict[str, bytes]:
        """One parquet file per split in detection-datasets/coco's layout (image_id; image {bytes: a
        JPEG, path}; width; height; objects {bbox_id, category, bbox, area}), written with its
        `datasets` features so that `category` is a ClassLabel with names, as there.

        The images are seeded views of scikit-image's photographs (quantstudy.fixtures), `short_side:
        [lo, hi]` sizing them (COCO's 480 to 640 px by default). Each holds 1 to `objects` boxes, each
        a seeded sub-region of the frame (a fifth to two thirds of each side) in `box_format`, so a box
        read in the wrong format ends outside its image. The categories are the tiny detector's labels
        other than "N/A", in alphabetical order: their indices are not its label ids, and only a map by
        name scores them right."""
        import datasets

        from quantstudy import fixtures

        if tiny["kind"] != "images":
            raise ValueError(f"a tiny Deformable DETR dataset holds images, not {tiny['kind']!r}")
        box_format = tiny["box_format"]
        names = sorted({n for n in architecture["id2label"].values() if n != "N/A"})
        features = datasets.Features({
            "image_id": datasets.Value("int64"), "image": datasets.Image(), "width": datasets.Value("int64"),
            "height": datasets.Value("int64"),
            "objects": {"bbox_id": datasets.List(datasets.Value("int64")),
                        "category": datasets.List(datasets.ClassLabel(names=names)),
                        "bbox": datasets.List(datasets.List(datasets.Value("float64"), length=4)),
                        "area": datasets.List(datasets.Value("float64"))}})
        photos = [fixtures.photo(name) for name in fixtures.PHOTOS]
        short_side = tuple(tiny.get("short_side", (480, 640)))
        out, box_id = {}, 0
        for s, (split, pattern) in enumerate(sorted(files.items())):
            rng, rows = random.Random(tiny["seed"] * 1000 + s), []
            for i in range(tiny.get("rows", 40)):
                view, buf = fixtures.jittered(photos[rng.randrange(len(photos))], rng, short_side), io.BytesIO()
                view.save(buf, format="JPEG", quality=90)
                w, h = view.size
                objects: dict[str, list] = {"bbox_id": [], "category": [], "bbox": [], "area": []}
                for _ in range(rng.randint(1, tiny.get("objects", 3))):
                    bw, bh = round(rng.uniform(0.2, 0.67) * w, 2), round(rng.uniform(0.2, 0.67) * h, 2)
                    x, y = round(rng.uniform(0, w - bw), 2), round(rng.uniform(0, h - bh), 2)
                    box_id += 1
                    objects["bbox_id"].append(box_id)
                    objects["category"].append(rng.randrange(len(names)))
                    objects["bbox"].append([x, y, bw, bh] if box_format == "xywh" else [x, y, x + bw, y + bh])
                    objects["area"].append(bw * bh)
                rows.append({"image_id": i, "image": {"bytes": buf.getvalue(), "path": f"{i:012d}.jpg"}, "width": w,
                             "height": h, "objects": objects})
            buf = io.BytesIO()
            datasets.Dataset.from_list(rows, features=features).to_parquet(buf)
            out[fixtures.split_file(pattern)] = buf.getvalue()
        return out

    # --- samples and inputs --------------------------------------------------------------
    @staticmethod
    def draw_samples(rows: Any, spec: dict[str, Any], processor: Any) -> list[dict[str, Any]]:
        """Images of a split (parquet rows with their `__url__` and `__index__`) with their boxes, in a
        seeded order.

        kind images: the rows base.seeded_rows picks (calibration and held out are disjoint). Every
        box of a drawn image must be a box inside that image in the dataset's declared `box_format`,
        else the draw stops and names the image. A sample: {"id": the image_id, "sha256": of the
        image bytes and its ground truth (AP depends on both), "file": the parquet file in the pinned
        snapshot, "row": the image's row in it, "box_format", "objects": its number of boxes}.
        """
        from datasets import Image

        from quantstudy import metrics as qm

        if spec["kind"] != "images":
            raise ValueError(f"deformable_detr draws images, not {spec['kind']!r}")
        box_format = spec.get("box_format")
        if box_format not in qm.BOX_FORMATS:
            raise ValueError(f"deformable_detr: the dataset's box_format is {box_format!r}; declare it in the study's "
                             f"datasets: entry, one of {', '.join(qm.BOX_FORMATS)} (AP depends on it)")
        picked = base.seeded_rows(len(rows), spec)
        rows = rows.cast_column("image", Image(decode=False))  # the bytes as stored: the content hash
        names = {f: _file_names(f) for f in set(rows.select(picked)["__url__"])}  # as every job reads them
        samples = []
        for row in (rows[i] for i in picked):
            truth = _truth(row, names[row["__url__"]])
            for box in (o["bbox"] for o in truth["objects"]):
                problem = qm.box_problems(box, truth["width"], truth["height"], box_format)
                if problem:
                    raise ValueError(f"deformable_detr: image {row['image_id']} of {row['__url__']} has the box {box}, "
                                     f"which read as {box_format} {qm.BOX_FORMATS[box_format]} is not a box in the "
                                     f"image: {problem}. Check the dataset's declared box_format")
            samples.append({"id": int(row["image_id"]), "sha256": _sample_sha(row["image"]["bytes"], truth),
                            "file": row["__url__"], "row": int(row["__index__"]), "box_format": box_format,
                            "objects": len(truth["objects"])})
        return samples

    @staticmethod
    def content_sha256(samples: list[dict[str, Any]]) -> list[str]:
        return [_sample_sha(data, truth) for data, truth in zip(_image_bytes(samples), _file_truth(samples))]

    def calibration_batches(self, checkpoint: str | Path, samples: list[dict[str, Any]],
                            setting: base.Setting) -> list[dict[str, torch.Tensor]]:
        """One batch per image (read from the sample's file and checked against its sha256).

        Each image keeps the checkpoint processor's own resize (shortest edge 800, longest
        1333 at real size), as the write-up calibrated the Transformers model: the amax file
        does not depend on the setting, and every size's engine shares it.
        """
        processor = self.processor(checkpoint)
        return [{"pixel_values": processor(images=image, return_tensors="pt")["pixel_values"]}
                for image in load_images(samples)]

    @staticmethod
    def graphs(setting: base.Setting, architecture: dict[str, Any]) -> dict[str, base.Graph]:
        """One engine, the same for every architecture: dynamic height and width, the setting's size as opt."""
        height, width = setting["height"], setting["width"]
        pixels = base.TensorSpec("float32", (setting.batch, 3, height, width),
                                 {2: base.Dim("height", SIZE_MIN, height, SIZE_MAX),
                                  3: base.Dim("width", SIZE_MIN, width, SIZE_MAX)})
        return {"main": base.Graph("main", {"pixel_values": pixels}, ("logits", "pred_boxes"))}

    def module(self, checkpoint: str | Path, graph: str, setting: base.Setting) -> DetectorEngine:
        """The fp32 detector engine of the checkpoint (graph "main")."""
        _check_graph(graph)
        return DetectorEngine(self.load_reference(checkpoint, torch.float32)).eval()

    @staticmethod
    def example_inputs(checkpoint: str | Path, graph: str, setting: base.Setting) -> dict[str, torch.Tensor]:
        """Seeded normalized pixels of the setting's size (the processor's output has unit scale)."""
        _check_graph(graph)
        g = torch.Generator().manual_seed(0)
        return {"pixel_values": torch.randn(setting.batch, 3, setting["height"], setting["width"], generator=g)}

    # --- measurements --------------------------------------------------------------------
    def reference(self, checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]], setting: base.Setting,
                  metrics: dict[str, Any], seeds: dict[str, int], device: str, dtype: Any = torch.float32):
        """Transformers' DeformableDetrForObjectDetection (in `dtype`, fp32 for this study) on each
        evaluation set's images, fed as the engines are (`detector_outputs`), and its COCO AP.

        Tensors: `<set>_logits` [images, queries, labels] and `<set>_boxes` [images, queries, 4] float32.
        """
        model = self.load_reference(checkpoint, dtype).to(device)

        def forward(x, what=""):
            out = model(pixel_values=x["pixel_values"].to(device, dtype))
            return {"logits": out.logits, "pred_boxes": out.pred_boxes}

        labels, processor = _category_map(checkpoint, samples), self.processor(checkpoint)
        tensors, blocks = {}, {}
        for name, rows in samples.items():
            images, truth = checked_samples(rows)
            logits, boxes = detector_outputs(forward, processor, images, setting, name)
            log.info("reference on %s: %d images", name, len(rows))
            tensors[f"{name}_logits"], tensors[f"{name}_boxes"] = logits, boxes
            blocks[name] = box_ap(_detections(logits, boxes, truth, labels), rows, truth, labels)
        return tensors, blocks

    def evaluate(self, checkpoint: str | Path, run: base.Run, reference: dict[str, torch.Tensor],
                 samples: dict[str, list[dict[str, Any]]], setting: base.Setting, metrics: dict[str, Any],
                 seeds: dict[str, int], device: str, against: Any = None) -> base.Evaluation:
        """Per evaluation set: the engine's COCO AP (AP, AP50, AP75) on its images fed as the
        reference's were, the reference's AP and the drop from it, and the engine's agreement with the
        reference: the correlation of their logits, and the precision and recall of the engine's
        detections against the reference's (`metrics.score_threshold`, `metrics.match_iou`:
        metrics.detection_agreement). Against another variant's engine (`quality_against`): the same
        agreement with it, its AP and the drop from it. Non-finite: images whose logits or boxes hold
        a NaN or an Inf.
        """

        labels, processor = _category_map(checkpoint, samples), self.processor(checkpoint)
        blocks, nonfinite = {}, {}
        for name, rows in samples.items():
            images, truth = checked_samples(rows)  # read and checked once, for every detector below
            logits, boxes = detector_outputs(run, processor, images, setting, name)
            mine = _detections(logits, boxes, truth, labels)
            ap = box_ap(mine, rows, truth, labels)
            ref_logits = reference[f"{name}_logits"]
            ref = _detections(ref_logits, reference[f"{name}_boxes"], truth, labels)
            ref_ap = box_ap(ref, rows, truth, labels)["ap"]
            bad = ~(torch.isfinite(logits).flatten(1).all(1) & torch.isfinite(boxes).flatten(1).all(1))
            nonfinite[name] = {"bad": int(bad.sum()), "of": len(rows)}
            theirs = {}
            for other_name, other in (against or {}).items():
                their_logits, their_boxes = detector_outputs(other, processor, images, setting, f"{name} on {other_name}")
                theirs[other_name] = their_logits, _detections(their_logits, their_boxes, truth, labels)
            draws = ap_draws({"engine": mine, "reference": ref, **{k: d for k, (_, d) in theirs.items()}},
                             rows, truth, labels, metrics["ap_resamples"])
            drop = lambda other: ap_interval([a - b for a, b in zip(draws[other], draws["engine"])], len(rows))
            blocks[name] = {**ap, "reference_ap": ref_ap, "ap_drop": ref_ap - ap["ap"],
                            **agreement(ref_logits, ref, logits, mine, metrics),
                            "intervals": {"ap": ap_interval(draws["engine"], len(rows)), "ap_drop": drop("reference")}}
            for other_name, (their_logits, their) in theirs.items():
                their_ap = box_ap(their, rows, truth, labels)["ap"]
                blocks[base.against_block(name, other_name)] = {
                    "ap": their_ap, "ap_drop": their_ap - ap["ap"], **agreement(their_logits, their, logits, mine, metrics),
                    "intervals": {"ap": ap_interval(draws[other_name], len(rows)), "ap_drop": drop(other_name)}}
        return base.Evaluation(blocks, nonfinite)

    def quality_columns(self, evaluation_samples: list[str], against: list[str]) -> base.QualityColumns:
        from quantstudy import metrics as qm

        agreement = ("logit_correlation", *qm.DETECTION_AGREEMENT)
        return base.QualityColumns(
            blocks={**{s: (*qm.COCO_BOX_AP, "reference_ap", "ap_drop", *agreement) for s in evaluation_samples},
                    **{base.against_block(s, v): ("ap", "ap_drop", *agreement) for s in evaluation_samples for v in against}},
            nonfinite=tuple(evaluation_samples),
            reference={s: qm.COCO_BOX_AP for s in evaluation_samples})

    @staticmethod
    def kernel_group(region: str | None, name: str, device: str, op: dict[str, Any] | None,
                     setting: base.Setting | None = None) -> str:
        """The write-up's kernel group of a profiled CPU op or GPU kernel.

        A GEMM op is a GEMM; any other op of an FP8 layer (its region, eager) is Quantize work, as
        are ONNX Runtime's QuantizeLinear and DequantizeLinear; other ops go by name (GridSample,
        convolutions, normalization and elementwise). A GPU kernel goes by the op that launched it,
        else (compiled code, TensorRT) by its own name.
        """
        op_name = kernel_kinds.launching_op(name, device, op)
        if op_name in kernel_kinds.GEMM_OPS:
            return "GEMM"
        if kernel_kinds.in_fp8_gemm(region, op_name):
            return "Quantize"
        for group, pattern in OP_PATTERNS:
            if op_name and re.search(pattern, op_name, re.I):
                return group
        return "other" if device == "cpu" else kernel_kinds.group_by_name(name, KERNEL_PATTERNS)

    @staticmethod
    def transforms() -> dict:
        return {}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _image_bytes(samples: list[dict[str, Any]]) -> list[bytes]:
    """Each sample's image bytes as stored in its parquet file (each file's image column read once)."""
    import pyarrow.parquet as pq

    columns: dict[str, Any] = {}
    for s in samples:
        if s["file"] not in columns:
            columns[s["file"]] = pq.read_table(s["file"], columns=["image"]).column("image")
    return [columns[s["file"]][s["row"]].as_py()["bytes"] for s in samples]


def _file_names(path: str) -> list[str]:
    """The category names a parquet file's `datasets` metadata records (a ClassLabel under objects.category)."""
    import pyarrow.parquet as pq

    meta = (pq.read_schema(path).metadata or {}).get(b"huggingface")
    try:
        node = json.loads(meta)["info"]["features"]["objects"]
        node = node.get("feature", node)["category"]
        while "names" not in node:
            node = node["feature"]
    except (TypeError, KeyError) as e:
        raise ValueError(f"deformable_detr: {path} records no category names (a `datasets` ClassLabel under "
                         f"objects.category): {e!r}") from e
    return list(node["names"])


def _truth(row: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """One image's ground truth as the dataset stores it: its size and each box (as stored, in the
    dataset's box format) with its category's name."""
    objects = row["objects"]
    return {"width": int(row["width"]), "height": int(row["height"]),
            "objects": [{"category": names[c], "bbox": [float(v) for v in box]}
                        for c, box in zip(objects["category"], objects["bbox"], strict=True)]}


def _sample_sha(image: bytes, truth: dict[str, Any]) -> str:
    return _sha(image + b"\n" + json.dumps(truth, sort_keys=True).encode())


def _file_truth(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each sample's ground truth read from its parquet file (each file's columns read once)."""
    import pyarrow.parquet as pq

    files: dict[str, tuple[Any, list[str]]] = {}
    for s in samples:
        if s["file"] not in files:
            files[s["file"]] = (pq.read_table(s["file"], columns=["objects", "width", "height"]), _file_names(s["file"]))
    out = []
    for s in samples:
        table, names = files[s["file"]]
        out.append(_truth({k: table.column(k)[s["row"]].as_py() for k in ("objects", "width", "height")}, names))
    return out


def checked_samples(samples: list[dict[str, Any]]) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Each sample's image bytes as stored and its ground truth, boxes in COCO's [x, y, width, height],
    both read from its file and checked together against the sample's sha256."""
    from quantstudy import metrics as qm

    images, truths = [], []
    for s, data, truth in zip(samples, _image_bytes(samples), _file_truth(samples)):
        if _sample_sha(data, truth) != s["sha256"]:
            raise ValueError(f"deformable_detr: image {s['id']} and its boxes (row {s['row']} of {s['file']}) do not "
                             f"have the sample's sha256 {s['sha256']}: the snapshot is not the one the samples were "
                             "drawn from")
        images.append(data)
        truths.append({**truth, "objects": [{**o, "bbox": qm.to_xywh(o["bbox"], s["box_format"])}
                                            for o in truth["objects"]]})
    return images, truths


def _decoded(images: list[bytes]) -> list:
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


def pixel_values(processor: Any, images: list, setting: base.Setting) -> torch.Tensor:
    """[images, 3, height, width] float32: each image resized to the setting's height x width (its
    aspect ratio not kept: the engine is timed at that shape, so AP is measured there), then rescaled
    and normalized as the checkpoint's processor does. No padding, so no pixel mask."""
    return processor(images=images, size={"height": setting["height"], "width": setting["width"]}, do_pad=False,
                     return_tensors="pt")["pixel_values"]


def detector_outputs(run: base.Run, processor: Any, images: list[bytes], setting: base.Setting,
                     what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [images, queries, labels] and boxes [images, queries, 4] (float32, CPU) of `run` (an
    engine, or the reference as one) on the images (their bytes: checked_samples), EVAL_CHUNK of them
    decoded at a time."""
    logits, boxes = [], []
    for i in range(0, len(images), EVAL_CHUNK):
        x = pixel_values(processor, _decoded(images[i:i + EVAL_CHUNK]), setting)
        with torch.no_grad():
            out = run({"pixel_values": x}, f"{what} {i + len(x)}/{len(images)}")
        logits.append(out["logits"].float().cpu())
        boxes.append(out["pred_boxes"].float().cpu())
    return torch.cat(logits), torch.cat(boxes)


def _category_map(checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    """Category name -> the detector's label id, by name, for every name the sample files record."""
    from transformers import AutoConfig

    from quantstudy import metrics as qm

    names = sorted({n for rows in samples.values() for n in _file_names_of(rows)})
    by_index = qm.category_map(AutoConfig.from_pretrained(str(checkpoint)).id2label, names)
    return {name: by_index[i] for i, name in enumerate(names)}


def _file_names_of(samples: list[dict[str, Any]]) -> list[str]:
    return [n for f in sorted({s["file"] for s in samples}) for n in _file_names(f)]


def _detections(logits: torch.Tensor, boxes: torch.Tensor, truth: list[dict[str, Any]],
                labels: dict[str, int]) -> list[list[dict[str, Any]]]:
    """Each image's top_detections over the dataset's categories, in pixels of the original image
    (its size from its ground truth)."""
    from quantstudy import metrics as qm

    keep = set(labels.values())
    return [qm.top_detections(lg, bx, t["width"], t["height"], keep)
            for lg, bx, t in zip(logits, boxes, truth, strict=True)]


def box_ap(detections: list[list[dict[str, Any]]], samples: list[dict[str, Any]], truth: list[dict[str, Any]],
           labels: dict[str, int]) -> dict[str, Any]:
    """COCO box AP (metrics.coco_box_ap, faster-coco-eval) of a detector's detections (_detections) on
    the samples' images against their ground truth (checked_samples), categories mapped to the
    detector's label ids by name."""
    from quantstudy import metrics as qm

    images = [{"id": s["id"], "width": t["width"], "height": t["height"]} for s, t in zip(samples, truth)]
    annotations = [{"image_id": s["id"], "category_id": labels[o["category"]], "bbox": o["bbox"],
                    "area": o["bbox"][2] * o["bbox"][3], "iscrowd": 0} for s, t in zip(samples, truth) for o in t["objects"]]
    found = [{**d, "image_id": s["id"]} for s, ds in zip(samples, detections) for d in ds]
    categories = [{"id": i, "name": n} for n, i in sorted(labels.items(), key=lambda kv: kv[1])]
    return qm.coco_box_ap(images, annotations, found, categories)


def ap_draws(detectors: dict[str, list[list[dict[str, Any]]]], samples: list[dict[str, Any]],
             truth: list[dict[str, Any]], labels: dict[str, int], resamples: int) -> dict[str, list[float]]:
    """Each detector's COCO AP on `resamples` bootstrap resamples of the images (compare.bootstrap_draws): every
    resample draws the images once and evaluates all the detectors on them, so that the drop from one to
    another is paired. A drawn image counts as often as it is drawn (a fresh image id each time). Empty
    lists where there are fewer than two images."""
    from quantstudy import compare

    def aps(picks: list[int]) -> dict[str, float]:
        drawn = [{**samples[i], "id": n + 1} for n, i in enumerate(picks)]
        with contextlib.redirect_stdout(io.StringIO()):  # the evaluator prints its summary each time
            return {name: box_ap([found[i] for i in picks], drawn, [truth[i] for i in picks], labels)["ap"]
                    for name, found in detectors.items()}

    draws = compare.bootstrap_draws(aps, len(samples), resamples)
    return {name: [d[name] for d in draws] for name in detectors}


def ap_interval(draws: list[float], images: int) -> dict[str, Any] | None:
    """An AP's (or a drop's) interval from its bootstrap draws (ap_draws), kept as metrics.interval_record."""
    from quantstudy import compare, metrics as qm

    if not draws:
        return None
    return qm.interval_record(*compare.percentile_interval(draws), images, "images")


def agreement(ref_logits: torch.Tensor, ref_detections: list[list[dict[str, Any]]], logits: torch.Tensor,
              detections: list[list[dict[str, Any]]], metrics: dict[str, Any]) -> dict[str, Any]:
    """An engine's logit correlation with another detector, and the precision and recall of its
    detections against the other's (metrics.detection_agreement)."""
    from quantstudy import metrics as qm

    matched = qm.detection_agreement(ref_detections, detections, metrics["score_threshold"], metrics["match_iou"])
    return {"logit_correlation": qm.logit_correlation(ref_logits, logits), **matched}


def load_images(samples: list[dict[str, Any]]) -> list:
    """The samples' images (RGB PIL), read from their files and checked with their ground truth against
    their sha256 (checked_samples)."""
    return _decoded(checked_samples(samples)[0])


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


def _check_graph(graph: str) -> None:
    if graph != "main":
        raise KeyError(f"deformable_detr has one graph, 'main', not {graph!r}")
