"""GPT-Neo's samples and the inputs every engine reads: the samples' content hashes, the tiny
checkpoint's tokenizer, and the quality data (ARC-Easy choices as prefill rows, the teacher-forced
WikiText-2 chunks, the short prompts of the decode check).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

EOS = "<|endoftext|>"  # GPT-2's only special token: beginning, end and unknown of text


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def content_sha(sample: dict[str, Any]) -> str:
    """A prompt's text, or a question, its choices and its answer's index on lines of their own."""
    if "text" in sample:
        return _sha(sample["text"])
    return _sha("\n".join([sample["question"], *sample["choices"], str(sample["answer"])]))


def tokenizer_files(vocab_size: int, max_length: int) -> dict[str, bytes]:
    """A word-level tokenizer over the tiny pseudo-words, framed like GPT-2's: no special tokens
    added, one `<|endoftext|>` (the last id, as 50256 is GPT-2's) for beginning, end and unknown."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from quantstudy import fixtures

    words = fixtures.words(vocab_size - 1)
    vocab = {w: i for i, w in enumerate(words)} | {EOS: vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "bos_token": EOS, "eos_token": EOS, "unk_token": EOS}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode(),
            "special_tokens_map.json": json.dumps({k: v for k, v in config.items() if k.endswith("_token")}).encode()}


ARC_PROMPT = "Question: {question}\nAnswer:"  # lm-evaluation-harness's ARC prompt; the choice follows after a space


def arc_rows(tokenizer, sample: dict[str, Any]) -> list[tuple[list[int], int]]:
    """Each choice of a question as (the prompt's token ids followed by the choice's, where the choice
    starts). Prompt and choice are tokenized apart, so every choice is scored after the same context."""
    context = tokenizer(ARC_PROMPT.format(question=sample["question"]))["input_ids"]
    return [(context + tokenizer(" " + c)["input_ids"], len(context)) for c in sample["choices"]]


def arc_inputs(tokenizer, samples: list[dict[str, Any]], prefill: int, pad: int) -> dict[str, torch.Tensor]:
    """Every choice of every question as one prefill row, padded on the right with `pad`: arc_ids [rows,
    prefill], the choice's first and end token positions (arc_starts, arc_ends) and its question's index."""
    rows, starts, ends, question = [], [], [], []
    for q, sample in enumerate(samples):
        for ids, start in arc_rows(tokenizer, sample):
            if len(ids) > prefill:
                raise ValueError(f"ARC question {sample['id']}: a choice takes {len(ids)} tokens, more than the "
                                 f"prefill of {prefill}; draw the questions with max_tokens <= {prefill}")
            rows.append(ids + [pad] * (prefill - len(ids)))
            starts.append(start)
            ends.append(len(ids))
            question.append(q)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64)
    return {"arc_ids": as_tensor(rows).view(-1, prefill), "arc_starts": as_tensor(starts),
            "arc_ends": as_tensor(ends), "arc_question": as_tensor(question)}


def teacher_forced(tokenizer, passages: list[dict[str, Any]], tokens: int, prefill: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The passages' text as one token stream, cut into tokens / prefill chunks of `prefill` tokens, and
    each position's next token in the stream (the target of its logits): chunks [n, prefill], targets
    [n * prefill]. Each chunk is read on its own (no context from the chunk before)."""
    if tokens % prefill:
        raise ValueError(f"teacher_forced_tokens {tokens} is not a whole number of {prefill}-token prefill chunks")
    stream: list[int] = []
    for p in passages:
        stream += tokenizer(p["text"])["input_ids"]
    if len(stream) < tokens + 1:
        raise ValueError(f"the wikitext samples hold {len(stream)} tokens; {tokens} teacher-forced tokens "
                         f"need {tokens + 1}: draw more passages")
    ids = torch.tensor(stream[:tokens + 1], dtype=torch.int64)
    return ids[:tokens].view(-1, prefill), ids[1:]


def short_prompts(tokenizer, samples: list[dict[str, Any]], prefill: int, pad: int) -> dict[str, torch.Tensor]:
    """The short held-out prompts padded to the prefill (prompt_ids), and their lengths."""
    rows, lengths = [], []
    for s in samples:
        ids = tokenizer(s["text"])["input_ids"]
        if not 0 < len(ids) < prefill:
            raise ValueError(f"short prompt {s['id']}: {len(ids)} tokens; the decode check needs 1 to "
                             f"{prefill - 1} (draw them with max_tokens < the prefill)")
        rows.append(ids + [pad] * (prefill - len(ids)))
        lengths.append(len(ids))
    return {"prompt_ids": torch.tensor(rows, dtype=torch.int64).view(-1, prefill),
            "prompt_lengths": torch.tensor(lengths, dtype=torch.int64)}
