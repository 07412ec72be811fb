"""Quality metrics of an engine's features against the PyTorch fp32 reference."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Mask of rows (first axis) whose values are all finite."""
    return torch.isfinite(x.flatten(1)).all(dim=1)


def mlm_agreement(ref_logits: torch.Tensor, eng_logits: torch.Tensor) -> dict[str, Any]:
    """KL(PyTorch || engine) per masked token (mean, p99) and top-1 agreement, over finite tokens."""
    ok = finite_rows(eng_logits)
    if not ok.any():
        return {"kl_mean": None, "kl_p99": None, "top1_agreement": None, "tokens": 0,
                "nonfinite_tokens": int((~ok).sum())}
    ref, eng = ref_logits[ok].double(), eng_logits[ok].double()
    kl = F.kl_div(F.log_softmax(eng, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
            "top1_agreement": float((ref.argmax(-1) == eng.argmax(-1)).double().mean()),
            "tokens": int(ok.sum()), "nonfinite_tokens": int((~ok).sum())}


def cls_agreement(ref_cls: torch.Tensor, eng_cls: torch.Tensor) -> dict[str, Any]:
    """Cosine (mean, min) and relative L2 error of CLS features, over finite rows."""
    ok = finite_rows(eng_cls)
    if not ok.any():
        return {"cosine_mean": None, "cosine_min": None, "relative_error": None, "rows": 0}
    ref, eng = ref_cls[ok].double(), eng_cls[ok].double()
    cos = F.cosine_similarity(ref, eng, dim=-1)
    rel = (eng - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "relative_error": float(rel.mean()), "rows": int(ok.sum())}


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


def top1_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Share of rows whose top class is the label (a non-finite row counts as wrong)."""
    if logits.shape[0] == 0:
        return None
    right = (logits.argmax(-1) == labels.to(logits.device)) & finite_rows(logits)
    return float(right.double().mean())
