"""Quality metrics of an engine's features against the PyTorch fp32 reference.

The module stays whole (about 400 lines): it is a flat library of small functions, each standing
alone, grouped below by the kind of model they measure (encoders, image classifiers, token features,
causal language models, detectors). The block-key tuples at the top are every column name a family
declares and a study's decision may name; kept in one module with the functions that return them,
they are one place to look up, which a split by kind would scatter.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from quantstudy import compare


# The scalar keys of each metric's block, as the functions below return them: what families declare as
# their quality table's columns (Family.quality_columns), the names a study's decision may use.
MLM_AGREEMENT = ("kl_mean", "kl_p99", "top1_agreement", "tokens", "nonfinite_tokens")
CLS_AGREEMENT = ("cosine_mean", "cosine_min", "relative_error", "rows")
QUALITY_BAR = ("max_relative_l2", "sentences", "passed", "failed")
TOP1_AGREEMENT = ("top1_agreement", "rows", "disagree")
LOGIT_KL = ("kl_mean",)
TOKEN_RELATIVE_ERROR = ("mean", "max", "texts", "nonfinite_texts")
HEAD_AGREEMENT = ("agreement", "accuracy", "reference_accuracy", "accuracy_diff_points", "pairs", "nonfinite_pairs")
TOKEN_COSINE = ("min", "mean", "tokens", "nonfinite_tokens")
NEXT_TOKEN_AGREEMENT = (*MLM_AGREEMENT, "perplexity")
MULTIPLE_CHOICE = ("accuracy", "questions", "nonfinite_questions")  # + agreement_with_reference, given one
COCO_BOX_AP = ("images", "annotations", "detections", "evaluator", "ap", "ap50", "ap75")
DETECTION_AGREEMENT = ("precision", "recall", "matched", "engine_detections", "reference_detections",
                       "score_threshold", "iou_threshold")


def interval_record(low: float, high: float, n: int, unit: str, method: str = "bootstrap") -> dict[str, Any]:
    """How a quality block keeps a metric's interval, under "intervals" beside its scalars:
    {metric: {low, high, n, unit, method, level}} (the verdict's level)."""
    return {"low": low, "high": high, "n": n, "unit": unit, "method": method, "level": compare.VERDICT_LEVEL}


def mean_interval(values: torch.Tensor | list[float], clusters: torch.Tensor | list[int] | None = None,
                  unit: str = "tokens", transform=None) -> dict[str, Any]:
    """A metric's interval where it is a mean over units (compare.mean_interval, a bootstrap at the verdict's
    level): over whole clusters where given (`unit` names what a cluster is: the texts a token came from),
    else over single values; `transform` maps the mean's ends (exp for perplexity)."""
    values = torch.as_tensor(values, dtype=torch.float64).numpy()
    ids = None if clusters is None else torch.as_tensor(clusters).numpy()
    low, high = compare.mean_interval(values, ids)
    if transform is not None:
        low, high = transform(low), transform(high)
    return interval_record(low, high, len(values) if ids is None else len(np.unique(ids)), unit)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Mask of rows (first axis) whose values are all finite."""
    return torch.isfinite(x.flatten(1)).all(dim=1)


def kl_rows(ref_logits: torch.Tensor, eng_logits: torch.Tensor) -> torch.Tensor:
    """Per row, KL(PyTorch || engine) of the softmax distributions of the last axis, in float64."""
    ref, eng = ref_logits.double(), eng_logits.double()
    return F.kl_div(F.log_softmax(eng, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)


def mlm_agreement(ref_logits: torch.Tensor, eng_logits: torch.Tensor, texts: torch.Tensor | None = None,
                  unit: str = "texts") -> dict[str, Any]:
    """KL(PyTorch || engine) per masked token (mean, p99) and top-1 agreement, over finite tokens; the
    mean KL's interval over the `texts` the tokens came from (one id per token; `unit` says what a text
    is), or over tokens."""
    ok = finite_rows(eng_logits)
    if not ok.any():
        return {"kl_mean": None, "kl_p99": None, "top1_agreement": None, "tokens": 0,
                "nonfinite_tokens": int((~ok).sum())}
    ref, eng = ref_logits[ok].double(), eng_logits[ok].double()
    kl = kl_rows(ref, eng)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
            "top1_agreement": float((ref.argmax(-1) == eng.argmax(-1)).double().mean()),
            "tokens": int(ok.sum()), "nonfinite_tokens": int((~ok).sum()),
            "intervals": {"kl_mean": mean_interval(kl, None if texts is None else texts[ok],
                                                   "tokens" if texts is None else unit)}}


def cls_agreement(ref_cls: torch.Tensor, eng_cls: torch.Tensor) -> dict[str, Any]:
    """Cosine (mean, min) and relative L2 error of CLS features, over finite rows."""
    ok = finite_rows(eng_cls)
    if not ok.any():
        return {"cosine_mean": None, "cosine_min": None, "relative_error": None, "rows": 0}
    ref, eng = ref_cls[ok].double(), eng_cls[ok].double()
    cos = F.cosine_similarity(ref, eng, dim=-1)
    rel = (eng - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "relative_error": float(rel.mean()), "rows": int(ok.sum()),
            "intervals": {"cosine_mean": mean_interval(cos, unit="rows"),
                          "relative_error": mean_interval(rel, unit="rows")}}


def relative_l2(ref: torch.Tensor, eng: torch.Tensor) -> torch.Tensor:
    """Per-row ||eng - ref|| / ||ref||; a non-finite row counts as infinite error."""
    rel = (eng.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    return torch.where(torch.isfinite(rel), rel, torch.full_like(rel, math.inf))


def quality_bar(ref_cls: torch.Tensor, eng_cls: torch.Tensor, max_relative_l2: float) -> dict[str, Any]:
    rel = relative_l2(ref_cls, eng_cls)
    passed = int((rel <= max_relative_l2).sum())
    return {"max_relative_l2": max_relative_l2, "sentences": int(rel.numel()), "passed": passed,
            "failed": int(rel.numel()) - passed}


def sts_spearman(cls_first: torch.Tensor, cls_second: torch.Tensor, gold: list[float]) -> float | None:
    """Spearman rank correlation (scipy) of CLS cosine similarity with the gold STS scores."""
    from scipy.stats import spearmanr

    cos = F.cosine_similarity(cls_first.double(), cls_second.double(), dim=-1).numpy()
    if not np.isfinite(cos).all():
        return None
    return float(spearmanr(cos, np.asarray(gold)).statistic)


# --- image classifiers: top-1 against the reference and the labels ---------------------------

def nonfinite_rows(x: torch.Tensor) -> int:
    """How many rows (first axis) hold a NaN or an infinity."""
    return int((~finite_rows(x)).sum())


def top1_agreement(ref_logits: torch.Tensor, eng_logits: torch.Tensor) -> dict[str, Any]:
    """Share of rows whose top class is the reference's. A non-finite engine row counts as a
    disagreement: a NaN output is a wrong answer to whoever reads the engine's top class."""
    if ref_logits.shape != eng_logits.shape:
        raise ValueError(f"reference logits {tuple(ref_logits.shape)} and engine logits {tuple(eng_logits.shape)} "
                         "differ in shape")
    if ref_logits.shape[0] == 0:
        return {"top1_agreement": None, "rows": 0, "disagree": 0}
    same = (ref_logits.argmax(-1) == eng_logits.argmax(-1)) & finite_rows(eng_logits)
    return {"top1_agreement": float(same.double().mean()), "rows": int(same.numel()),
            "disagree": int((~same).sum())}


