"""timm XCiT image classifiers (xcit_nano_12_p16_224, xcit_tiny_12_p16_224 and larger configs).

One engine per setting: `main`, pixel_values [batch, 3, 224, 224] (the checkpoint's eval
transform applied) -> logits [batch, classes], both in the variant's work precision (the fp32
module's are float32). Shapes are static: XCiT checkpoints are trained at a fixed input size,
and each batch is its own engine.

The graph module (timm_xcit_model.Classifier) holds the timm model's own modules under timm's
names and writes timm's forward out, so that profiles see the attention cores and convolutions;
timm_xcit_data reads the samples' images back from their shards and feeds them to an engine.

Recipe (the write-up): FP8 for attn.qkv, attn.proj, mlp.fc1 and mlp.fc2 of every XCA block and
for the class-attention k and v projections (the write-up's "class-attention attn.kv": timm
splits the official qkv into q, k, v). The class-attention q, proj and MLP act on the class
token alone (one-token GEMVs) and stay fp16 with the stem, the depthwise convolutions of the
local patch interaction, the layer norms, the channel-attention matmuls and the head.

Export: the dynamo exporter (quantstudy.export.export) exports the fp16 module and the FP8 Q/DQ
modules (fp16 or fp32 Dequantize) as they are; nothing is inserted afterwards. The
class-attention k and v read one tensor and calibrate to one scale, so the exporter's optimizer
merges their input QuantizeLinear / DequantizeLinear into one pair that feeds both GEMMs (each
keeps its own FP8 weight and weight DequantizeLinear): one activation Quantize per
class-attention block.

Samples are ImageNet validation images from WebDataset tar shards (clip-benchmark/wds_imagenet1k:
`<key>.webp` + `<key>.cls`), read with the `datasets` webdataset builder. A sample records the
image's key, label and sha256, and where its bytes are: the shard file in the pinned dataset
snapshot (the row's `__url__`, the path the loader read, which names the snapshot's revision)
and the member name. Pixels never go into a samples file; `load_images` reads the bytes back
from the shard and checks their hash.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantstudy import kernel_kinds
from quantstudy.families import base, register
from quantstudy.families.timm_xcit_data import (IMAGE_EXTENSIONS, engine_logits, image_bytes, image_column, load_images,
                                                pixel_values, sha256_hex, tar_bytes, whole_batches)
from quantstudy.families.timm_xcit_model import ATTENTION_REGION, CONV_REGION, Classifier, timm_model

log = logging.getLogger("quantstudy")

# Kernel groups: the recipe's FP8 GEMMs, the GEMMs that stay fp16 (one-token GEMVs, head,
# layers a variant leaves out), the attention cores (channel attention: l2-normalized q, k,
# temperature, softmax over channels; class attention), the convolutions (stem, positional
# encoding, local patch interaction, with their batch norms and GELUs) and everything else.
KERNEL_GROUPS = ["FP8 GEMMs", "fp16 GEMMs", "attention", "convolutions", "other"]
REGIONS = {ATTENTION_REGION: "attention", CONV_REGION: "convolutions"}
IMAGE_SIZE = 224  # every study checkpoint's pretrained_cfg input_size (fixed_input_size)
CALIBRATION_BATCH = 16  # images per calibration forward; max calibration does not depend on it
CONV_OPS = re.compile(r"conv(\dd|olution|_depthwise)")  # aten::conv2d, aten::mkldnn_convolution, ...
ATTENTION_OPS = re.compile(r"scaled_dot_product")  # aten::_scaled_dot_product_{flash,efficient,cudnn}_attention


@register("timm_xcit")
class TimmXcit:
    """Adapter: a timm XCiT classifier as one static `main` engine per image size and batch."""

    kernel_groups = KERNEL_GROUPS
    metrics_schema = base.metrics_schema({"stress_inputs": base.COUNT})
    seeds = ("stress",)
    regions = REGIONS
    # GPU kernels that no recognised op launched (compiled code, TensorRT), by name; first match wins.
    kernel_patterns = [("FP8 GEMMs", r"(e4m3|fp8|f8f8|qqtst)"),
                       ("convolutions", r"(conv|fprop|depthwise|dgrad)"),
                       ("attention", r"(fmha|flash|attention|softmax|sdpa)"),
                       ("fp16 GEMMs", r"(gemm|hmma|xmma|cutlass|nvjet|triton_tem_.*mm)")]

    # --- configuration -------------------------------------------------------------------
    @staticmethod
    def hf_config(architecture: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's timm config.json (architecture, num_classes, model_args, pretrained_cfg)."""
        return {k: v for k, v in architecture.items() if k not in ("model_type", "source")}

    def quantizable_layers(self, architecture: dict[str, Any]) -> list[str]:
        """Linear layers of the graph module (timm's names), built on the meta device."""
        with torch.device("meta"):
            graph = Classifier(timm_model(self.hf_config(architecture)))
        return [n for n, m in graph.named_modules() if isinstance(m, nn.Linear)]

    @staticmethod
    def check_setting(setting: base.Setting) -> list[str]:
        shape = dict(setting.shape)
        if set(shape) != {"height", "width"}:
            return [f"setting {setting.name}: an XCiT setting's shape is {{height, width}}, not {sorted(shape)}"]
        problems = []
        if (shape["height"], shape["width"]) != (IMAGE_SIZE, IMAGE_SIZE):
            problems.append(f"setting {setting.name}: the XCiT checkpoints take {IMAGE_SIZE} x {IMAGE_SIZE} images "
                            f"(their pretrained_cfg input size, fixed_input_size), not {shape['height']} x "
                            f"{shape['width']}; 384 px configs were not part of the study")
        if setting.batch < 1:
            problems.append(f"setting {setting.name}: batch must be at least 1, not {setting.batch}")
        return problems

    # --- loading -------------------------------------------------------------------------
    @staticmethod
    def load_reference(checkpoint: str | Path, dtype: Any = torch.float32) -> nn.Module:
        """The timm model of the checkpoint folder (config.json + model.safetensors), in `dtype`, eval mode.

        Built with pretrained=False and loaded with safetensors: nothing is downloaded. The
        checkpoint goes through timm's XCiT filter, as timm's own pretrained loading does (it
        renames official keys and splits a class-attention qkv; timm-format weights pass as they are).
        """
        from safetensors.torch import load_file
        from timm.models.xcit import checkpoint_filter_fn

        folder = Path(checkpoint)
        model = timm_model(json.loads((folder / "config.json").read_text()))
        model.load_state_dict(checkpoint_filter_fn(load_file(folder / "model.safetensors"), model))
        return model.to(dtype).eval()

    @staticmethod
    def processor(checkpoint: str | Path):
        """The eval transform of the checkpoint's pretrained_cfg (resize, center crop, ImageNet mean / std):
        a PIL image -> [3, H, W] float32."""
        from timm.data import create_transform, resolve_data_config

        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
        return create_transform(**resolve_data_config(pretrained_cfg=cfg["pretrained_cfg"]), is_training=False)

    # --- graphs --------------------------------------------------------------------------
    @staticmethod
    def graphs(setting: base.Setting, architecture: dict[str, Any]) -> dict[str, base.Graph]:
        """One static engine: the image batch in, the logits out (alike for every architecture)."""
        shape = (setting.batch, 3, setting["height"], setting["width"])
        return {"main": base.Graph("main", {"pixel_values": base.TensorSpec("float32", shape)}, ("logits",))}

    def module(self, checkpoint: str | Path, graph: str = "main", setting: base.Setting | None = None) -> Classifier:
        """The fp32 classifier of the checkpoint (the same module for every setting)."""
        if graph != "main":
            raise KeyError(f"timm_xcit has one graph, main, not {graph!r}")
        return Classifier(self.load_reference(checkpoint, torch.float32)).eval()

    def example_inputs(self, checkpoint: str | Path, graph: str, setting: base.Setting) -> base.Inputs:
        """Seeded uniform-noise images through the checkpoint's eval transform, one per batch row."""
        from PIL import Image

        g = torch.Generator().manual_seed(0)
        size = (setting["height"], setting["width"], 3)
        images = [Image.fromarray(torch.randint(0, 256, size, generator=g, dtype=torch.uint8).numpy())
                  for _ in range(setting.batch)]
        return {"pixel_values": pixel_values(self.processor(checkpoint), images)}

    # --- samples and inputs ----------------------------------------------------------------
    @staticmethod
    def draw_samples(rows, spec: dict[str, Any], processor: Any) -> list[dict[str, Any]]:
        """Images of a WebDataset split (a `datasets` webdataset Dataset), in a seeded order.

        kind images: the rows base.seeded_rows picks (the study's calibration, held-out and extra
        held-out sets are disjoint). A sample: {"id": the WebDataset
        key, "label": the .cls class, "sha256": of the image bytes, "shard": the tar file in the
        pinned snapshot, "member": the image's name in it}.
        """
        from datasets import Image

        if spec["kind"] != "images":
            raise ValueError(f"timm_xcit draws images, not {spec['kind']!r}")
        picked = base.seeded_rows(len(rows), spec)
        # The image bytes as stored (no decoding): their hash is the sample's content hash.
        for ext in sorted(set(IMAGE_EXTENSIONS) & set(rows.column_names)):
            rows = rows.cast_column(ext, Image(decode=False))
        samples = []
        for i in picked:
            row = rows[i]
            ext = image_column(row)
            data = row[ext]["bytes"]
            samples.append({"id": row["__key__"], "label": int(row["cls"]), "sha256": sha256_hex(data),
                            "shard": row["__url__"], "member": f"{row['__key__']}.{ext}"})
        return samples

    @staticmethod
    def content_sha256(samples: list[dict[str, Any]]) -> list[str]:
        return [sha256_hex(data) for data in image_bytes(samples)]

    def calibration_batches(self, checkpoint: str | Path, samples: list[dict[str, Any]],
                            setting: base.Setting) -> list[base.Inputs]:
        """The images through the checkpoint's eval transform, in batches of CALIBRATION_BATCH."""
        transform = self.processor(checkpoint)
        return [{"pixel_values": pixel_values(transform, load_images(samples[i:i + CALIBRATION_BATCH]))}
                for i in range(0, len(samples), CALIBRATION_BATCH)]

    @staticmethod
    def stress_inputs(count: int, seed: int, size: int = IMAGE_SIZE) -> dict[str, Any]:
        """Images that push activations to their extremes (fp16 range, FP8 scales): saturated,
        black, gray, pure colours, high-contrast patterns at and around the patch size, noise.

        Returns {"images": RGB PIL images of size x size, "kinds": their kinds}; the caller puts
        them through the checkpoint's eval transform (`pixel_values`). Kinds cycle; noise and
        colour draws differ per image (seeded).
        """
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(seed)
        y, x = np.mgrid[0:size, 0:size]
        full = lambda v: np.broadcast_to(np.asarray(v, dtype=np.uint8), (size, size, 3))
        gray = lambda v: np.repeat(np.asarray(v, dtype=np.uint8)[..., None], 3, axis=2)
        binary = lambda mask: gray(mask * 255)
        centre = lambda r: (abs(x - size // 2) < r) & (abs(y - size // 2) < r)
        kinds = {
            "saturated white": lambda: full(255),
            "black": lambda: full(0),
            "constant gray": lambda: full(128),
            "saturated red": lambda: full([255, 0, 0]),
            "saturated green": lambda: full([0, 255, 0]),
            "saturated blue": lambda: full([0, 0, 255]),
            "checkerboard 1 px": lambda: binary((x + y) % 2),
            "checkerboard 8 px": lambda: binary((x // 8 + y // 8) % 2),
            "checkerboard 16 px (patch-aligned)": lambda: binary((x // 16 + y // 16) % 2),
            "vertical stripes 2 px": lambda: binary((x // 2) % 2),
            "horizontal stripes 4 px": lambda: binary((y // 4) % 2),
            "red / cyan checkerboard": lambda: np.where(((x // 4 + y // 4) % 2)[..., None] == 1,
                                                        full([255, 0, 0]), full([0, 255, 255])),
            "uniform noise": lambda: rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "salt and pepper": lambda: binary(rng.random((size, size)) < 0.5),
            "horizontal gradient": lambda: gray(x * 255 // (size - 1)),
            "one white pixel on black": lambda: binary(centre(1)),
            "white square on black": lambda: binary(centre(size // 8)),
            "random solid colour": lambda: full(rng.integers(0, 256, 3)),
        }
        names = list(kinds)
        out = [names[i % len(names)] for i in range(count)]
        return {"images": [Image.fromarray(np.ascontiguousarray(kinds[k]())) for k in out], "kinds": out}

    # --- embedded default ----------------------------------------------------------------
    def tiny_checkpoint_files(self, architecture: dict[str, Any], tiny: dict[str, Any]) -> dict[str, bytes]:
        """A random-init timm XCiT (fixed seed) as config.json (timm's hub layout) + model.safetensors.

        Two departures from timm's init, both toward what trained weights look like. The vector
        parameters (norms, biases, layer scales, channel-attention temperatures) are spread
        around their init: timm makes every norm an identity and every layer scale eta, so two
        layers that a wrong wiring swapped would compute alike. The batch norms' running
        statistics are measured on seeded noise images, as training sets them: with timm's
        (0, 1) the convolutional stem's output all but vanishes next to the positional
        encoding, and the logits hardly depend on the image.
        """
        from safetensors.torch import save

        torch.manual_seed(tiny["seed"])
        cfg = self.hf_config(architecture)
        model = timm_model(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 or name.endswith("temperature"):
                    p.mul_(1 + 0.2 * torch.randn_like(p)).add_(0.05 * torch.randn_like(p))
            for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
                bn.reset_running_stats()
                bn.momentum = None  # a plain average over the batch
            images = torch.rand(8, *cfg["pretrained_cfg"]["input_size"]) * 4 - 2  # the normalized range
            model.train()(images)
        state = {k: v.contiguous() for k, v in model.eval().state_dict().items()}
        return {"config.json": json.dumps(cfg, indent=1, sort_keys=True).encode(),
                "model.safetensors": save(state, metadata={"format": "pt"})}

    @staticmethod
    def tiny_dataset_files(files: dict[str, str], tiny: dict[str, Any],
                           architecture: dict[str, Any]) -> dict[str, bytes]:
        """WebDataset tar shards of real photographs (scikit-image's), one seeded view per sample.

        Each split's pattern names its shards (`test/*.tar` -> test/0.tar, test/1.tar, ...). A
        sample is `<key>.webp` (a jittered crop of one photograph) and `<key>.cls` (the photo's
        index modulo the model's classes), keys s0000000, s0000001, ... as in wds_imagenet1k.
        `short_side: [lo, hi]` makes the views smaller than ImageNet's 160 to 320 px (a dataset of
        thousands of rows that must stay a few MiB); the eval transform resizes them to 224 anyway.
        """
        from quantstudy import fixtures

        rows, shards = tiny.get("rows", 40), tiny.get("shards", 2)
        short_side = tuple(tiny.get("short_side", (160, 320)))
        classes = architecture["num_classes"]
        photos = [fixtures.photo(name) for name in fixtures.PHOTOS]
        out, key = {}, 0
        for s, (split, pattern) in enumerate(sorted(files.items())):
            rng = random.Random(tiny["seed"] * 1000 + s)
            per_shard = -(-rows // shards)
            for shard in range(shards):
                members = {}
                for _ in range(min(per_shard, rows - shard * per_shard)):
                    p = rng.randrange(len(photos))
                    buf = io.BytesIO()
                    fixtures.jittered(photos[p], rng, short_side).save(buf, format="WEBP", quality=90)
                    members[f"s{key:07d}.webp"] = buf.getvalue()
                    members[f"s{key:07d}.cls"] = str(p % classes).encode()
                    key += 1
                out[pattern.replace("*", str(shard)) if "*" in pattern else pattern] = tar_bytes(members)
        return out

    # --- measurements --------------------------------------------------------------------
    def reference(self, checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]], setting: base.Setting,
                  metrics: dict[str, Any], seeds: dict[str, int], device: str, dtype: Any = torch.float32):
        """The timm model's logits (in `dtype`, fp32 for this study) on each evaluation set, with the
        sets' labels, and its own top-1 accuracy per set.

        Tensors: `<set>_logits` [images, classes] float32 and `<set>_labels` [images] int64, for
        every set the study's evaluation_samples name (the held-out and extra held-out images).
        """
        from quantstudy import metrics as qm

        model, transform = self.load_reference(checkpoint, dtype).to(device), self.processor(checkpoint)
        forward = lambda x, what="": {"logits": model(x["pixel_values"].to(device, dtype))}
        tensors, blocks = {}, {}
        for name, rows in samples.items():
            logits = engine_logits(forward, transform, rows, 1, name)
            labels = torch.tensor([s["label"] for s in rows], dtype=torch.int64)
            log.info("reference on %s: %d images", name, len(rows))
            tensors[f"{name}_logits"], tensors[f"{name}_labels"] = logits, labels
            blocks[name] = {"top1_accuracy": qm.top1_accuracy(logits, labels), "images": len(rows)}
        return tensors, blocks

    def evaluate(self, checkpoint: str | Path, run: base.Run, reference: dict[str, torch.Tensor],
                 samples: dict[str, list[dict[str, Any]]], setting: base.Setting, metrics: dict[str, Any],
                 seeds: dict[str, int], device: str, against: Any = None) -> base.Evaluation:
        """Top-1 agreement of the engine with the fp32 reference, the mean KL from it, and top-1 accuracy
        against the labels, per evaluation set; the non-finite scan over those sets and `metrics.stress_inputs` stress
        images. Against another variant's engine (`quality_against`): top-1 agreement with it, per set.
        """
        from quantstudy import metrics as qm

        transform, batch = self.processor(checkpoint), setting.batch
        blocks, nonfinite = {}, {}
        for name, rows in samples.items():
            logits = engine_logits(run, transform, rows, batch, name)
            ref = reference[f"{name}_logits"]
            blocks[name] = {**qm.top1_agreement(ref, logits), **qm.logit_kl(ref, logits),
                            "top1_accuracy": qm.top1_accuracy(logits, reference[f"{name}_labels"])}
            nonfinite[name] = {"bad": qm.nonfinite_rows(logits), "of": logits.shape[0]}
            for other_name, other in (against or {}).items():
                theirs = engine_logits(other, transform, rows, batch, f"{name} on {other_name}")
                blocks[base.against_block(name, other_name)] = qm.top1_agreement(theirs, logits)
        stress = self.stress_inputs(metrics["stress_inputs"], seeds["stress"])
        x = pixel_values(transform, stress["images"])
        out = run({"pixel_values": whole_batches(x, batch)}, "stress inputs")["logits"][:len(x)].float()
        nonfinite["stress"] = {"bad": qm.nonfinite_rows(out), "of": out.shape[0], "kinds": sorted(set(stress["kinds"]))}
        return base.Evaluation(blocks, nonfinite)

    def quality_columns(self, evaluation_samples: list[str], against: list[str]) -> base.QualityColumns:
        from quantstudy import metrics as qm

        return base.QualityColumns(
            blocks={**{s: (*qm.TOP1_AGREEMENT, *qm.LOGIT_KL, "top1_accuracy") for s in evaluation_samples},
                    **{base.against_block(s, v): qm.TOP1_AGREEMENT for s in evaluation_samples for v in against}},
            nonfinite=(*evaluation_samples, "stress"),
            reference={s: ("top1_accuracy", "images") for s in evaluation_samples})

    @staticmethod
    def kernel_group(region: str | None, name: str, device: str, op: dict[str, Any] | None,
                     setting: base.Setting | None = None) -> str:
        """The group of a profiled CPU op or GPU kernel.

        By region where the eager model marks one (FP8 layers, attention cores, convolutions).
        Otherwise by the op (a GPU kernel: the op that launched it): torch._scaled_mm is an FP8
        GEMM; a convolution op is a convolution; a GEMM of two activations (both operands of
        rank 3 or more), or scaled dot-product attention, is attention; other GEMMs (a rank-2
        weight) are fp16 linears. Compiled code and exported graphs keep no regions, hence the ops
        and then the kernel names.
        """
        op_name = kernel_kinds.launching_op(name, device, op)
        if kernel_kinds.in_fp8_gemm(region, op_name):
            return "FP8 GEMMs"
        if region in REGIONS:
            return REGIONS[region]
        if op_name and CONV_OPS.search(op_name):
            return "convolutions"
        if op_name in kernel_kinds.GEMM_OPS:
            return "attention" if kernel_kinds.gemm_of_activations(op) else "fp16 GEMMs"
        if op_name and ATTENTION_OPS.search(op_name):  # the fused class attention, whichever kernel runs it
            return "attention"
        return "other" if device == "cpu" else kernel_kinds.group_by_name(name, TimmXcit.kernel_patterns)

    @staticmethod
    def transforms() -> dict[str, Any]:
        return {}
