"""FNet (google/fnet-base, google/fnet-large) as a pooled-feature encoder.

The graph module and its token mixing (the real part of a 2D DFT as two GEMMs, the sequence axis
in fp32, and the 1/64 probe `hidden_scale`) are in fnet_model; this is the adapter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantstudy import kernel_kinds
from quantstudy.families import base, register
from quantstudy.families.base import Evaluation, Graph, Setting, TensorSpec
from quantstudy.families.fnet_model import FeatureEncoder, FourierBlock, fp8_hidden_dft, hidden_scaling

log = logging.getLogger("quantstudy")

# Kernel groups of the write-up, in the order its table shows them. A kernel belongs to the
# group of the innermost annotated region it runs in (record_function on CPU), or on a GPU
# is matched by its name.
KERNEL_GROUPS = ["sequence-axis DFT", "other GEMMs", "FP8 feed-forward GEMMs", "other"]
REGIONS = {"fnet.sequence_dft": "sequence-axis DFT", "fnet.hidden_dft": "other GEMMs"}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _content_sha(sample: dict[str, Any]) -> str:
    """A passage's text, or a pair's two sentences on two lines: what the jobs feed the model."""
    return _sha(sample["text"] if "text" in sample else sample["sentence1"] + "\n" + sample["sentence2"])


@register("fnet")
class FNet:
    """Adapter: FNet as a pooled-feature encoder, one `main` graph per window and batch."""

    kernel_groups = KERNEL_GROUPS
    regions = REGIONS
    metrics_schema = base.metrics_schema({
        "mask_fraction": base.SHARE, "stress_inputs": base.COUNT, "nonfinite_batch": base.COUNT,
        "fp16_max": base.POSITIVE,
        "quality_bar": base.metrics_schema({"max_cls_relative_l2": base.POSITIVE, "sts_sentences": base.COUNT})})
    seeds = ("masking", "stress")
    # GPU kernels that no recognised op launched (e.g. Triton GEMM templates), by name.
    kernel_patterns = [("FP8 feed-forward GEMMs", r"(e4m3|fp8|f8f8|qqtst)"),
                       ("other GEMMs", r"(gemm|hmma|xmma|cutlass|nvjet|triton_tem_.*mm)")]

    def kernel_group(self, region: str | None, name: str, device: str, op: dict[str, Any] | None,
                     setting: Setting | None = None) -> str:
        """The write-up's kernel group of a profiled CPU op or GPU kernel.

        By region where the eager torch model marks one (record_function). Otherwise by the op
        (a GPU kernel: the op that launched it): torch._scaled_mm is an FP8 GEMM; a GEMM with a
        [2 window, window] operand (the stacked sequence DFT matrix) is the sequence-axis DFT; other
        GEMMs are the hidden-axis DFT, the embedding projection and non-FP8 feed-forward layers.
        Compiled code and exported graphs (ONNX Runtime, TensorRT) keep no regions, hence the
        shapes.
        """
        window = setting["window"] if setting is not None else None
        op_name = kernel_kinds.launching_op(name, device, op)
        if kernel_kinds.in_fp8_gemm(region, op_name):
            return "FP8 feed-forward GEMMs"
        if region in REGIONS:
            return REGIONS[region]
        if op_name in kernel_kinds.GEMM_OPS:
            shapes = op["shapes"] if op else []
            # the stacked [2S, S] matrix, in either order: a compiled GEMM may take it transposed.
            # (The hidden-axis matrix is [2H, H], and FNet's windows are below its hidden size.)
            sequence = window is not None and any(len(s) >= 2 and sorted(s[-2:]) == [window, 2 * window]
                                                  for s in shapes)
            return "sequence-axis DFT" if sequence else "other GEMMs"
        return "other" if device == "cpu" else kernel_kinds.group_by_name(name, self.kernel_patterns)

    def transforms(self) -> dict[str, Any]:
        return {"hidden_scaling": hidden_scaling, "fp8_hidden_dft": fp8_hidden_dft}

    # --- configuration -------------------------------------------------------------------
    @staticmethod
    def hf_config(architecture: dict[str, Any]):
        from transformers import FNetConfig

        keys = {k: v for k, v in architecture.items() if k not in ("model_type", "source")}
        return FNetConfig(**keys)

    def quantizable_layers(self, architecture: dict[str, Any]) -> list[str]:
        from transformers import FNetForPreTraining

        with torch.device("meta"):
            encoder = FeatureEncoder(FNetForPreTraining(self.hf_config(architecture)).fnet)
        return [n for n, m in encoder.named_modules() if isinstance(m, nn.Linear)]

    @staticmethod
    def check_setting(setting: Setting) -> list[str]:
        if set(setting.shape) != {"window"}:
            return [f"setting {setting.name!r}: an FNet setting's shape is a window, not {sorted(setting.shape)}"]
        return [] if setting["window"] >= 4 else [f"setting {setting.name!r}: a window needs at least 4 tokens"]

    # --- loading -------------------------------------------------------------------------
    @staticmethod
    def load_reference(checkpoint: str | Path, dtype=torch.float32) -> nn.Module:
        """Transformers FNetForPreTraining (its own FFT mixing), the study's reference."""
        from transformers import FNetForPreTraining

        return FNetForPreTraining.from_pretrained(str(checkpoint), dtype=dtype).eval()

    @staticmethod
    def processor(checkpoint: str | Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(checkpoint))

    @staticmethod
    def graphs(setting: Setting, architecture: dict[str, Any] | None = None) -> dict[str, Graph]:
        shape = (setting.batch, setting["window"])
        return {"main": Graph("main", {"input_ids": TensorSpec("int64", shape)}, ("features",))}

    def module(self, checkpoint: str | Path, graph: str = "main", setting: Setting | None = None,
               reference: nn.Module | None = None) -> FeatureEncoder:
        """The fp32 feature encoder with DFT-matrix mixing, from the checkpoint (or a loaded reference)."""
        ref = reference if reference is not None else self.load_reference(checkpoint)
        fnet, cfg, window = ref.fnet, ref.config, setting["window"]
        for layer in fnet.encoder.layer:
            block = FourierBlock(window, cfg.hidden_size, cfg.layer_norm_eps)
            block.output.LayerNorm.load_state_dict(layer.fourier.output.LayerNorm.state_dict())
            layer.fourier = block
        return FeatureEncoder(fnet).eval()

    def example_inputs(self, checkpoint: str | Path, graph: str, setting: Setting) -> dict[str, torch.Tensor]:
        """A real-looking row ([CLS] random ids [SEP]) repeated to the batch: what timing replays."""
        ids = self.stress_inputs(self.processor(checkpoint), setting["window"], 1, seed=0)["input_ids"]
        return {"input_ids": ids.repeat(setting.batch, 1)}

    # --- samples and inputs ----------------------------------------------------------------
    @staticmethod
    def encode(tokenizer, texts: list[str], window: int) -> torch.Tensor:
        """[CLS] text [SEP] padded to the window, as the runtime pads."""
        enc = tokenizer(texts, truncation=True, max_length=window, padding="max_length", return_tensors="pt")
        return enc["input_ids"]

    def draw_samples(self, rows, spec: dict[str, Any], processor) -> list[dict[str, Any]]:
        """Passages (seeded order, within the tokenizer's token bounds) or the first sentence pairs."""
        samples = []
        if spec["kind"] == "passages":
            order = list(range(len(rows)))
            random.Random(spec.get("seed", 0)).shuffle(order)
            lo, hi = spec.get("min_tokens", 1), spec.get("max_tokens", 10**9)
            for i in order:
                text = rows[i]["text"].strip()
                if not text or text.startswith("="):  # WikiText headings and blank lines are not passages
                    continue
                n = len(processor(text, add_special_tokens=False)["input_ids"])
                if lo <= n <= hi:
                    samples.append({"id": i, "text": text, "tokens": n, "sha256": _content_sha({"text": text})})
                if len(samples) == spec["count"]:
                    break
        elif spec["kind"] == "sentence_pairs":
            for i in range(min(spec["count"], len(rows))):
                r = rows[i]
                score = r.get("score", r.get("label"))
                sample = {"id": i, "sentence1": r["sentence1"], "sentence2": r["sentence2"], "score": float(score)}
                samples.append({**sample, "sha256": _content_sha(sample)})
        else:
            raise ValueError(f"FNet draws passages or sentence_pairs, not {spec['kind']!r}")
        return samples

    @staticmethod
    def content_sha256(samples: list[dict[str, Any]]) -> list[str]:
        return [_content_sha(s) for s in samples]

    def calibration_batches(self, checkpoint: str | Path, samples: list[dict[str, Any]],
                            setting: Setting) -> list[dict[str, torch.Tensor]]:
        """The passages framed [CLS] ... [SEP] and padded to the window, in batches of 8."""
        ids = self.encode(self.processor(checkpoint), [s["text"] for s in samples], setting["window"])
        return [{"input_ids": ids[i:i + 8]} for i in range(0, ids.shape[0], 8)]

    @staticmethod
    def stress_inputs(tokenizer, window: int, count: int, seed: int) -> dict[str, Any]:
        """The write-up's stress inputs: random ids, a repeated token, all [MASK], [CLS][SEP]."""
        g = torch.Generator().manual_seed(seed)
        vocab = len(tokenizer)
        cls, sep, pad, mask = (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id,
                               tokenizer.mask_token_id)
        rows, names = [], []
        kinds = ["random ids", "repeated token", "all [MASK]", "[CLS][SEP]"]
        for i in range(count):
            kind = kinds[i % len(kinds)]
            body = window - 2
            if kind == "random ids":
                ids = torch.randint(5, vocab, (body,), generator=g)
            elif kind == "repeated token":
                ids = torch.full((body,), int(torch.randint(5, vocab, (1,), generator=g)))
            elif kind == "all [MASK]":
                ids = torch.full((body,), mask)
            else:
                ids = torch.full((0,), pad)
            row = torch.cat([torch.tensor([cls]), ids, torch.tensor([sep])])
            rows.append(F.pad(row, (0, window - len(row)), value=pad))
            names.append(kind)
        return {"input_ids": torch.stack(rows), "kinds": names}

    # --- measurements --------------------------------------------------------------------
    @staticmethod
    def mixing_peaks(reference: nn.Module, input_ids: torch.Tensor) -> list[float]:
        """Largest |2D Fourier output| per input row in the fp32 reference (the fp16 overflow risk)."""
        peaks = torch.zeros(input_ids.shape[0], device=input_ids.device)

        def hook(_m, _inp, out):
            peaks.copy_(torch.maximum(peaks, out[0].abs().flatten(1).amax(dim=1)))

        handles = [layer.fourier.self.register_forward_hook(hook) for layer in reference.fnet.encoder.layer]
        try:
            with torch.no_grad():
                reference(input_ids=input_ids)
        finally:
            for h in handles:
                h.remove()
        return peaks.tolist()

    def reference(self, checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]], setting: Setting,
                  metrics: dict[str, Any], seeds: dict[str, int], device: str, dtype=torch.float32):
        """Transformers fp32 features of the held-out passages (masked and plain) and STS sentences,
        the reference's STS Spearman, and the largest 2D Fourier value per passage."""
        from quantstudy import metrics as qm

        window = setting["window"]
        ref, tok = self.load_reference(checkpoint, dtype).to(device), self.processor(checkpoint)
        heldout = [s["text"] for s in samples["heldout"]]
        sentences, gold = _sts_sentences(samples["sts"])
        ids = self.encode(tok, heldout, window)
        masked, positions = _mask(ids, tok, metrics["mask_fraction"], seeds["masking"])
        last = lambda x: ref(input_ids=x.to(device), output_hidden_states=True).hidden_states[-1]
        log.info("reference at %d tokens: %d passages, %d masked tokens, %d STS sentences", window, len(heldout),
                 len(positions), len(sentences))
        masked_features = _features(last, masked, 8)
        sts_ids = self.encode(tok, sentences, window)
        sts_cls = _features(last, sts_ids, 8)[:, 0]
        peaks = [p for i in range(ids.shape[0]) for p in self.mixing_peaks(ref, ids[i:i + 1].to(device))]
        tensors = {"heldout_ids": ids.to(torch.int32), "masked_ids": masked.to(torch.int32),
                   "mask_positions": positions,
                   "mlm_features": masked_features[positions[:, 0], positions[:, 1]].contiguous(),
                   "heldout_cls": _features(last, ids, 8)[:, 0].contiguous(), "sts_ids": sts_ids.to(torch.int32),
                   "sts_cls": sts_cls.contiguous(), "mixing_peaks": torch.tensor(peaks)}
        fp16_max = metrics["fp16_max"]
        blocks = {"sts": {"spearman": qm.sts_spearman(sts_cls[0::2], sts_cls[1::2], gold)},
                  "mixing_peak": {"max": max(peaks), "fp16_max": fp16_max, "passages": len(peaks),
                                  "passages_over_fp16_max": sum(p > fp16_max for p in peaks)}}
        return tensors, blocks

    def evaluate(self, checkpoint: str | Path, run, reference: dict[str, torch.Tensor],
                 samples: dict[str, list[dict[str, Any]]], setting: Setting, metrics: dict[str, Any],
                 seeds: dict[str, int], device: str, against=None) -> Evaluation:
        """Masked-LM agreement (the PyTorch MLM head on the engine's features), CLS agreement, STS
        Spearman, the quality bar, and the non-finite scan (held-out, STS, stress inputs, a batch).
        Against another variant's engine (`quality_against`): CLS agreement with its features."""
        from quantstudy import metrics as qm

        ref_model, tok = self.load_reference(checkpoint), self.processor(checkpoint)
        features = lambda ids, what: run({"input_ids": ids.long()}, what)["features"].float().cpu()
        masked = features(reference["masked_ids"], "masked held-out passages")
        pos = reference["mask_positions"]
        ref_model.to(device)  # the MLM head over every masked token is a large GEMM
        with torch.no_grad():
            head = lambda x: ref_model.cls.predictions(x.float().to(device))
            # a passage's masked tokens vary together: the interval draws whole passages
            mlm = qm.mlm_agreement(head(reference["mlm_features"]), head(masked[pos[:, 0], pos[:, 1]]), pos[:, 0].cpu(),
                                   "passages")
        heldout = features(reference["heldout_ids"], "held-out passages")
        sts = features(reference["sts_ids"], "STS sentences")
        gold = [p["score"] for p in samples["sts"]]
        n_bar = metrics["quality_bar"]["sts_sentences"]
        bar = qm.quality_bar(reference["sts_cls"][:n_bar], sts[:n_bar, 0], metrics["quality_bar"]["max_cls_relative_l2"])
        stress = self.stress_inputs(tok, setting["window"], metrics["stress_inputs"], seeds["stress"])
        stress_out = features(stress["input_ids"], "stress inputs")
        # One call at a larger batch than the engine's (the write-up's batch-of-8 scan).
        big = run({"input_ids": reference["heldout_ids"][:metrics["nonfinite_batch"]].long()}, "one batch",
                  whole=True)["features"].float().cpu()
        bad = lambda x: int((~qm.finite_rows(x)).sum())
        nonfinite = {"heldout": {"bad": bad(heldout), "of": heldout.shape[0]},
                     "masked_heldout": {"bad": bad(masked), "of": masked.shape[0]},
                     "sts_sentences": {"bad": bad(sts), "of": sts.shape[0]},
                     "stress": {"bad": bad(stress_out), "of": stress_out.shape[0], "kinds": sorted(set(stress["kinds"]))},
                     "batch": {"bad": bad(big), "of": big.shape[0]}}
        blocks = {"mlm": mlm, "cls": qm.cls_agreement(reference["heldout_cls"], heldout[:, 0]),
                  "sts": {"spearman": qm.sts_spearman(sts[0::2, 0], sts[1::2, 0], gold)}, "quality_bar": bar}
        for name, other in (against or {}).items():
            theirs = other({"input_ids": reference["heldout_ids"].long()}, f"held-out passages on {name}")
            blocks[base.against_block("cls", name)] = qm.cls_agreement(theirs["features"].float().cpu()[:, 0], heldout[:, 0])
        return Evaluation(blocks, nonfinite)

    def quality_columns(self, evaluation_samples: list[str], against: list[str]) -> base.QualityColumns:
        from quantstudy import metrics as qm

        return base.QualityColumns(
            blocks={"mlm": qm.MLM_AGREEMENT, "cls": qm.CLS_AGREEMENT, "sts": ("spearman",),
                    "quality_bar": qm.QUALITY_BAR, **{base.against_block("cls", v): qm.CLS_AGREEMENT for v in against}},
            nonfinite=("heldout", "masked_heldout", "sts_sentences", "stress", "batch"),
            reference={"sts": ("spearman",), "mixing_peak": ("max", "fp16_max", "passages", "passages_over_fp16_max")})

    # --- embedded default ----------------------------------------------------------------
    def tiny_checkpoint_files(self, architecture: dict[str, Any], tiny: dict[str, Any]) -> dict[str, bytes]:
        """A random-init FNetForPreTraining (fixed seed) with a word-level tokenizer, as checkpoint files.

        `mixing_input_offset` sets the embedding projection's bias: trained FNet's mixing input
        has a large common offset, which is what makes its 2D DFT pass the fp16 range at 512
        tokens; random init has none, so the tiny model gets one to show the same behaviour.
        """
        from safetensors.torch import save
        from transformers import FNetForPreTraining

        from quantstudy import fixtures

        torch.manual_seed(tiny["seed"])
        cfg = self.hf_config(architecture)
        model = FNetForPreTraining(cfg).eval()
        with torch.no_grad():
            model.fnet.embeddings.projection.bias.fill_(float(tiny.get("mixing_input_offset", 0.0)))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        # Tied weights are stored once, as transformers saves them.
        state.pop("cls.predictions.decoder.weight", None)
        state.pop("cls.predictions.decoder.bias", None)
        files = {"config.json": json.dumps(cfg.to_dict(), indent=1, sort_keys=True).encode(),
                 "model.safetensors": save(state, metadata={"format": "pt"})}
        files.update(fixtures.tokenizer_files(cfg.vocab_size, cfg.max_position_embeddings))
        return files

    @staticmethod
    def tiny_dataset_files(files: dict[str, str], tiny: dict[str, Any], architecture: dict[str, Any]) -> dict[str, bytes]:
        """Generated passages or sentence pairs over the tiny tokenizer's pseudo-words."""
        from quantstudy import fixtures

        return fixtures.dataset_files(files, tiny, architecture["vocab_size"])


def _sts_sentences(pairs: list[dict[str, Any]]) -> tuple[list[str], list[float]]:
    return [s for p in pairs for s in (p["sentence1"], p["sentence2"])], [p["score"] for p in pairs]


def _mask(ids: torch.Tensor, tokenizer, fraction: float, seed: int):
    """Replace `fraction` of the body tokens of each row by [MASK] (seeded); returns ids and positions."""
    g = torch.Generator().manual_seed(seed)
    masked, positions = ids.clone(), []
    special = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id}
    for row in range(ids.shape[0]):
        body = [j for j in range(ids.shape[1]) if int(ids[row, j]) not in special]
        k = max(1, round(fraction * len(body)))
        pick = sorted(body[j] for j in torch.randperm(len(body), generator=g)[:k].tolist())
        masked[row, pick] = tokenizer.mask_token_id
        positions += [(row, j) for j in pick]
    return masked, torch.tensor(positions, dtype=torch.int64)


def _features(fn, ids: torch.Tensor, batch: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([fn(ids[i:i + batch]).float().cpu() for i in range(0, ids.shape[0], batch)])