def logit_kl(ref_logits: torch.Tensor, eng_logits: torch.Tensor, unit: str = "images") -> dict[str, Any]:
    """Mean KL(PyTorch || engine) of the class distributions over the finite rows, and its interval over
    rows: beside top-1 agreement, which counts near-ties that flip (random weights have many) and not how
    far the engine's outputs moved."""
    ok = finite_rows(eng_logits)
    if not ok.any():
        return {"kl_mean": None}
    kl = kl_rows(ref_logits[ok], eng_logits[ok])
    return {"kl_mean": float(kl.mean()), "intervals": {"kl_mean": mean_interval(kl, unit=unit)}}


def top1_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Share of rows whose top class is the label (a non-finite row counts as wrong)."""
    if logits.shape[0] == 0:
        return None
    right = (logits.argmax(-1) == labels.to(logits.device)) & finite_rows(logits)
    return float(right.double().mean())

# --- token-feature encoders with a classification head check (DeBERTa study) -----------------

def token_relative_error(ref: torch.Tensor, eng: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Token feature relative error of each text over its real tokens, summarized over the texts.

    For text i with real-token rows T_i (mask 1; padding left out), e_i = ||E_i - R_i||_F / ||R_i||_F,
    with E the engine's and R the reference's features [rows, tokens, hidden], in float64. Reports
    the mean and max of e_i over the texts whose engine features are all finite there; the others
    are counted (`nonfinite_texts`) and left out, as the non-finite scan reports them.
    """
    real = mask.bool()
    errors, bad = [], 0
    for r, e, m in zip(ref, eng, real):
        r, e = r[m].double(), e[m].double()
        if not torch.isfinite(e).all():
            bad += 1
            continue
        errors.append(float((e - r).norm() / r.norm()))
    if not errors:
        return {"mean": None, "max": None, "texts": 0, "nonfinite_texts": bad}
    return {"mean": sum(errors) / len(errors), "max": max(errors), "texts": len(errors), "nonfinite_texts": bad,
            "intervals": {"mean": mean_interval(errors, unit="texts")}}


