"""Deformable DETR's samples: COCO-layout parquet images with their boxes, read back and checked
against their sha256, decoded and fed to a detector; and the tiny dataset in that layout.

The adapter (quantstudy.families.deformable_detr) draws the samples and calls these; the AP of
what the detector finds is in deformable_detr_metrics.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from typing import Any

import torch

from quantstudy.families import base

EVAL_CHUNK = 16  # images decoded and run at a time


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_bytes(samples: list[dict[str, Any]]) -> list[bytes]:
    """Each sample's image bytes as stored in its parquet file (each file's image column read once)."""
    import pyarrow.parquet as pq

    columns: dict[str, Any] = {}
    for s in samples:
        if s["file"] not in columns:
            columns[s["file"]] = pq.read_table(s["file"], columns=["image"]).column("image")
    return [columns[s["file"]][s["row"]].as_py()["bytes"] for s in samples]


def file_names(path: str) -> list[str]:
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


def row_truth(row: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """One image's ground truth as the dataset stores it: its size and each box (as stored, in the
    dataset's box format) with its category's name."""
    objects = row["objects"]
    return {"width": int(row["width"]), "height": int(row["height"]),
            "objects": [{"category": names[c], "bbox": [float(v) for v in box]}
                        for c, box in zip(objects["category"], objects["bbox"], strict=True)]}


def sample_sha(image: bytes, truth: dict[str, Any]) -> str:
    return _sha(image + b"\n" + json.dumps(truth, sort_keys=True).encode())


def file_truth(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each sample's ground truth read from its parquet file (each file's columns read once)."""
    import pyarrow.parquet as pq

    files: dict[str, tuple[Any, list[str]]] = {}
    for s in samples:
        if s["file"] not in files:
            files[s["file"]] = (pq.read_table(s["file"], columns=["objects", "width", "height"]), file_names(s["file"]))
    out = []
    for s in samples:
        table, names = files[s["file"]]
        out.append(row_truth({k: table.column(k)[s["row"]].as_py() for k in ("objects", "width", "height")}, names))
    return out


def checked_samples(samples: list[dict[str, Any]]) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Each sample's image bytes as stored and its ground truth, boxes in COCO's [x, y, width, height],
    both read from its file and checked together against the sample's sha256."""
    from quantstudy import metrics as qm

    images, truths = [], []
    for s, data, truth in zip(samples, image_bytes(samples), file_truth(samples)):
        if sample_sha(data, truth) != s["sha256"]:
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


def load_images(samples: list[dict[str, Any]]) -> list:
    """The samples' images (RGB PIL), read from their files and checked with their ground truth against
    their sha256 (checked_samples)."""
    return _decoded(checked_samples(samples)[0])


def tiny_dataset(files: dict[str, str], tiny: dict[str, Any],
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
