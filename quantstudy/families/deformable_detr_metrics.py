"""Deformable DETR's quality: COCO box AP of a detector's top detections (metrics.coco_box_ap), its
bootstrap interval, and an engine's agreement with another detector, categories mapped to the
detector's label ids by name.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch

from quantstudy.families.deformable_detr_data import file_names


def category_map(checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    """Category name -> the detector's label id, by name, for every name the sample files record."""
    from transformers import AutoConfig

    from quantstudy import metrics as qm

    names = sorted({n for rows in samples.values() for n in _file_names_of(rows)})
    by_index = qm.category_map(AutoConfig.from_pretrained(str(checkpoint)).id2label, names)
    return {name: by_index[i] for i, name in enumerate(names)}


def _file_names_of(samples: list[dict[str, Any]]) -> list[str]:
    return [n for f in sorted({s["file"] for s in samples}) for n in file_names(f)]


def detections(logits: torch.Tensor, boxes: torch.Tensor, truth: list[dict[str, Any]],
               labels: dict[str, int]) -> list[list[dict[str, Any]]]:
    """Each image's top_detections over the dataset's categories, in pixels of the original image
    (its size from its ground truth)."""
    from quantstudy import metrics as qm

    keep = set(labels.values())
    return [qm.top_detections(lg, bx, t["width"], t["height"], keep)
            for lg, bx, t in zip(logits, boxes, truth, strict=True)]


def box_ap(detections: list[list[dict[str, Any]]], samples: list[dict[str, Any]], truth: list[dict[str, Any]],
           labels: dict[str, int]) -> dict[str, Any]:
    """COCO box AP (metrics.coco_box_ap, faster-coco-eval) of a detector's detections (detections) on
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
