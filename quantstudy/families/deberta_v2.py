"""DeBERTa-v2/v3 (microsoft/deberta-v3-base, -large) as a token-feature encoder.

One graph, `main`: input_ids and attention_mask, int64 [batch, window], in -> `features`, the
last hidden state of every token [batch, window, hidden], out. The write-up builds fixed
windows: texts are framed [CLS] ... [SEP] (pairs [CLS] a [SEP] b [SEP]) and padded to the
window, and the engine takes the attention mask so that the padding stays out of attention and
the features of the real tokens are those of the unpadded text, as in the Transformers model.
Shapes are static: one engine per window and batch.

The graph module (deberta_v2_model.FeatureEncoder) runs the Transformers modules and restates
DisentangledSelfAttention's forward; how it differs from Transformers', and why, is in that module.
This adapter stays one module of about 400 lines: past the graph module, each part is one member
of the family contract (samples, inputs, reference, evaluate, kernel groups), read one at a time.

Export: quantstudy.export (torch.onnx.export, dynamo=True) exports the fp32, fp16 and FP8
variants as they are; the FP8 layers' positional calls are plain MatMuls on the fp16 weight,
named `<layer>.work_precision/MatMul`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantstudy import kernel_kinds, metrics as qm, quantization
from quantstudy.families import base, register
from quantstudy.families.base import Evaluation, Graph, Setting, TensorSpec
from quantstudy.families.deberta_v2_model import FeatureEncoder, fp8_attention

log = logging.getLogger("quantstudy")

# Kernel groups of the write-up's explanation of the missing speedup: the FP8 projection GEMMs,
# the projections (and positional products) left in fp16, TensorRT's fused attention kernel, and
# what runs instead of it where the fusion is lost: separate attention matmuls, a softmax and
# pointwise kernels (transposes, concats, adds).
KERNEL_GROUPS = ["FP8 projection GEMMs", "projection GEMMs", "fused attention", "attention matmuls", "softmax",
                 "pointwise", "other"]
# Classified by op and operand shapes, which every backend reports, so no record_function regions.
REGIONS: dict[str, str] = {}
_FUSED_ATTENTION = re.compile(r"(mha|flash)", re.I)  # TensorRT fused MHA (fmha, _gemm_mha_v2), flash
_SOFTMAX = re.compile(r"softmax", re.I)
_POINTWISE_OPS = re.compile(r"^(aten::(add|add_|sub|mul|div|neg|clamp|where|masked_fill|copy_|clone|cat|repeat|"
                            r"gather|_to_copy)|onnxruntime::(Add|Sub|Mul|Div|Neg|Clip|Where|Transpose|Concat|Tile|"
                            r"Expand|Cast|GatherElements))$")
_POINTWISE_KERNELS = re.compile(r"(elementwise|pointwise|transpose|copy|concat|gather|expand|tile)", re.I)
_GEMM_KERNELS = re.compile(r"(gemm|hmma|xmma|cutlass|nvjet|triton_tem_.*mm)", re.I)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _content_sha(sample: dict[str, Any]) -> str:
    """A passage's text, or an NLI pair's premise and hypothesis on two lines: what the jobs tokenize."""
    return _sha(sample["text"] if "text" in sample else sample["premise"] + "\n" + sample["hypothesis"])


@register("deberta_v2")
class DebertaV2:
    """Adapter: DeBERTa-v2/v3 as a token-feature encoder, one `main` graph per window and batch."""

    kernel_groups = KERNEL_GROUPS
    metrics_schema = base.metrics_schema({
        "mnli_labels": {"type": "array", "items": {"type": "string"}, "minItems": 2, "uniqueItems": True},
        "one_token_inputs": base.COUNT, "stress_inputs": base.COUNT})
    seeds = ("one_token", "stress")
    regions = REGIONS

    @staticmethod
    def kernel_group(region: str | None, name: str, device: str, op: dict[str, Any] | None,
                     setting: Setting | None = None) -> str:
        """The write-up's kernel group of a profiled CPU op or GPU kernel (or TensorRT layer).

        An FP8 layer's region or torch._scaled_mm is an FP8 projection GEMM. A GEMM with a 2-D
        operand (a weight) is a projection left in the work precision, the positional products
        included; a GEMM whose operands are all batched is an attention matmul (QK^T, c2p, p2c,
        PV). GPU kernels without a recognised op go by name: TensorRT's fused attention first.
        """
        op_name = kernel_kinds.launching_op(name, device, op)
        if kernel_kinds.in_fp8_gemm(region, op_name):
            return "FP8 projection GEMMs"
        if device != "cpu" and _FUSED_ATTENTION.search(name):
            return "fused attention"
        if op_name in kernel_kinds.GEMM_OPS:
            shapes = op["shapes"] if op else []
            return "projection GEMMs" if any(len(s) == 2 for s in shapes) else "attention matmuls"
        if _SOFTMAX.search(op_name or "") or (device != "cpu" and _SOFTMAX.search(name)):
            return "softmax"
        if _POINTWISE_OPS.match(op_name or "") or (device != "cpu" and _POINTWISE_KERNELS.search(name)):
            return "pointwise"
        if device != "cpu" and _GEMM_KERNELS.search(name):
            return "projection GEMMs"
        return "other"

    @staticmethod
    def transforms() -> dict[str, Any]:
        return {"fp8_attention": fp8_attention}

    # --- configuration -------------------------------------------------------------------
    @staticmethod
    def hf_config(architecture: dict[str, Any]):
        from transformers import DebertaV2Config

        return DebertaV2Config(**{k: v for k, v in architecture.items() if k not in ("model_type", "source")})

    def quantizable_layers(self, architecture: dict[str, Any]) -> list[str]:
        """The graph module's linear layers: six projections per layer (q, k, v, attention output, feed-forward)."""
        from transformers import DebertaV2Model

        with torch.device("meta"):
            encoder = FeatureEncoder(DebertaV2Model(self.hf_config(architecture)), window=2)
        return quantization.linear_names(encoder)

    @staticmethod
    def check_setting(setting: Setting) -> list[str]:
        if set(setting.shape) != {"window"}:
            return [f"setting {setting.name!r}: a DeBERTa setting's shape is a window, not {sorted(setting.shape)}"]
        problems = [] if setting["window"] >= 2 else [f"setting {setting.name!r}: a window holds at least [CLS] [SEP]"]
        if setting.batch < 1:
            problems.append(f"setting {setting.name!r}: the batch must be at least 1, not {setting.batch}")
        return problems

    # --- loading -------------------------------------------------------------------------
    @staticmethod
    def load_reference(checkpoint: str | Path, dtype=torch.float32) -> nn.Module:
        """Transformers DebertaV2Model, the study's reference."""
        from transformers import DebertaV2Model

        return DebertaV2Model.from_pretrained(str(checkpoint), dtype=dtype).eval()

    @staticmethod
    def processor(checkpoint: str | Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(checkpoint))

    @staticmethod
    def graphs(setting: Setting, architecture: dict[str, Any] | None = None) -> dict[str, Graph]:
        shape = (setting.batch, setting["window"])
        inputs = {"input_ids": TensorSpec("int64", shape), "attention_mask": TensorSpec("int64", shape)}
        return {"main": Graph("main", inputs, ("features",))}

    def module(self, checkpoint: str | Path, graph: str = "main", setting: Setting | None = None,
               reference: nn.Module | None = None) -> FeatureEncoder:
        """The fp32 feature encoder of the setting's window, from the checkpoint (or a loaded reference,
        whose modules it takes over)."""
        if graph != "main":
            raise ValueError(f"DeBERTa has one graph, main, not {graph!r}")
        ref = reference if reference is not None else self.load_reference(checkpoint)
        return FeatureEncoder(ref, setting["window"]).eval()

    def example_inputs(self, checkpoint: str | Path, graph: str, setting: Setting) -> dict[str, torch.Tensor]:
        """Rows [CLS] random ids [SEP], padded: the first fills 3/4 of the window, the others get
        shorter, down to [CLS][SEP] alone at batch > 1. Seeded, so every call gives the same inputs."""
        tok = self.processor(checkpoint)
        window, batch = setting["window"], setting.batch
        ordinary = torch.tensor(sorted(set(range(len(tok))) - set(tok.all_special_ids)))
        g = torch.Generator().manual_seed(0)
        ids = torch.full((batch, window), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, window), dtype=torch.long)
        for r, n in enumerate(torch.linspace(max(2, window * 3 // 4), 2, batch).round().long().tolist()):
            body = ordinary[torch.randint(len(ordinary), (n - 2,), generator=g)]
            ids[r, :n] = torch.cat([torch.tensor([tok.cls_token_id]), body, torch.tensor([tok.sep_token_id])])
            mask[r, :n] = 1
        return {"input_ids": ids, "attention_mask": mask}

    # --- samples and inputs ----------------------------------------------------------------
    @staticmethod
    def encode(tokenizer, samples: list[dict[str, Any]], window: int) -> dict[str, torch.Tensor]:
        """Text samples as [CLS] text [SEP], NLI pairs as [CLS] premise [SEP] hypothesis [SEP], truncated
        and padded to the window: {input_ids, attention_mask}, in the samples' order."""
        kw = {"truncation": True, "max_length": window, "padding": "max_length", "return_tensors": "pt"}
        texts = [i for i, s in enumerate(samples) if "text" in s]
        pairs = [i for i, s in enumerate(samples) if "premise" in s]
        if len(texts) + len(pairs) != len(samples):
            raise ValueError("a DeBERTa sample has a `text`, or a `premise` and a `hypothesis`")
        parts = []
        if texts:
            parts.append(tokenizer([samples[i]["text"] for i in texts], **kw))
        if pairs:
            parts.append(tokenizer([samples[i]["premise"] for i in pairs], [samples[i]["hypothesis"] for i in pairs],
                                   **kw))
        order = torch.argsort(torch.tensor(texts + pairs))
        return {k: torch.cat([p[k] for p in parts])[order] for k in ("input_ids", "attention_mask")}

    def draw_samples(self, rows, spec: dict[str, Any], processor) -> list[dict[str, Any]]:
        """Seeded samples within the tokenizer's token bounds: passages ({id, text, tokens, sha256}; WikiText
        headings and blank lines skipped) or labelled NLI pairs ({id, premise, hypothesis, label, tokens, sha256})."""
        kind = spec["kind"]
        if kind not in ("passages", "nli_pairs"):
            raise ValueError(f"DeBERTa draws passages or nli_pairs, not {kind!r}")
        order = list(range(len(rows)))
        random.Random(spec.get("seed", 0)).shuffle(order)
        lo, hi = spec.get("min_tokens", 1), spec.get("max_tokens", 10**9)
        count = lambda text: len(processor(text, add_special_tokens=False)["input_ids"])
        samples = []
        for i in order:
            r = rows[i]
            if kind == "passages":
                text = r["text"].strip()
                if not text or text.startswith("="):
                    continue
                n = count(text)
                sample = {"id": i, "text": text, "tokens": n}
            else:
                if r["label"] not in (0, 1, 2):  # unlabelled (test split) rows carry -1
                    continue
                n = count(r["premise"]) + count(r["hypothesis"])
                sample = {"id": i, "premise": r["premise"], "hypothesis": r["hypothesis"], "label": int(r["label"]),
                          "tokens": n}
            if lo <= n <= hi:
                samples.append({**sample, "sha256": _content_sha(sample)})
            if len(samples) == spec["count"]:
                break
        return samples

    @staticmethod
    def content_sha256(samples: list[dict[str, Any]]) -> list[str]:
        return [_content_sha(s) for s in samples]

    def calibration_batches(self, checkpoint: str | Path, samples: list[dict[str, Any]],
                            setting: Setting) -> list[dict[str, torch.Tensor]]:
        """The samples (texts or pairs) framed and padded to the window, in batches of 8."""
        enc = self.encode(self.processor(checkpoint), samples, setting["window"])
        n = enc["input_ids"].shape[0]
        return [{k: v[i:i + 8] for k, v in enc.items()} for i in range(0, n, 8)]

    # --- measurements --------------------------------------------------------------------
    @staticmethod
    def head(checkpoint: str | Path):
        """The checkpoint's classification head (DebertaV2ForSequenceClassification's pooler and classifier,
        fp32) as fn(features) -> logits, with its id2label; None for a checkpoint without one."""
        from transformers import AutoConfig, DebertaV2ForSequenceClassification

        cfg = AutoConfig.from_pretrained(str(checkpoint))
        if not any(a.endswith("ForSequenceClassification") for a in (cfg.architectures or [])):
            return None
        model = DebertaV2ForSequenceClassification.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                                   use_safetensors=True).eval()
        return model, (lambda features: model.classifier(model.pooler(features.float()))), dict(cfg.id2label)

    @staticmethod
    def one_token_inputs(tokenizer, window: int, count: int, seed: int) -> dict[str, torch.Tensor]:
        """[CLS] t [SEP] padded to the window, for `count` different ordinary tokens t (seeded): the
        write-up's one-token input, on which one FP8 build lost its token cosine."""
        ordinary = torch.tensor(sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids)))
        picks = ordinary[torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(seed))[:count]]
        ids = torch.full((len(picks), window), tokenizer.pad_token_id, dtype=torch.long)
        ids[:, 0], ids[:, 1], ids[:, 2] = tokenizer.cls_token_id, picks, tokenizer.sep_token_id
        mask = torch.zeros_like(ids)
        mask[:, :3] = 1
        return {"input_ids": ids, "attention_mask": mask}

    @staticmethod
    def stress_inputs(tokenizer, window: int, count: int, seed: int) -> dict[str, Any]:
        """Inputs for the non-finite scan: random ids filling the window, one token repeated, all
        [MASK], and [CLS][SEP] alone, in turn."""
        g = torch.Generator().manual_seed(seed)
        ordinary = torch.tensor(sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids)))
        kinds = ["random ids", "repeated token", "all [MASK]", "[CLS][SEP]"]
        ids = torch.full((count, window), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        names = []
        for i in range(count):
            kind = kinds[i % len(kinds)]
            body = window - 2
            if kind == "random ids":
                inner = ordinary[torch.randint(len(ordinary), (body,), generator=g)]
            elif kind == "repeated token":
                inner = ordinary[torch.randint(len(ordinary), (1,), generator=g)].repeat(body)
            elif kind == "all [MASK]":
                inner = torch.full((body,), tokenizer.mask_token_id)
            else:
                inner = torch.zeros(0, dtype=torch.long)
            row = torch.cat([torch.tensor([tokenizer.cls_token_id]), inner, torch.tensor([tokenizer.sep_token_id])])
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
            names.append(kind)
        return {"input_ids": ids, "attention_mask": mask, "kinds": names}

    @staticmethod
    def _sets(samples: dict[str, list[dict[str, Any]]]) -> tuple[list, list]:
        missing = [n for n in ("heldout", "mnli") if n not in samples]
        if missing:
            raise ValueError(f"the DeBERTa study evaluates on the sample sets heldout (texts) and mnli (NLI pairs); "
                             f"evaluation_samples lacks {', '.join(missing)}")
        return samples["heldout"], samples["mnli"]

    def reference(self, checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]], setting: Setting,
                  metrics: dict[str, Any], seeds: dict[str, int], device: str, dtype=torch.float32):
        """Transformers DebertaV2Model features (the study's dtype, fp32) of the held-out texts and of
        the one-token inputs, kept over their real tokens only (packed in row order); the inputs of the
        MNLI pairs; and, for a checkpoint with a classification head, the full
        DebertaV2ForSequenceClassification model's logits on the pairs and its accuracy."""
        window, tok = setting["window"], self.processor(checkpoint)
        heldout, pairs = self._sets(samples)
        sets = {"heldout": self.encode(tok, heldout, window), "mnli": self.encode(tok, pairs, window),
                "one_token": self.one_token_inputs(tok, window, metrics["one_token_inputs"], seeds["one_token"])}
        head = self.head(checkpoint)
        ref = (head[0].deberta.to(dtype) if head else self.load_reference(checkpoint, dtype)).to(device)
        log.info("reference at %d tokens: %d held-out texts, %d MNLI pairs, %d one-token inputs (head: %s)", window,
                 len(heldout), len(pairs), sets["one_token"]["input_ids"].shape[0], bool(head))
        tensors: dict[str, torch.Tensor] = {}
        for name, enc in sets.items():
            tensors |= {f"{name}_{k}": v.to(torch.int32) for k, v in enc.items()}
        for name in ("heldout", "one_token"):
            enc = sets[name]
            features = _batched(lambda b: ref(**b).last_hidden_state, enc, device)
            tensors[f"{name}_features"] = features[enc["attention_mask"].bool()].contiguous()
        blocks: dict[str, dict[str, Any]] = {"heldout": {"texts": len(heldout),
                                                         "real_tokens": int(sets["heldout"]["attention_mask"].sum())}}
        if head:
            model = head[0].to(dtype).to(device)
            logits = _batched(lambda b: model(**b).logits, sets["mnli"], device)
            gold = torch.tensor([p["label"] for p in pairs])
            to_label = torch.tensor(qm.label_map(head[2], metrics["mnli_labels"]))
            tensors |= {"mnli_logits": logits.contiguous(), "mnli_gold": gold}
            blocks["mnli"] = {"accuracy": float((to_label[logits.argmax(-1)] == gold).double().mean()),
                              "pairs": len(pairs)}
        return tensors, blocks

    def evaluate(self, checkpoint: str | Path, run, reference: dict[str, Any], samples: dict[str, list],
                 setting: Setting, metrics: dict[str, Any], seeds: dict[str, int], device: str,
                 against=None) -> Evaluation:
        """Token feature relative error on the held-out texts (metrics.token_relative_error); for a
        checkpoint with a classification head, the PyTorch head on the engine's features of the MNLI
        pairs against the fp32 full model (agreement, accuracy difference); token cosine on the
        one-token inputs; and the non-finite scan over the real tokens of every set and of the
        stress inputs."""
        tok = self.processor(checkpoint)
        inputs = lambda name: {k: reference[f"{name}_{k}"].long() for k in ("input_ids", "attention_mask")}
        out = {name: run(inputs(name), what)["features"].float().cpu()
               for name, what in (("heldout", "held-out texts"), ("mnli", "MNLI pairs"),
                                  ("one_token", "one-token inputs"))}
        stress = self.stress_inputs(tok, setting["window"], metrics["stress_inputs"], seeds["stress"])
        out["stress"] = run({k: stress[k] for k in ("input_ids", "attention_mask")}, "stress inputs")["features"]
        masks = {name: inputs(name)["attention_mask"] for name in ("heldout", "mnli", "one_token")}
        masks["stress"] = stress["attention_mask"]
        blocks: dict[str, dict[str, Any]] = {
            "features": qm.token_relative_error(_unpack(reference["heldout_features"], masks["heldout"]),
                                                out["heldout"], masks["heldout"]),
            "one_token": qm.token_cosine(_unpack(reference["one_token_features"], masks["one_token"]),
                                         out["one_token"], masks["one_token"]),
            # A fact of the row, so that a decision condition can select the head checkpoints' rows.
            "checkpoint": {"classification_head": "mnli_logits" in reference}}
        if "mnli_logits" in reference:
            head = self.head(checkpoint)
            if head is None:
                raise ValueError("the reference has MNLI logits, but the checkpoint has no classification head")
            head[0].to(device)  # the pooler and classifier where the features go (the GPU on a GPU target)
            with torch.no_grad():
                logits = head[1](out["mnli"].to(device)).cpu()
            blocks["mnli"] = qm.head_agreement(reference["mnli_logits"], logits, reference["mnli_gold"].long(),
                                               qm.label_map(head[2], metrics["mnli_labels"]))
        bad = lambda name: int((~qm.real_rows_finite(out[name].float(), masks[name])).sum())
        nonfinite = {name: {"bad": bad(name), "of": out[name].shape[0]} for name in out}
        nonfinite["stress"]["kinds"] = sorted(set(stress["kinds"]))
        return Evaluation(blocks, nonfinite)

    def quality_columns(self, evaluation_samples: list[str], against: list[str]) -> base.QualityColumns:
        # mnli only for a checkpoint with a classification head (checkpoint.classification_head)
        return base.QualityColumns(
            blocks={"features": qm.TOKEN_RELATIVE_ERROR, "one_token": qm.TOKEN_COSINE,
                    "checkpoint": ("classification_head",), "mnli": qm.HEAD_AGREEMENT},
            nonfinite=("heldout", "mnli", "one_token", "stress"),
            reference={"heldout": ("texts", "real_tokens"), "mnli": ("accuracy", "pairs")})

    # --- embedded default ----------------------------------------------------------------
    def tiny_checkpoint_files(self, architecture: dict[str, Any], tiny: dict[str, Any]) -> dict[str, bytes]:
        """A random-init model (seeded) with a word-level tokenizer, as checkpoint files: DebertaV2Model,
        or DebertaV2ForSequenceClassification where the architecture names it (an NLI head checkpoint,
        its labels from the architecture's id2label)."""
        from safetensors.torch import save
        from transformers import DebertaV2ForSequenceClassification, DebertaV2Model

        from quantstudy import fixtures

        torch.manual_seed(tiny["seed"])
        cfg = self.hf_config(architecture)
        heads = [a for a in architecture.get("architectures", []) if a.endswith("ForSequenceClassification")]
        if heads and heads != ["DebertaV2ForSequenceClassification"]:
            raise ValueError(f"a tiny DeBERTa checkpoint is DebertaV2Model or DebertaV2ForSequenceClassification, "
                             f"not {heads}")
        model = (DebertaV2ForSequenceClassification if heads else DebertaV2Model)(cfg).eval()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        files = {"config.json": json.dumps(cfg.to_dict(), indent=1, sort_keys=True).encode(),
                 "model.safetensors": save(state, metadata={"format": "pt"})}
        files.update(fixtures.tokenizer_files(cfg.vocab_size, cfg.max_position_embeddings))
        return files

    @staticmethod
    def tiny_dataset_files(files: dict[str, str], tiny: dict[str, Any], architecture: dict[str, Any]) -> dict[str, bytes]:
        """Generated WikiText-like passages (kind `passages`) or MNLI-like labelled pairs (kind
        `nli_pairs`: premise, hypothesis, label 0 entailment / 1 neutral / 2 contradiction, idx) over the
        tiny tokenizer's pseudo-words."""
        from quantstudy import fixtures

        if tiny["kind"] not in ("passages", "nli_pairs"):
            raise ValueError(f"a tiny DeBERTa dataset holds passages or nli_pairs, not {tiny['kind']!r}")
        return fixtures.dataset_files(files, tiny, architecture["vocab_size"])

def _batched(forward, enc: dict[str, torch.Tensor], device: str, batch: int = 8) -> torch.Tensor:
    """forward(**inputs) over the rows in batches, in fp32 on the CPU."""
    n = enc["input_ids"].shape[0]
    with torch.no_grad():
        return torch.cat([forward({k: v[i:i + batch].long().to(device) for k, v in enc.items()}).float().cpu()
                          for i in range(0, n, batch)])


def _unpack(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Real-token rows (packed in row order) back to [rows, window, hidden], zeros at the padding."""
    real = mask.bool()
    out = torch.zeros(*real.shape, packed.shape[-1], dtype=packed.dtype)
    out[real] = packed
    return out
