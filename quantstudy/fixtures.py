"""Tiny data for the embedded default and the tests: generated, seeded, put in a local HF cache.

The text is made of pseudo-words so that nothing needs a download; the STS pairs share words
in proportion to their similarity score, so the rank correlation is a real (if easy) signal.
"""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pandas as pd

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "da", "fu", "go", "hi", "ja", "po", "ze"]


def words(count: int, seed: int = 0) -> list[str]:
    """`count` distinct pseudo-words plus punctuation, the tiny models' whole vocabulary."""
    rng = random.Random(seed)
    out: list[str] = [".", ","]
    seen = set(out)
    while len(out) < count:
        # Longer words as the vocabulary grows (16 syllables give 4,368 words of up to 3).
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3 if count < 4000 else 5)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def tokenizer_files(vocab_size: int, max_length: int) -> dict[str, bytes]:
    """A word-level tokenizer over the pseudo-words, framed [CLS] ... [SEP] like FNet's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + words(vocab_size - len(SPECIAL_TOKENS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
              "mask_token": "[MASK]"}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode(),
            "special_tokens_map.json": json.dumps({k: v for k, v in config.items() if k.endswith("_token")}).encode()}


def _sentence(rng: random.Random, vocab: list[str]) -> list[str]:
    # Zipf-like word frequencies, as in natural text.
    n = rng.randint(5, 24)
    return [vocab[min(int(rng.paretovariate(1.1)) - 1, len(vocab) - 1)] for _ in range(n)] + ["."]


def passages(count: int, seed: int, vocab: list[str]) -> list[str]:
    """Passages of 8 to ~600 words (one to 30 sentences), like WikiText-2's paragraphs."""
    rng = random.Random(seed)
    content = vocab[2:]
    out = []
    for _ in range(count):
        text = []
        for _ in range(rng.choice([1, 2, 3, 5, 8, 12, 20, 30])):
            text += _sentence(rng, content)
        out.append(" ".join(text))
    return out


def sentence_pairs(count: int, seed: int, vocab: list[str]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    content = vocab[2:]
    rows = []
    for _ in range(count):
        first = _sentence(rng, content)
        score = rng.random()
        second = [w if rng.random() < score or w == "." else rng.choice(content) for w in first]
        rows.append({"sentence1": " ".join(first), "sentence2": " ".join(second), "score": round(score, 4)})
    return rows


# The order of GLUE MNLI's labels.
NLI_LABELS = ["entailment", "neutral", "contradiction"]


def nli_pairs(count: int, seed: int, vocab: list[str]) -> list[dict[str, Any]]:
    """Premise / hypothesis pairs with MNLI's labels: an entailed hypothesis keeps most of the premise's
    words, a neutral one half, a contradicting one few."""
    rng = random.Random(seed)
    content = vocab[2:]
    keep = {0: 0.9, 1: 0.5, 2: 0.1}
    rows = []
    for i in range(count):
        premise = _sentence(rng, content) + _sentence(rng, content)
        label = rng.randrange(3)
        hypothesis = [w for w in premise[:rng.randint(4, len(premise))] if w == "." or rng.random() < keep[label]]
        hypothesis = hypothesis or [rng.choice(content)]
        hypothesis += [] if hypothesis[-1] == "." else ["."]
        rows.append({"premise": " ".join(premise), "hypothesis": " ".join(hypothesis), "label": label, "idx": i})
    return rows


def chat_rows(count: int, seed: int, vocab: list[str]) -> list[dict[str, Any]]:
    """Chat rows in Nemotron-Post-Training-Dataset-v1's layout: `messages`, a user turn (a passage)
    and an assistant reply."""
    texts = passages(2 * count, seed, vocab)
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in zip(texts[::2], texts[1::2])]


def multiple_choice(count: int, seed: int, vocab: list[str]) -> list[dict[str, Any]]:
    """Questions in ARC's layout: `question`, four `choices` {text, label A-D}, `answerKey`."""
    rng = random.Random(seed)
    content = vocab[2:]
    labels = ["A", "B", "C", "D"]
    rows = []
    for i in range(count):
        question = " ".join(_sentence(rng, content))
        choices = [" ".join(_sentence(rng, content)[:rng.randint(1, 6)]) for _ in labels]
        rows.append({"id": f"q{i}", "question": question, "choices": {"text": choices, "label": labels},
                     "answerKey": rng.choice(labels)})
    return rows


def split_file(pattern: str) -> str:
    """The one file a generated split is, at the path its pattern names (a glob's * becomes
    -00000-of-00001; parquet unless the pattern names a suffix)."""
    path = pattern.replace("*", "-00000-of-00001")
    return path if "." in path.rsplit("/", 1)[-1] else path + ".parquet"


def dataset_files(files: dict[str, str], tiny: dict[str, Any], vocab_size: int) -> dict[str, bytes]:
    """One file per split, at the path the split's pattern names (a glob's * becomes 00000-of-00001)."""
    vocab = words(vocab_size - len(SPECIAL_TOKENS))
    out = {}
    for i, (split, pattern) in enumerate(sorted(files.items())):
        seed = tiny["seed"] * 1000 + i
        if tiny["kind"] == "passages":
            frame = pd.DataFrame({"text": passages(tiny.get("rows", 200), seed, vocab)})
        elif tiny["kind"] == "nli_pairs":
            frame = pd.DataFrame(nli_pairs(tiny.get("rows", 80), seed, vocab))
        elif tiny["kind"] == "chat_prompts":
            frame = pd.DataFrame(chat_rows(tiny.get("rows", 80), seed, vocab))
        elif tiny["kind"] == "multiple_choice":
            frame = pd.DataFrame(multiple_choice(tiny.get("rows", 80), seed, vocab))
        else:
            frame = pd.DataFrame(sentence_pairs(tiny.get("rows", 80), seed, vocab))
        path = split_file(pattern)
        buf = io.BytesIO()
        if path.endswith(".csv"):
            frame.to_csv(buf, index=False)
        else:
            frame.to_parquet(buf, index=False)
        out[path] = buf.getvalue()
    return out


# Photographs that scikit-image ships (skimage.data, no download): the tiny image datasets' images.
PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "retina", "immunohistochemistry",
          "stereo_motorcycle", "camera", "coins", "moon", "grass", "gravel", "brick"]


def photo(name: str):
    """A scikit-image sample photograph as an RGB PIL image."""
    import numpy as np
    import skimage.data
    from PIL import Image

    pixels = getattr(skimage.data, name)()
    pixels = pixels[0] if isinstance(pixels, tuple) else pixels  # stereo_motorcycle: (left, right, disparity)
    return Image.fromarray(np.asarray(pixels, dtype=np.uint8)).convert("RGB")


def jittered(photo, rng: random.Random, short_side: tuple[int, int] = (160, 320)):
    """A seeded random crop (35% to 100% of the area, aspect 3:4 to 4:3), maybe mirrored, resized
    to a shorter side in `short_side` (default 160 to 320 px): different views of one photograph,
    of ImageNet-like sizes."""
    from PIL import Image

    w, h = photo.size
    area = rng.uniform(0.35, 1.0) * w * h
    aspect = rng.uniform(3 / 4, 4 / 3)
    cw, ch = min(w, round((area * aspect) ** 0.5)), min(h, round((area / aspect) ** 0.5))
    left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
    view = photo.crop((left, top, left + cw, top + ch))
    if rng.random() < 0.5:
        view = view.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    short = rng.randint(*short_side)
    scale = short / min(cw, ch)
    return view.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.Resampling.BICUBIC)
