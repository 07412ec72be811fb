"""GPT-Neo's quality checks over engine outputs: the decode engine against the prefill engine
(`decode_check`), the non-finite rows of a call, and multiple-choice scores (`arc_scores`, per question).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantstudy.families import base
from quantstudy.families.gpt_neo_model import as_past


def per_question(scores: list[float], question: torch.Tensor) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in range(int(question.max()) + 1 if question.numel() else 0)]
    for score, q in zip(scores, question.tolist()):
        out[q].append(score)
    return out


# Prefill rows per engine call when scoring ARC, scored where the engine ran (on_device): on an H100 the
# evaluations spent 410 of their 420 s after the teacher-forced chunks, 784 CPU-seconds, bringing ARC's and
# the decode check's 50,257-way logits and K/V caches to the CPU and checking them there, five jobs side by
# side; alone, the ARC loop took 9.9 s that way and 0.8 s on the GPU for 400 rows (benchmarks/gpt_neo_arc.py).
ARC_ROWS_PER_CALL = 8


def arc_scores(run: base.Run, ids: torch.Tensor, starts: list[int], ends: list[int],
               on_device: bool = True) -> tuple[list[float], int]:
    """Each ARC row's log-likelihood of its choice's tokens ids[start:end] (prefill engine), and the rows
    with a non-finite output; scored where the engine ran unless `on_device` is False."""
    from quantstudy import metrics as qm

    scores, bad = [], 0
    for i in range(0, ids.shape[0], ARC_ROWS_PER_CALL):
        out = run({"input_ids": ids[i:i + ARC_ROWS_PER_CALL]}, graph="prefill", on_device=on_device)
        bad += bad_rows(out)
        scores += [qm.continuation_loglik(lg, row, s, e) for lg, row, s, e in
                   zip(out["logits"], ids[i:i + ARC_ROWS_PER_CALL], starts[i:], ends[i:])]
    return scores, bad


def bad_rows(outputs: dict[str, torch.Tensor]) -> int:
    """Rows (first axis) with a NaN or an infinity in any output: the logits or a K/V cache."""
    from quantstudy import metrics as qm

    ok = torch.stack([qm.finite_rows(v) for v in outputs.values()]).all(dim=0)
    return int((~ok).sum())


def decode_check(run: base.Run, prompt_ids: torch.Tensor, lengths: torch.Tensor, prefill: int, cache: int,
                 steps: int, tolerance: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Greedy decoding with the KV cache against prefill on the same prefix, one engine's pair.

    Per prompt of n tokens: prefill it, take the top token, then for each step k (up to `steps`, while
    the prefix fits the prefill and the cache) decode that token at position n + k from the caches, and
    prefill the prompt with every token chosen so far. A step agrees where both pick the same top token;
    it is within `tolerance` where they differ but the prefill's logit of the decoded token is at most
    `tolerance` below its top logit (a near tie that rounding may flip). Returns the block and the
    non-finite count of the calls (logits and caches)."""
    same = within = total = bad = calls = 0
    max_diff = 0.0
    for ids, n in zip(prompt_ids, lengths.tolist()):
        pre = run({"input_ids": ids[None]}, graph="prefill", on_device=True)
        bad, calls = bad + bad_rows(pre), calls + 1
        token, past, seq = pre["logits"][0, n - 1].float().argmax(), as_past(pre), ids.clone()
        for pos in range(n, min(n + steps, prefill, cache)):
            seq[pos] = int(token)
            dec = run({"input_ids": token.view(1, 1), "position": torch.tensor([pos]), **past}, graph="decode",
                      on_device=True)
            full = run({"input_ids": seq[None]}, graph="prefill", on_device=True)
            bad, calls = bad + bad_rows(dec) + bad_rows(full), calls + 2
            d, p = dec["logits"][0, 0].float(), full["logits"][0, pos].float()
            token, top = d.argmax(), p.argmax()
            total += 1
            same += int(token == top)
            within += int(token == top or bool(p[top] - p[token] <= tolerance))
            diff = float((d - p).abs().max())
            max_diff = max(max_diff, diff) if math.isfinite(diff) else max_diff  # a NaN step is counted as bad
            past = as_past(dec)
    block = {"prompts": int(prompt_ids.shape[0]), "steps": total, "same_token": same, "within_tolerance": within,
             "beyond_tolerance": total - within, "tolerance": tolerance, "max_logit_difference": max_diff}
    return block, {"bad": bad, "of": calls}