def label_map(id2label: dict[Any, str], label_names: list[str]) -> list[int]:
    """A head's class index -> the dataset's label index, matched by name (case-insensitive), so a
    checkpoint that orders its classes differently from the dataset is scored right."""
    names = [n.lower() for n in label_names]
    heads = {int(i): str(n).lower() for i, n in id2label.items()}
    missing = sorted(n for n in heads.values() if n not in names)
    if missing or sorted(heads) != list(range(len(heads))):
        raise ValueError(f"the head's labels {sorted(heads.values())} are not the dataset's {label_names}")
    return [names.index(heads[i]) for i in range(len(heads))]


def head_agreement(ref_logits: torch.Tensor, eng_logits: torch.Tensor, gold: torch.Tensor,
                   to_label: list[int]) -> dict[str, Any]:
    """Agreement of the head's top class on the engine's features with the PyTorch fp32 model's, and
    the accuracy difference against the gold labels in points (engine - PyTorch).

    Head classes are mapped to dataset labels through `to_label` (label_map). A pair whose engine
    logits are not all finite disagrees and is wrong (counted in `nonfinite_pairs`).
    """
    mapping = torch.tensor(to_label)
    ok = finite_rows(eng_logits)
    ref_pred = mapping[ref_logits.argmax(-1)]
    eng_pred = torch.where(ok, mapping[torch.nan_to_num(eng_logits).argmax(-1)], torch.full_like(ref_pred, -1))
    ref_acc, eng_acc = float((ref_pred == gold).double().mean()), float((eng_pred == gold).double().mean())
    return {"agreement": float((eng_pred == ref_pred).double().mean()), "accuracy": eng_acc,
            "reference_accuracy": ref_acc, "accuracy_diff_points": 100 * (eng_acc - ref_acc),
            "pairs": int(gold.numel()), "nonfinite_pairs": int((~ok).sum())}


