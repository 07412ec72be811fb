"""Deformable DETR (SenseTime/deformable-detr) as one detector engine: pixels -> logits, boxes.

The engine is the write-up's: batch 1, dynamic height and width (one ONNX serves 800 x 800
and 800 x 1067), input `pixel_values` (as the image processor makes them, in the variant's
precision) and outputs `logits` and `pred_boxes`. It takes no pixel mask: a batch of one
image resized by the processor is never padded, so the mask is all ones, and an all-ones mask
changes nothing (Transformers' valid ratios are exactly 1 and its masked fills are no-ops).
All sizes share the engine, so they share one amax file: the study calibrates by no shape key
(`calibrate_by: []`), and calibration images keep the processor's own resize.

The family is four modules: this adapter (the contract: configuration, settings, samples, graphs,
reference and evaluation, kernel groups); deformable_detr_model, the engine module
(`DetectorEngine`) and what differs in it from Transformers' forward; deformable_detr_data, the
COCO-layout images and boxes, read back, checked and fed to a detector; deformable_detr_metrics,
their COCO box AP, its interval and the agreement between two detectors.

Export: quantstudy.export.export (torch.onnx.export(dynamo=True)) with dynamic height and
width works for fp32, fp16 and FP8 Q/DQ; the multi-scale deformable attention becomes
GridSample (opset 16+), which ONNX Runtime CPU runs. The legacy exporter is not needed.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantstudy import kernel_kinds
from quantstudy.families import base, register
from quantstudy.families.deformable_detr_data import (checked_samples, detector_outputs, file_names, file_truth,
                                                      image_bytes, load_images, row_truth, sample_sha,
                                                      tiny_dataset)
from quantstudy.families.deformable_detr_metrics import agreement, ap_draws, ap_interval, box_ap, category_map, detections
from quantstudy.families.deformable_detr_model import DetectorEngine, transformers_backbone

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
        """One parquet file per split in detection-datasets/coco's layout, seeded images with seeded boxes
        in `box_format` (deformable_detr_data.tiny_dataset)."""
        return tiny_dataset(files, tiny, architecture)

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
        names = {f: file_names(f) for f in set(rows.select(picked)["__url__"])}  # as every job reads them
        samples = []
        for row in (rows[i] for i in picked):
            truth = row_truth(row, names[row["__url__"]])
            for box in (o["bbox"] for o in truth["objects"]):
                problem = qm.box_problems(box, truth["width"], truth["height"], box_format)
                if problem:
                    raise ValueError(f"deformable_detr: image {row['image_id']} of {row['__url__']} has the box {box}, "
                                     f"which read as {box_format} {qm.BOX_FORMATS[box_format]} is not a box in the "
                                     f"image: {problem}. Check the dataset's declared box_format")
            samples.append({"id": int(row["image_id"]), "sha256": sample_sha(row["image"]["bytes"], truth),
                            "file": row["__url__"], "row": int(row["__index__"]), "box_format": box_format,
                            "objects": len(truth["objects"])})
        return samples

    @staticmethod
    def content_sha256(samples: list[dict[str, Any]]) -> list[str]:
        return [sample_sha(data, truth) for data, truth in zip(image_bytes(samples), file_truth(samples))]

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

        labels, processor = category_map(checkpoint, samples), self.processor(checkpoint)
        tensors, blocks = {}, {}
        for name, rows in samples.items():
            images, truth = checked_samples(rows)
            logits, boxes = detector_outputs(forward, processor, images, setting, name)
            log.info("reference on %s: %d images", name, len(rows))
            tensors[f"{name}_logits"], tensors[f"{name}_boxes"] = logits, boxes
            blocks[name] = box_ap(detections(logits, boxes, truth, labels), rows, truth, labels)
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

        labels, processor = category_map(checkpoint, samples), self.processor(checkpoint)
        blocks, nonfinite = {}, {}
        for name, rows in samples.items():
            images, truth = checked_samples(rows)  # read and checked once, for every detector below
            logits, boxes = detector_outputs(run, processor, images, setting, name)
            mine = detections(logits, boxes, truth, labels)
            ap = box_ap(mine, rows, truth, labels)
            ref_logits = reference[f"{name}_logits"]
            ref = detections(ref_logits, reference[f"{name}_boxes"], truth, labels)
            ref_ap = box_ap(ref, rows, truth, labels)["ap"]
            bad = ~(torch.isfinite(logits).flatten(1).all(1) & torch.isfinite(boxes).flatten(1).all(1))
            nonfinite[name] = {"bad": int(bad.sum()), "of": len(rows)}
            theirs = {}
            for other_name, other in (against or {}).items():
                their_logits, their_boxes = detector_outputs(other, processor, images, setting, f"{name} on {other_name}")
                theirs[other_name] = their_logits, detections(their_logits, their_boxes, truth, labels)
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


def _check_graph(graph: str) -> None:
    if graph != "main":
        raise KeyError(f"deformable_detr has one graph, 'main', not {graph!r}")
