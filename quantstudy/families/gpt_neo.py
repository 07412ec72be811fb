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
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from quantstudy.families import base, register

# Kernel groups: the recipe's FP8 projections, the GEMMs that stay fp16 (out_proj, the tied
# lm_head, projections a variant leaves out), the attention core (scores, softmax, values,
# cache update) and everything else.
KERNEL_GROUPS = ["FP8 projection GEMMs", "fp16 GEMMs", "attention", "other"]
ATTENTION_REGION = "gpt_neo.attention"
REGIONS = {ATTENTION_REGION: "attention"}
UNIMPLEMENTED = "gpt_neo: the study's metrics come with its study (issue 9)"
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
    regions = REGIONS
    unwritten = ("its quality steps (reference and evaluate: next-token KL and top-1 agreement against "
                 "PyTorch bf16, WikiText-2 perplexity, ARC-Easy) and their data")
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
        past = {k.replace("present_", "past_"): v for k, v in out.items() if k != "logits"}
        return {"input_ids": ids[:, n:n + 1], "position": torch.full((b,), n, dtype=torch.int64), **past}

    # --- samples -------------------------------------------------------------------------
    def draw_samples(self, rows: Any, spec: dict[str, Any], processor: Any) -> list[dict[str, Any]]:
        """Seeded samples of a split within the spec's token bounds (by the study's tokenizer).

        kind chat_prompts (nvidia/Nemotron-Post-Training-Dataset-v1 rows): the first user turn,
          {"id", "text", "tokens", "sha256"};
        kind multiple_choice (allenai/ai2_arc rows): {"id", "question", "choices", "answer"
          (index of the right choice), "tokens" (question and longest choice), "sha256"}.
        `id` is the row's index in the split.
        """
        kind = spec["kind"]
        if kind not in ("chat_prompts", "multiple_choice"):
            raise ValueError(f"gpt_neo draws chat_prompts or multiple_choice samples, not {kind!r}")
        order = list(range(len(rows)))
        random.Random(spec.get("seed", 0)).shuffle(order)
        lo, hi = spec.get("min_tokens", 1), spec.get("max_tokens", 10**9)
        count = lambda text: len(processor(text)["input_ids"])
        samples: list[dict[str, Any]] = []
        for i in order:
            row = rows[i]
            if kind == "chat_prompts":
                text = next((m["content"] for m in row["messages"] if m["role"] == "user"), "").strip()
                sample = {"id": i, "text": text, "tokens": count(text)} if text else None
            else:
                choices = list(row["choices"]["text"])
                answer = list(row["choices"]["label"]).index(row["answerKey"])
                longest = max(choices, key=len)
                sample = {"id": i, "question": row["question"], "choices": choices, "answer": answer,
                          "tokens": count(f"{row['question']} {longest}")}
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
    def reference(self, checkpoint, samples, setting, metrics, seeds, device, dtype):
        raise NotImplementedError(UNIMPLEMENTED)

    def evaluate(self, checkpoint, run, reference, samples, setting, metrics, seeds, device, against):
        raise NotImplementedError(UNIMPLEMENTED)

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
        from quantstudy import timing as qt

        op_name = qt.launching_op(name, device, op)
        if qt.in_fp8_gemm(region, op_name):
            return "FP8 projection GEMMs"
        if region in REGIONS:
            return REGIONS[region]
        if op_name in qt.GEMM_OPS:
            return "attention" if qt.gemm_of_activations(op) else "fp16 GEMMs"
        return "other" if device == "cpu" else qt.group_by_name(name, GPTNeo.kernel_patterns)

    @staticmethod
    def transforms() -> dict[str, Any]:
        return {}