def token_cosine(ref: torch.Tensor, eng: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Cosine of engine and reference features per real token (mask 1), min and mean over all of
    them; a token with non-finite engine features counts as cosine -1 (the worst), and is counted."""
    real = mask.bool()
    r, e = ref[real].double(), eng[real].double()
    ok = torch.isfinite(e).all(-1)
    cos = torch.where(ok, F.cosine_similarity(r, torch.nan_to_num(e), dim=-1), torch.full((len(r),), -1.0,
                                                                                           dtype=torch.float64))
    texts = torch.arange(real.shape[0])[:, None].expand_as(real)[real]  # the text each real token is in
    return {"min": float(cos.min()), "mean": float(cos.mean()), "tokens": int(len(cos)),
            "nonfinite_tokens": int((~ok).sum()), "intervals": {"mean": mean_interval(cos, texts, "texts")}}


def real_rows_finite(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mask of rows whose real tokens (mask 1) are all finite: what a user of the features reads
    (padded positions are masked out of attention and never read)."""
    real = mask.bool().unsqueeze(-1).expand_as(x) if x.dim() == mask.dim() + 1 else mask.bool()
    return (torch.isfinite(x) | ~real).flatten(1).all(dim=1)


# --- causal language models: next-token agreement, perplexity, multiple choice (GPT-Neo study) ---

def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """The negative log-likelihood of each of `targets` [tokens] under `logits` [tokens, vocab], in float64;
    None where any row is non-finite (the non-finite scan counts those)."""
    if logits.shape[0] == 0 or not finite_rows(logits).all():
        return None
    return F.cross_entropy(logits.double(), targets.long(), reduction="none")


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float | None:
    """exp of the mean negative log-likelihood of `targets` under `logits` (token_nll)."""
    nll = token_nll(logits, targets)
    return None if nll is None else float(torch.exp(nll.mean()))


def next_token_agreement(ref_logits: torch.Tensor, eng_logits: torch.Tensor, targets: torch.Tensor,
                         texts: torch.Tensor | None = None, unit: str = "texts") -> dict[str, Any]:
    """Teacher-forced next-token quality of an engine against the reference, token by token: KL(reference ||
    engine) (mean, p99) and top-1 agreement over the tokens whose engine logits are finite, and the
    engine's perplexity of the targets; the intervals of mean KL and of perplexity over the `texts` the
    tokens came from (one id per token)."""
    out = mlm_agreement(ref_logits, eng_logits, texts, unit)
    nll = token_nll(eng_logits, targets)
    out["perplexity"] = None if nll is None else float(torch.exp(nll.mean()))
    if nll is not None:
        out.setdefault("intervals", {})["perplexity"] = mean_interval(
            nll, texts, "tokens" if texts is None else unit, transform=math.exp)
    return out


def continuation_loglik(logits: torch.Tensor, ids: torch.Tensor, start: int, end: int) -> float:
    """Log-likelihood of the tokens ids[start:end] of one row given the tokens before each:
    sum over j of log_softmax(logits[j - 1])[ids[j]], in float64 (logits [tokens, vocab], ids [tokens])."""
    if not 0 < start < end <= ids.shape[0]:
        raise ValueError(f"a continuation [{start}, {end}) needs a context before it within {ids.shape[0]} tokens")
    logp = F.log_softmax(logits[start - 1:end - 1].double(), dim=-1)
    return float(logp.gather(1, ids[start:end].long().to(logp.device)[:, None]).sum())


def chosen(scores: list[list[float]]) -> list[int]:
    """Per question, the index of the highest-scoring choice (the first of a tie); -1 where a score is
    non-finite."""
    return [max(range(len(s)), key=lambda i: (s[i], -i)) if all(math.isfinite(v) for v in s) else -1
            for s in scores]


def multiple_choice(scores: list[list[float]], answers: list[int],
                    reference_choices: list[int] | None = None) -> dict[str, Any]:
    """Accuracy of the highest-scoring choice per question (`chosen`); a question with a non-finite score
    counts as wrong, and is counted. With `reference_choices`: the share of questions where the choice
    is the reference's."""
    if not scores:
        return {"accuracy": None, "questions": 0, "nonfinite_questions": 0}
    picks = chosen(scores)
    out = {"accuracy": sum(c == a for c, a in zip(picks, answers)) / len(scores), "questions": len(scores),
           "nonfinite_questions": picks.count(-1)}
    if reference_choices is not None:
        out["agreement_with_reference"] = sum(c == r for c, r in zip(picks, reference_choices)) / len(scores)
    return out


# --- detectors: COCO box AP with a maintained evaluator (Deformable DETR study) ----------------

COCO_EVALUATORS = ("faster_coco_eval", "pycocotools")


def coco_box_ap(images: list[dict[str, Any]], annotations: list[dict[str, Any]], detections: list[dict[str, Any]],
                categories: list[dict[str, Any]], evaluator: str = "faster_coco_eval") -> dict[str, Any]:
    """COCO box AP of `detections` against the ground truth, computed by a maintained evaluator
    (faster-coco-eval, or pycocotools to cross-check it): AP over IoU 0.50:0.95, AP50 and AP75, all
    areas, up to 100 detections an image. COCO's layout throughout, boxes [x, y, width, height] in pixels:
    images {id, width, height}; annotations {image_id, category_id, bbox, area, iscrowd}; detections
    {image_id, category_id, bbox, score}; categories {id, name}. No detection at all gives AP 0 (the
    evaluators refuse an empty result list)."""
    if evaluator not in COCO_EVALUATORS:
        raise ValueError(f"evaluator is one of {', '.join(COCO_EVALUATORS)}, not {evaluator!r}")
    out = {"images": len(images), "annotations": len(annotations), "detections": len(detections),
           "evaluator": evaluator}
    if not detections:
        return {**out, "ap": 0.0, "ap50": 0.0, "ap75": 0.0}
    truth = {"images": [dict(i) for i in images], "categories": [dict(c) for c in categories],
             "annotations": [{**a, "id": n + 1} for n, a in enumerate(annotations)]}
    if evaluator == "faster_coco_eval":
        from faster_coco_eval import COCO, COCOeval_faster as COCOeval
        gt = COCO(truth)
    else:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
        gt = COCO()
        gt.dataset = truth
        gt.createIndex()
    dt = gt.loadRes([dict(d) for d in detections])
    ev = COCOeval(gt, dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    ap, ap50, ap75 = (float(v) for v in ev.stats[:3])
    return {**out, "ap": ap, "ap50": ap50, "ap75": ap75}


BOX_FORMATS = {"xywh": "[x, y, width, height] (COCO's)", "xyxy": "[x_min, y_min, x_max, y_max] (Pascal VOC's)"}


def box_problems(box: list[float], width: float, height: float, box_format: str) -> str | None:
    """Why `box` is not a box inside a width x height image in `box_format`, or None. A box may
    touch the border; half a pixel past it is allowed for rounding."""
    if box_format not in BOX_FORMATS:
        raise ValueError(f"box_format is one of {', '.join(BOX_FORMATS)}, not {box_format!r}")
    x0, y0, a, b = (float(v) for v in box)
    x1, y1 = (x0 + a, y0 + b) if box_format == "xywh" else (a, b)
    if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
        return "not finite"
    if x1 < x0 or y1 < y0:
        return "its far corner is left of or above its near corner"
    if x0 < -0.5 or y0 < -0.5 or x1 > width + 0.5 or y1 > height + 0.5:
        return f"it ends outside the {width:g} x {height:g} image"
    return None


def to_xywh(box: list[float], box_format: str) -> list[float]:
    """A box in COCO's [x, y, width, height] from `box_format`."""
    x0, y0, a, b = (float(v) for v in box)
    return [x0, y0, a, b] if box_format == "xywh" else [x0, y0, a - x0, b - y0]


def category_map(id2label: dict[Any, str], dataset_names: list[str]) -> dict[int, int]:
    """The dataset's category index -> the detector's label id, matched by name (case-insensitive):
    a dataset that numbers its categories 0 to 79 is scored against a head with COCO's 91 ids.
    Every dataset category must be one of the head's labels; head labels the dataset lacks (COCO's
    "N/A") are left out."""
    labels: dict[str, int] = {}
    for i, name in id2label.items():
        labels.setdefault(str(name).lower(), int(i))
    missing = [n for n in dataset_names if n.lower() not in labels]
    if missing:
        raise ValueError(f"dataset categories {missing} are not labels of the detector "
                         f"({', '.join(sorted(labels))})")
    return {index: labels[name.lower()] for index, name in enumerate(dataset_names)}


def top_detections(logits: torch.Tensor, boxes: torch.Tensor, width: float, height: float,
                   labels: set[int], k: int = 100) -> list[dict[str, Any]]:
    """One image's detections as Deformable DETR's post-processing makes them: the `k` best
    (query, label) pairs by sigmoid score over all queries and `labels` (the head's other labels,
    e.g. "N/A", are never a detection), each with its query's box, [cx, cy, w, h] relative to the
    input, as COCO's [x, y, width, height] in pixels of the width x height image."""
    scores = logits.float().sigmoid()
    keep = torch.zeros(scores.shape[-1], dtype=torch.bool)
    keep[sorted(labels)] = True
    scores = scores.masked_fill(~keep, -1.0).flatten()
    top = torch.topk(scores, min(k, len(labels) * logits.shape[0]))
    out = []
    for score, index in zip(top.values.tolist(), top.indices.tolist()):
        query, label = divmod(index, logits.shape[-1])
        cx, cy, w, h = boxes[query].float().tolist()
        out.append({"category_id": label, "score": score,
                    "bbox": [(cx - w / 2) * width, (cy - h / 2) * height, w * width, h * height]})
    return out


def box_iou(a: list[float], b: list[float]) -> float:
    """IoU of two [x, y, width, height] boxes."""
    w = min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0])
    h = min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1])
    inter = max(w, 0.0) * max(h, 0.0)
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union > 0 else 0.0


