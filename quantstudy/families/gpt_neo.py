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
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from quantstudy import kernel_kinds
from quantstudy.families import base, register

# Kernel groups: the recipe's FP8 projections, the GEMMs that stay fp16 (out_proj, the tied
# lm_head, projections a variant leaves out), the attention core (scores, softmax, values,
# cache update) and everything else.
KERNEL_GROUPS = ["FP8 projection GEMMs", "fp16 GEMMs", "attention", "other"]
ATTENTION_REGION = "gpt_neo.attention"
REGIONS = {ATTENTION_REGION: "attention"}
EOS = "<|endoftext|>"  # GPT-2's only special token: beginning, end and unknown of text


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _content_sha(sample: dict[str, Any]) -> str:
    """A prompt's text, or a question, its choices and its answer's index on lines of their own."""
    if "text" in sample:
        return _sha(sample["text"])
    return _sha("\n".join([sample["question"], *sample["choices"], str(sample["answer"])]))


def _allowed(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys a query sees: causal, and in a local layer only the last `window` positions."""
    ok = key_pos <= query_pos
    if window is not None:
        ok = ok & (query_pos - key_pos < window)
    return ok


class StaticCacheDecoder(nn.Module):
    """GPTNeoForCausalLM's layers over a static KV cache: the math both engines share.

    Holds Transformers' `transformer` and `lm_head` as they are (their names are the recipe's);
    attention is computed here, from the attention modules' projections.
    """

    def __init__(self, model: nn.Module, cache: int):
        super().__init__()
        cfg = model.config
        if cache > cfg.max_position_embeddings:
            raise ValueError(f"gpt_neo: a cache of {cache} is longer than the model's "
                             f"{cfg.max_position_embeddings} positions")
        self.transformer, self.lm_head = model.transformer, model.lm_head
        self.cache, self.heads = cache, cfg.num_heads
        # None: global attention; an int: a local layer's window.
        self.windows = [cfg.window_size if t == "local" else None for t in cfg.attention_layers]
        for block in self.transformer.h:
            # Transformers' [positions, positions] mask buffers: the masks are made from positions here.
            del block.attn.attention.bias

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, -1).transpose(1, 2)  # [batch, heads, seq, head_dim]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # Unscaled scores and their softmax in fp32 (as Transformers): fp16 would overflow.
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2))
        scores = torch.where(allowed, scores, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)
        b, _, s, _ = out.shape
        return out.transpose(1, 2).reshape(b, s, -1)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor],
             update) -> dict[str, torch.Tensor]:
        """Embeddings, blocks, final norm and lm_head. `update(i, k, v)` of layer i's new keys and
        values -> (keys, values) to attend to, and (present key, present value) to output."""
        t = self.transformer
        h = t.wte(input_ids) + t.wpe(positions)
        caches: dict[str, torch.Tensor] = {}
        for i, block in enumerate(t.h):
            attn = block.attn.attention
            x = block.ln_1(h)
            q, k, v = self._heads(attn.q_proj(x)), self._heads(attn.k_proj(x)), self._heads(attn.v_proj(x))
            with record_function(ATTENTION_REGION):
                keys, values, caches[f"present_key_{i}"], caches[f"present_value_{i}"] = update(i, k, v)
                a = self._attend(q, keys, values, masks[i])
            h = h + attn.out_proj(a)
            h = h + block.mlp(block.ln_2(h))
        return {"logits": self.lm_head(t.ln_f(h)), **caches}


class Prefill(StaticCacheDecoder):
    """input_ids [batch, n] (n <= cache; the engine's n is the setting's prefill) -> logits and the
    prompt's keys and values in zeroed static caches."""

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        n = input_ids.shape[1]
        positions = torch.arange(n, device=input_ids.device)
        query, key = positions[:, None], positions[None, :]
        masks = [_allowed(query, key, w) for w in self.windows]
        pad = (0, 0, 0, self.cache - n)  # the sequence axis, up to the cache length

        def update(_i, k, v):
            # Attend to the prompt's own keys; the cache is the same rows, zero-padded.
            return k, v, F.pad(k, pad), F.pad(v, pad)
        return self._run(input_ids, positions[None, :], masks, update)


class Decode(StaticCacheDecoder):
    """One new token at `position` over static caches: logits and the caches with its key and value."""

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, **past: torch.Tensor) -> dict[str, torch.Tensor]:
        b = input_ids.shape[0]
        key = torch.arange(self.cache, device=input_ids.device)
        query = position.view(b, 1, 1, 1)
        masks = [_allowed(query, key, w) for w in self.windows]  # [batch, 1, 1, cache]

        def update(i, k, v):
            # Write the new row at `position` of the fixed buffer (a copy in eager torch; an engine
            # may alias the output to its input buffer).
            index = position.view(b, 1, 1, 1).expand(b, k.shape[1], 1, k.shape[3])
            keys = past[f"past_key_{i}"].scatter(2, index, k)
            values = past[f"past_value_{i}"].scatter(2, index, v)
            return keys, values, keys, values
        return self._run(input_ids, position[:, None], masks, update)


