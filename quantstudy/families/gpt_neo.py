"""GPT-Neo (EleutherAI/gpt-neo-125m) as a decoder with two engines around a static KV cache.

The engines are the two graphs of a variant at a setting {prefill, cache}:
  prefill  input_ids [batch, prefill] -> logits [batch, prefill, vocab] and, per layer,
           present_key_<i> / present_value_<i> [batch, heads, cache, head_dim]: the prompt's
           keys and values written into a zeroed static cache of length `cache`;
  decode   input_ids [batch, 1], position [batch] (where the new token goes: the number of
           tokens before it) and past_key_<i> / past_value_<i> [batch, heads, cache, head_dim]
           -> logits [batch, 1, vocab] and the caches with the new token's key and value
           written at `position`.
Every shape is static, so a CUDA graph can replay either engine: decode writes one row of a
fixed buffer (ScatterElements) instead of growing a concat, and masks the keys after
`position` (and, in local layers, the keys `window_size` or more tokens back). Per-layer cache
tensors, not one stacked tensor: an engine binds each as its own buffer, and a layer's update
touches only its own (a stacked cache would be scattered into, and copied, whole per layer).
Prompts shorter than `prefill` are padded on the right: causal attention keeps the real
tokens' logits and cache rows exact, and decode overwrites the padded rows as it goes.

The math is Transformers' eager GPT-Neo: no 1/sqrt(head_dim) scaling of the attention scores,
so the scores and the softmax are computed in fp32 whatever the work precision (as
Transformers does; the unscaled scores overflow fp16). The graph modules keep Transformers'
module tree (`transformer.h.<i>.attn.attention.q_proj` ...), so recipe patterns, amax files
and the reference model name the same layers.

Export: the dynamo exporter (quantstudy.export.export) exports both graphs, fp16 and FP8 Q/DQ,
as they are; no Q/DQ is inserted afterwards. Its optimizer merges the identical input
QuantizeLinear / DequantizeLinear of q_proj, k_proj and v_proj (one activation, one scale) into
one pair, named after q_proj, that feeds all three FP8 GEMMs; each keeps its own FP8 weight.

The family is four modules: this adapter (the contract); gpt_neo_model, the prefill and decode
modules; gpt_neo_data, the samples' hashes, the tiny tokenizer and the quality data every engine
reads; gpt_neo_metrics, the decode check and what the evaluation counts per call and per question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantstudy import kernel_kinds
from quantstudy.families import base, register
from quantstudy.families.gpt_neo_data import EOS, arc_inputs, arc_rows, content_sha, short_prompts, teacher_forced, tokenizer_files
from quantstudy.families.gpt_neo_metrics import arc_scores, bad_rows, decode_check, per_question
from quantstudy.families.gpt_neo_model import ATTENTION_REGION, GRAPHS, Prefill, as_past, fp8_attention

# Kernel groups: the recipe's FP8 projections, the GEMMs that stay fp16 (out_proj, the tied
# lm_head, projections a variant leaves out), the attention core (scores, softmax, values,
# cache update) and everything else.
KERNEL_GROUPS = ["FP8 projection GEMMs", "fp16 GEMMs", "attention", "other"]
REGIONS = {ATTENTION_REGION: "attention"}


@register("gpt_neo")
class GPTNeo:
    """Adapter: GPT-Neo's prefill and decode engines, tiny checkpoints, chat and multiple-choice samples."""

    kernel_groups = KERNEL_GROUPS
    metrics_schema = base.metrics_schema({"teacher_forced_tokens": base.COUNT, "decode_steps": base.COUNT,
                                          "decode_tolerance": base.POSITIVE})
    seeds = ()
    regions = REGIONS
    # GPU kernels that no recognised op launched (compiled or fused code), by name.
    kernel_patterns = [("FP8 projection GEMMs", r"(e4m3|fp8|f8f8)"),
                       ("attention", r"(fmha|flash|attention|softmax)"),
                       ("fp16 GEMMs", r"(gemm|hmma|xmma|cutlass|nvjet|triton_tem_.*mm)")]

    # --- configuration -------------------------------------------------------------------
    @staticmethod
    def hf_config(architecture: dict[str, Any]):
        from transformers import GPTNeoConfig

        keys = {k: v for k, v in architecture.items() if k not in ("model_type", "source")}
        return GPTNeoConfig(**keys)

    def quantizable_layers(self, architecture: dict[str, Any]) -> list[str]:
        """Linear layers of the graph modules (both graphs name them alike), built on the meta device."""
        from transformers import GPTNeoForCausalLM

        with torch.device("meta"):
            graph = Prefill(GPTNeoForCausalLM(self.hf_config(architecture)), cache=1)
        return [n for n, m in graph.named_modules() if isinstance(m, nn.Linear)]

    @staticmethod
    def check_setting(setting: base.Setting) -> list[str]:
        shape = dict(setting.shape)
        problems = []
        if set(shape) != {"prefill", "cache"}:
            problems.append(f"setting {setting.name}: gpt_neo's shape is {{prefill, cache}}, not {sorted(shape)}")
        for key in ("prefill", "cache"):
            if key in shape and not (isinstance(shape[key], int) and shape[key] >= 1):
                problems.append(f"setting {setting.name}: {key} must be a positive integer, not {shape[key]!r}")
        if not problems and shape["prefill"] > shape["cache"]:
            problems.append(f"setting {setting.name}: a prefill of {shape['prefill']} tokens does not fit "
                            f"a cache of {shape['cache']}")
        if setting.batch < 1:
            problems.append(f"setting {setting.name}: batch must be at least 1, not {setting.batch}")
        return problems

    # --- loading -------------------------------------------------------------------------
    @staticmethod
    def load_reference(checkpoint: str | Path, dtype: Any) -> nn.Module:
        """Transformers GPTNeoForCausalLM (eager attention) in `dtype`: the study's reference (bf16)."""
        from transformers import GPTNeoForCausalLM

        model = GPTNeoForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, attn_implementation="eager")
        return model.eval()

    @staticmethod
    def processor(checkpoint: str | Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(checkpoint))

    # --- graphs --------------------------------------------------------------------------
    def graphs(self, setting: base.Setting, architecture: dict[str, Any]) -> dict[str, base.Graph]:
        """The prefill and decode engines: static shapes (CUDA graphs), per-layer KV caches.

        Cache tensors are listed as float32, the fp32 module's; a variant's caches are in its
        work precision.
        """
        cfg = self.hf_config(architecture)
        b, p, c = setting.batch, setting["prefill"], setting["cache"]
        cache = base.TensorSpec("float32", (b, cfg.num_heads, c, cfg.hidden_size // cfg.num_heads))
        kv = [f"present_{kind}_{i}" for i in range(cfg.num_layers) for kind in ("key", "value")]
        past = {name.replace("present_", "past_"): cache for name in kv}
        return {
            "prefill": base.Graph("prefill", {"input_ids": base.TensorSpec("int64", (b, p))}, ("logits", *kv)),
            "decode": base.Graph("decode", {"input_ids": base.TensorSpec("int64", (b, 1)),
                                            "position": base.TensorSpec("int64", (b,)), **past}, ("logits", *kv)),
        }

    def module(self, checkpoint: str | Path, graph: str, setting: base.Setting) -> nn.Module:
        """The fp32 prefill or decode module of the checkpoint at the setting's cache length."""
        if graph not in GRAPHS:
            raise KeyError(f"gpt_neo has graphs {', '.join(GRAPHS)}, not {graph!r}")
        return GRAPHS[graph](self.load_reference(checkpoint, torch.float32), setting["cache"]).eval()

    def example_inputs(self, checkpoint: str | Path, graph: str, setting: base.Setting) -> base.Inputs:
        """Seeded token ids. Decode continues them: the caches are the fp32 prefill of the first
        min(prefill, cache - 1) tokens, the new token the next one, at that position."""
        from transformers import GPTNeoConfig

        b, p, c = setting.batch, setting["prefill"], setting["cache"]
        vocab = GPTNeoConfig.from_pretrained(str(checkpoint)).vocab_size
        ids = torch.randint(0, vocab, (b, p + 1), generator=torch.Generator().manual_seed(0))
        if graph == "prefill":
            return {"input_ids": ids[:, :p]}
        n = min(p, c - 1)
        with torch.no_grad():
            out = self.module(checkpoint, "prefill", setting)(input_ids=ids[:, :n])
        return {"input_ids": ids[:, n:n + 1], "position": torch.full((b,), n, dtype=torch.int64), **as_past(out)}

    # --- samples -------------------------------------------------------------------------
    def draw_samples(self, rows: Any, spec: dict[str, Any], processor: Any) -> list[dict[str, Any]]:
        """Samples of a split within the spec's token bounds (by the study's tokenizer).

        kind chat_prompts (nvidia/Nemotron-Post-Training-Dataset-v1 rows): the first user turn,
          {"id", "text", "tokens", "sha256"}, in the order shuffled with `seed` from position `offset`
          (a held-out set: the calibration set's seed, an offset past the rows it drew);
        kind multiple_choice (allenai/ai2_arc rows), seeded likewise: {"id", "question", "choices",
          "answer" (index of the right choice), "tokens" (of the prompt with its longest choice), "sha256"};
        kind passages (WikiText rows): the split's non-blank rows in order, as they are (WikiText's running
          text, which perplexity reads as one stream), {"id", "text", "tokens", "sha256"}.
        `id` is the row's index in the split.
        """
        kind = spec["kind"]
        if kind not in ("chat_prompts", "multiple_choice", "passages"):
            raise ValueError(f"gpt_neo draws chat_prompts, multiple_choice or passages samples, not {kind!r}")
        order = list(range(len(rows)))
        if kind != "passages":
            random.Random(spec.get("seed", 0)).shuffle(order)
            order = order[spec.get("offset", 0):]
        lo, hi = spec.get("min_tokens", 1), spec.get("max_tokens", 10**9)
        count = lambda text: len(processor(text)["input_ids"])
        samples: list[dict[str, Any]] = []
        for i in order:
            row = rows[i]
            if kind == "chat_prompts":
                text = next((m["content"] for m in row["messages"] if m["role"] == "user"), "").strip()
                sample = {"id": i, "text": text, "tokens": count(text)} if text else None
            elif kind == "passages":
                text = row["text"]
                sample = {"id": i, "text": text, "tokens": count(text)} if text.strip() else None
            else:
                choices = list(row["choices"]["text"])
                sample = {"id": i, "question": row["question"], "choices": choices,
                          "answer": list(row["choices"]["label"]).index(row["answerKey"])}
                sample["tokens"] = max(len(ids) for ids, _ in arc_rows(processor, sample))
            if sample is not None and lo <= sample["tokens"] <= hi:
                samples.append({**sample, "sha256": content_sha(sample)})
            if len(samples) == spec["count"]:
                break
        return samples

    @staticmethod
    def content_sha256(samples: list[dict[str, Any]]) -> list[str]:
        return [content_sha(s) for s in samples]

    def calibration_batches(self, checkpoint: str | Path, samples: list[dict[str, Any]],
                            setting: base.Setting) -> list[base.Inputs]:
        """One prefill input per chat prompt: its tokens, truncated to the setting's prefill and not
        padded (padding would add activations that no prompt has to the max statistics)."""
        tokenizer = self.processor(checkpoint)
        batches = []
        for sample in samples:
            ids = tokenizer(sample["text"])["input_ids"][:setting["prefill"]]
            if ids:
                batches.append({"input_ids": torch.tensor([ids], dtype=torch.int64)})
        return batches

    # --- tiny checkpoints ----------------------------------------------------------------
    def tiny_checkpoint_files(self, architecture: dict[str, Any], tiny: dict[str, Any]) -> dict[str, bytes]:
        """A random-init GPTNeoForCausalLM (fixed seed) with a word-level tokenizer, as checkpoint files."""
        from safetensors.torch import save
        from transformers import GPTNeoForCausalLM

        torch.manual_seed(tiny["seed"])
        cfg = self.hf_config(architecture)
        model = GPTNeoForCausalLM(cfg).eval()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        state.pop("lm_head.weight")  # tied to transformer.wte.weight, stored once as transformers saves it
        files = {"config.json": json.dumps(cfg.to_dict(), indent=1, sort_keys=True).encode(),
                 "model.safetensors": save(state, metadata={"format": "pt"})}
        files.update(tokenizer_files(cfg.vocab_size, cfg.max_position_embeddings))
        return files

    def tiny_dataset_files(self, files: dict[str, str], tiny: dict[str, Any],
                           architecture: dict[str, Any]) -> dict[str, bytes]:
        """Generated data over the tiny tokenizer's pseudo-words: chat rows (kind `chat_prompts`,
        Nemotron's layout), passages (WikiText's) or questions (`multiple_choice`, ARC's)."""
        from quantstudy import fixtures

        if tiny["kind"] not in ("chat_prompts", "passages", "multiple_choice"):
            raise ValueError(f"a tiny GPT-Neo dataset holds chat_prompts, passages or multiple_choice, "
                             f"not {tiny['kind']!r}")
        return fixtures.dataset_files(files, tiny, architecture["vocab_size"])

    # --- measurements --------------------------------------------------------------------
    def reference(self, checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]], setting: base.Setting,
                  metrics: dict[str, Any], seeds: dict[str, int], device: str, dtype: Any):
        """GPTNeoForCausalLM (eager attention, in the study's reference dtype: bf16) on the held-out data,
        each text on its own and unpadded: the teacher-forced WikiText-2 chunks' logits (kept in the
        model's dtype, as it computed them), each ARC choice's log-likelihood; and the engines' inputs
        (chunks; ARC rows and short prompts padded to the prefill), so that every engine reads the same.

        Sample sets: `wikitext` (passages), `arc_easy` (multiple_choice), `short_prompts` (chat_prompts).
        """
        from quantstudy import metrics as qm

        model, tok = self.load_reference(checkpoint, dtype).to(device), self.processor(checkpoint)
        prefill, eos = setting["prefill"], tok.convert_tokens_to_ids(EOS)
        logits = lambda ids: model(input_ids=ids[None].to(device)).logits[0].cpu()
        chunks, targets = teacher_forced(tok, samples["wikitext"], metrics["teacher_forced_tokens"], prefill)
        tf_logits = torch.cat([logits(c) for c in chunks])
        arc = arc_inputs(tok, samples["arc_easy"], prefill, eos)
        scores = [qm.continuation_loglik(logits(ids[:end]), ids, start, end)
                  for ids, start, end in zip(arc["arc_ids"], arc["arc_starts"].tolist(), arc["arc_ends"].tolist())]
        prompts = short_prompts(tok, samples["short_prompts"], prefill, eos)
        by_question = per_question(scores, arc["arc_question"])
        tensors = {"tf_chunks": chunks.to(torch.int32), "tf_targets": targets, "tf_logits": tf_logits.to(dtype),
                   **arc, "arc_scores": torch.tensor(scores, dtype=torch.float64), **prompts}
        blocks = {"wikitext": {"perplexity": qm.perplexity(tf_logits, targets), "tokens": int(targets.numel())},
                  "arc_easy": qm.multiple_choice(by_question, [s["answer"] for s in samples["arc_easy"]])}
        return tensors, blocks

    def evaluate(self, checkpoint: str | Path, run: base.Run, reference: dict[str, torch.Tensor],
                 samples: dict[str, list[dict[str, Any]]], setting: base.Setting, metrics: dict[str, Any],
                 seeds: dict[str, int], device: str, against=None) -> base.Evaluation:
        """Against the bf16 reference: next-token KL, top-1 agreement and perplexity on the teacher-forced
        WikiText-2 chunks (prefill engine); ARC-Easy accuracy by the sum of each choice's token
        log-likelihoods; the decode engine against the prefill engine (`decode_check`); and the
        non-finite scan of the logits and every K/V output on each of those inputs."""
        from quantstudy import metrics as qm

        nonfinite: dict[str, dict[str, Any]] = {}
        tf = run({"input_ids": reference["tf_chunks"].long()}, "teacher-forced WikiText-2 chunks", graph="prefill")
        nonfinite["wikitext"] = {"bad": bad_rows(tf), "of": reference["tf_chunks"].shape[0]}
        chunks, positions = reference["tf_chunks"].shape
        # a chunk's tokens vary together: the intervals draw whole chunks
        wikitext = qm.next_token_agreement(reference["tf_logits"].float(), tf["logits"].flatten(0, 1).float(),
                                           reference["tf_targets"], torch.arange(chunks).repeat_interleave(positions),
                                           "chunks")
        ids = reference["arc_ids"].long()
        scores, bad = arc_scores(run, ids, reference["arc_starts"].tolist(), reference["arc_ends"].tolist())
        nonfinite["arc_easy"] = {"bad": bad, "of": ids.shape[0]}
        questions = reference["arc_question"]
        arc = qm.multiple_choice(per_question(scores, questions), [s["answer"] for s in samples["arc_easy"]],
                                 qm.chosen(per_question(reference["arc_scores"].tolist(), questions)))
        decode, nonfinite["short_prompts"] = decode_check(run, reference["prompt_ids"], reference["prompt_lengths"],
                                                          setting["prefill"], setting["cache"], metrics["decode_steps"],
                                                          metrics["decode_tolerance"])
        return base.Evaluation({"wikitext": wikitext, "arc_easy": arc, "decode": decode}, nonfinite)

    def quality_columns(self, evaluation_samples: list[str], against: list[str]) -> base.QualityColumns:
        from quantstudy import metrics as qm

        return base.QualityColumns(
            blocks={"wikitext": qm.NEXT_TOKEN_AGREEMENT, "arc_easy": (*qm.MULTIPLE_CHOICE, "agreement_with_reference"),
                    "decode": ("prompts", "steps", "same_token", "within_tolerance", "beyond_tolerance", "tolerance",
                               "max_logit_difference")},
            nonfinite=("wikitext", "arc_easy", "short_prompts"),
            reference={"wikitext": ("perplexity", "tokens"), "arc_easy": qm.MULTIPLE_CHOICE})

    @staticmethod
    def kernel_group(region: str | None, name: str, device: str, op: dict[str, Any] | None,
                     setting: base.Setting | None = None) -> str:
        """The group of a profiled CPU op or GPU kernel.

        By region where the eager model marks one (FP8 layers, the attention core). Otherwise by
        the op (a GPU kernel: the op that launched it): torch._scaled_mm is an FP8 GEMM; a GEMM of
        two activations (both operands of rank 3 or more: scores, values) is attention; other
        GEMMs (a weight operand of rank 2) are the fp16 projections and the lm_head. Compiled
        code and exported graphs keep no regions, hence the shapes and then the kernel names.
        """
        op_name = kernel_kinds.launching_op(name, device, op)
        if kernel_kinds.in_fp8_gemm(region, op_name):
            return "FP8 projection GEMMs"
        if region in REGIONS:
            return REGIONS[region]
        if op_name in kernel_kinds.GEMM_OPS:
            return "attention" if kernel_kinds.gemm_of_activations(op) else "fp16 GEMMs"
        return "other" if device == "cpu" else kernel_kinds.group_by_name(name, GPTNeo.kernel_patterns)

    @staticmethod
    def transforms() -> dict[str, Any]:
        return {"fp8_attention": fp8_attention}