def detection_agreement(reference: list[list[dict[str, Any]]], engine: list[list[dict[str, Any]]],
                        score_threshold: float, iou_threshold: float) -> dict[str, Any]:
    """Precision and recall of one detector's detections against another's (per image lists of
    top_detections): of each side, the detections scoring at least `score_threshold`; an engine
    detection matches the highest-scoring unmatched reference detection of its label with IoU at
    least `iou_threshold`, engine detections taken from the highest score down. Precision: matched /
    engine detections; recall: matched / reference detections (None where a side has none)."""
    matched = n_ref = n_eng = 0
    for ref, eng in zip(reference, engine, strict=True):
        ref = sorted((d for d in ref if d["score"] >= score_threshold), key=lambda d: -d["score"])
        eng = sorted((d for d in eng if d["score"] >= score_threshold), key=lambda d: -d["score"])
        n_ref, n_eng = n_ref + len(ref), n_eng + len(eng)
        free = list(ref)
        for d in eng:
            hit = next((r for r in free if r["category_id"] == d["category_id"]
                        and box_iou(r["bbox"], d["bbox"]) >= iou_threshold), None)
            if hit is not None:
                free.remove(hit)
                matched += 1
    return {"precision": matched / n_eng if n_eng else None, "recall": matched / n_ref if n_ref else None,
            "matched": matched, "engine_detections": n_eng, "reference_detections": n_ref,
            "score_threshold": score_threshold, "iou_threshold": iou_threshold}


def logit_correlation(ref: torch.Tensor, eng: torch.Tensor) -> float | None:
    """Pearson correlation of two logit tensors over all their values (None where either is
    constant or not finite)."""
    a, b = ref.double().flatten(), eng.double().flatten()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    a, b = a - a.mean(), b - b.mean()
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else None