GRAPHS = {"prefill": Prefill, "decode": Decode}


def _tokenizer_files(vocab_size: int, max_length: int) -> dict[str, bytes]:
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
        return {"input_ids": ids[:, n:n + 1], "position": torch.full((b,), n, dtype=torch.int64), **_as_past(out)}

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
                samples.append({**sample, "sha256": _content_sha(sample)})
            if len(samples) == spec["count"]:
                break
        return samples

    @staticmethod
    def content_sha256(samples: list[dict[str, Any]]) -> list[str]:
        return [_content_sha(s) for s in samples]

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
        files.update(_tokenizer_files(cfg.vocab_size, cfg.max_position_embeddings))
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
        by_question = _per_question(scores, arc["arc_question"])
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
        nonfinite["wikitext"] = {"bad": _bad_rows(tf), "of": reference["tf_chunks"].shape[0]}
        chunks, positions = reference["tf_chunks"].shape
        # a chunk's tokens vary together: the intervals draw whole chunks
        wikitext = qm.next_token_agreement(reference["tf_logits"].float(), tf["logits"].flatten(0, 1).float(),
                                           reference["tf_targets"], torch.arange(chunks).repeat_interleave(positions),
                                           "chunks")
        scores, bad = [], 0
        ids, starts, ends = reference["arc_ids"].long(), reference["arc_starts"].tolist(), reference["arc_ends"].tolist()
        for i in range(0, ids.shape[0], ARC_ROWS_PER_CALL):
            out = run({"input_ids": ids[i:i + ARC_ROWS_PER_CALL]}, graph="prefill")
            bad += _bad_rows(out)
            scores += [qm.continuation_loglik(lg, row, s, e) for lg, row, s, e in
                       zip(out["logits"], ids[i:i + ARC_ROWS_PER_CALL], starts[i:], ends[i:])]
        nonfinite["arc_easy"] = {"bad": bad, "of": ids.shape[0]}
        questions = reference["arc_question"]
        arc = qm.multiple_choice(_per_question(scores, questions), [s["answer"] for s in samples["arc_easy"]],
                                 qm.chosen(_per_question(reference["arc_scores"].tolist(), questions)))
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
        return {}


# --- the quality data: what the reference and every engine read ------------------------------

ARC_PROMPT = "Question: {question}\nAnswer:"  # lm-evaluation-harness's ARC prompt; the choice follows after a space
ARC_ROWS_PER_CALL = 8  # prefill rows per engine call when scoring ARC (their logits come back to the CPU)


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


def _per_question(scores: list[float], question: torch.Tensor) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in range(int(question.max()) + 1 if question.numel() else 0)]
    for score, q in zip(scores, question.tolist()):
        out[q].append(score)
    return out


def _bad_rows(outputs: dict[str, torch.Tensor]) -> int:
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
        pre = run({"input_ids": ids[None]}, graph="prefill")
        bad, calls = bad + _bad_rows(pre), calls + 1
        token, past, seq = pre["logits"][0, n - 1].float().argmax(), _as_past(pre), ids.clone()
        for pos in range(n, min(n + steps, prefill, cache)):
            seq[pos] = token
            dec = run({"input_ids": token.view(1, 1), "position": torch.tensor([pos]), **past}, graph="decode")
            full = run({"input_ids": seq[None]}, graph="prefill")
            bad, calls = bad + _bad_rows(dec) + _bad_rows(full), calls + 2
            d, p = dec["logits"][0, 0].float(), full["logits"][0, pos].float()
            token, top = d.argmax(), p.argmax()
            total += 1
            same += int(token == top)
            within += int(token == top or bool(p[top] - p[token] <= tolerance))
            diff = float((d - p).abs().max())
            max_diff = max(max_diff, diff) if math.isfinite(diff) else max_diff  # a NaN step is counted as bad
            past = _as_past(dec)
    block = {"prompts": int(prompt_ids.shape[0]), "steps": total, "same_token": same, "within_tolerance": within,
             "beyond_tolerance": total - within, "tolerance": tolerance, "max_logit_difference": max_diff}
    return block, {"bad": bad, "of": calls}


def _as_past(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A graph's present_* outputs as the next decode's past_* inputs."""
    return {k.replace("present_", "past_"): v for k, v in outputs.items() if k.startswith("present_")}
