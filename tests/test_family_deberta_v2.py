"""The deberta_v2 family: its layer names at real size, its graph module against Transformers, and
the tiny model's exported graphs (fp16, FP8 Q/DQ) run by ONNX Runtime and by ONNX's reference
evaluator against torch.

The recipe quantizes query_proj and key_proj on the hidden rows only: their calls on the
relative position embeddings (the call site `relative_positions`) stay in the work precision.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch

from quantstudy import config, export, families, quantization, timing, transforms
from quantstudy.backends import torch_backend
from quantstudy.families.base import Setting
from quantstudy.families.deberta_v2_model import POSITIONS

from helpers import assert_declares_its_quality_columns, observed_amax, skip_without_gpu, tiny_checkpoint

import onnx  # noqa: E402  (pinned: a broken install fails, it does not skip)
from quantstudy.backends.onnxruntime_backend import session as ort_session  # noqa: E402

FAMILY = families.get("deberta_v2")
PROJECTIONS = ["attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj",
               "attention.output.dense", "intermediate.dense", "output.dense"]
RECIPE = {"quantize": [f"deberta.encoder.layer.*.{p}" for p in PROJECTIONS], "dequantize_dtype": "float16",
          "exclude_calls": [POSITIONS]}
FP8 = {"precision": "float16", "transforms": [{"fp8": {}}]}
VARIANTS = {
    "fp16": {"precision": "float16", "transforms": []},
    "fp8": FP8,
    # All in fp32 but the FP8 rounding: checks the Q/DQ math to float32 rounding.
    "fp32-fp8": {"precision": "float32", "transforms": [{"fp8": {}}, {"fp32_dequantize": {}}]},
    # FP8 on every call, the positional products too: what `exclude_calls` changes.
    "fp8-all-calls": {"precision": "float16", "transforms": [{"fp8": {"exclude_calls": []}}]},
}
# 24 tokens reach the tiny model's log-bucketed distances (8 buckets); batch 2: a row filling
# 3/4 of the window and a [CLS][SEP]-only row, so padding and the mask are exercised.
SETTING = Setting("b2-w24", 2, {"window": 24})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny checkpoints written as files, loaded like real ones."""
    out = {}
    for arch, seed in (("tiny-deberta-v3-base", 0), ("tiny-deberta-v3-large", 1), ("tiny-deberta-v3-base-mnli", 2)):
        out[arch] = tiny_checkpoint(FAMILY, arch, tmp_path_factory.mktemp(arch), {"seed": seed})
    return out


@pytest.fixture(scope="module")
def base(checkpoints):
    """The tiny base model's inputs and amax (max calibration's statistic, by forward hooks on a real
    forward: every call of a layer, the positional ones included, as ModelOpt sees them)."""
    ckpt = checkpoints["tiny-deberta-v3-base"]
    inputs = FAMILY.example_inputs(ckpt, "main", SETTING)
    return {"checkpoint": ckpt, "inputs": inputs, "amax": observed_amax(FAMILY.module(ckpt, "main", SETTING), [inputs])}


def _variant(base, name: str):
    return transforms.apply_variant(FAMILY.module(base["checkpoint"], "main", SETTING), VARIANTS[name], RECIPE,
                                    base["amax"])


@pytest.fixture(scope="module")
def exported(base, tmp_path_factory):
    """Each variant's ONNX (export info) and its torch fake-quant outputs."""
    made = {}

    def get(name: str) -> dict:
        if name not in made:
            model, summary = _variant(base, name)
            with torch.no_grad():
                expected = model(**base["inputs"])["features"].float()
            info = export.export(model, base["inputs"], tmp_path_factory.mktemp(name))
            made[name] = {"info": info, "summary": summary, "expected": expected}
        return made[name]
    return get


def _ort(path, inputs: dict) -> torch.Tensor:
    session = ort_session(path)
    return torch.from_numpy(session.run(["features"], {k: v.numpy() for k, v in inputs.items()})[0]).float()


def _recipe_layers(layers: list[str]) -> list[str]:
    return sorted(quantization.select(layers, RECIPE["quantize"]))


def _matmul_feeds(path) -> dict[str, list[str]]:
    """What feeds every MatMul of a graph: `fp8 activation` / `fp8 weight` (a DequantizeLinear of a
    computed tensor / of an initializer), `<dtype> weight` (an initializer), or the producing op."""
    g = onnx.load(str(path)).graph
    inits = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.data_type).name for i in g.initializer}
    made_by = {o: n for n in g.node for o in n.output}

    def feed(name: str) -> str:
        if name in inits:
            return f"{inits[name]} weight"
        node = made_by.get(name)
        if node is None:
            return "graph input"
        if node.op_type == "DequantizeLinear":
            return "fp8 weight" if node.input[0] in inits else "fp8 activation"
        return node.op_type
    return {n.name: [feed(i) for i in n.input] for n in g.node if n.op_type == "MatMul"}


@pytest.mark.parametrize("arch,blocks", [("deberta-v3-base", 12), ("deberta-v3-large", 24)])
def test_recipe_selects_the_write_ups_fp8_layers(arch, blocks):
    """At real size (meta device): six projections per layer, 72 in base and 144 in large, and
    these are all the linear layers of the graph module."""
    layers = FAMILY.quantizable_layers(config.load_architecture(arch))
    chosen = _recipe_layers(layers)
    assert len(chosen) == 6 * blocks == len(layers)
    per_block = collections.Counter(n.split(".", 4)[4] for n in chosen)  # deberta.encoder.layer.<i>.<projection>
    assert per_block == {p: blocks for p in PROJECTIONS}


@pytest.mark.parametrize("arch", ["tiny-deberta-v3-base", "tiny-deberta-v3-large"])
def test_graph_module_is_the_transformers_model(arch, checkpoints):
    """The fp32 graph module computes DebertaV2Model's own math: the same ops in the same order, so
    bit for bit (padding, the mask and a [CLS][SEP]-only row included)."""
    ckpt = checkpoints[arch]
    inputs = FAMILY.example_inputs(ckpt, "main", SETTING)
    assert inputs["attention_mask"].sum(1).tolist() == [18, 2]
    with torch.no_grad():
        got = FAMILY.module(ckpt, "main", SETTING)(**inputs)["features"]
        want = FAMILY.load_reference(ckpt)(**inputs).last_hidden_state
    assert got.shape == (2, 24, FAMILY.hf_config(config.load_architecture(arch)).hidden_size)
    assert torch.equal(got, want)


# How far ONNX Runtime may be from torch fake-quant (features: layer-norm outputs, |x| up to ~5).
# fp16 graphs: ORT's CPU kernels compute fp16 ops in fp32 and round once where torch rounds each
# op, and round MatMul and bias Add separately where torch's addmm rounds once: a few fp16 ulps
# (2^-8 at |x| ~ 4) after two layers. FP8 in fp16: the same, plus an fp16-level difference in
# front of a quantizer can move a value across an FP8 rounding boundary (one e4m3 step, 1/8 of
# it, times a weight), so a few elements may go further: bounded, and rare.
TOLERANCES = {"fp16": 0.02, "fp8": 0.05, "fp32-fp8": 1e-4}


@pytest.mark.parametrize("variant", ["fp16", "fp8", "fp32-fp8"])
def test_onnxruntime_runs_the_exported_graph_as_torch_computes_it(variant, base, exported):
    case = exported(variant)
    got, want = _ort(case["info"]["onnx"], base["inputs"]), case["expected"]
    assert got.shape == want.shape and torch.isfinite(want).all()
    diff = (got - want).abs()
    tol = TOLERANCES[variant]
    print(f"{variant}: max abs diff {diff.max():.3g}, beyond {tol}: {(diff > tol).float().mean():.2%}")
    if variant == "fp32-fp8":
        # float32 reordering upstream may flip a value on an FP8 rounding boundary: allow such
        # flips, each bounded by one FP8 step's effect, on under 1% of the elements.
        assert (diff > tol).float().mean() < 1e-2
        assert diff.max() < 0.05
    else:
        assert diff.max() <= tol


def test_fp8_graph_has_qdq_exactly_on_the_recipes_hidden_rows(base, exported):
    """Every recipe layer's hidden-row MatMul reads an FP8 activation and an FP8 weight; the
    positional products of query_proj and key_proj are plain MatMuls on the fp16 weight; no other
    MatMul reads FP8. (query_proj and key_proj read one activation at one scale, so the exporter
    gives them one shared Quantize / Dequantize pair.)"""
    layers = _recipe_layers(FAMILY.quantizable_layers(config.load_architecture("tiny-deberta-v3-base")))
    qk = [n for n in layers if n.endswith(("query_proj", "key_proj"))]
    case = exported("fp8")
    assert case["summary"]["fp8_layers"] == layers == case["info"]["fp8_layers"]
    assert case["summary"]["unquantized_calls"] == {n: [POSITIONS] for n in qk}
    feeds = _matmul_feeds(case["info"]["onnx"])
    for n in layers:
        assert feeds.pop(f"{n}/MatMul") == ["fp8 activation", "fp8 weight"], n
    for n in qk:
        positional = feeds.pop(f"{n}.work_precision/MatMul")
        assert positional[1] == "float16 weight" and not positional[0].startswith("fp8"), (n, positional)
    assert not [m for m, f in feeds.items() if any(x.startswith("fp8") for x in f)]


def test_positional_products_are_the_work_precision_ones(base):
    """In a forward of the FP8 variant, the positional products of query_proj and key_proj equal the
    fp16 variant's bit for bit (the relative embeddings do not depend on the input, so both see the
    same rows), while the hidden rows are FP8; quantizing every call changes the positional products."""
    calls: dict[str, list[torch.Tensor]] = {}

    def record(model, kind):
        def hook(m, _inp, out, name):
            calls.setdefault(f"{kind} {name}", []).append(out.detach().clone())
        for name, m in model.named_modules():
            if name.endswith(("query_proj", "key_proj", "query_proj.work_precision", "key_proj.work_precision")):
                m.register_forward_hook(lambda m, i, o, name=name: hook(m, i, o, name))
        with torch.no_grad():
            return model(**base["inputs"])["features"]

    record(_variant(base, "fp16")[0], "fp16")
    fp8 = record(_variant(base, "fp8")[0], "fp8")
    every = record(_variant(base, "fp8-all-calls")[0], "every")
    qk = [n for n in calls if n.startswith("fp16 ")]
    assert len(qk) == 4  # two layers, query_proj and key_proj
    for key in qk:
        name = key.removeprefix("fp16 ")
        hidden, positional = calls[key]  # plain call on the hidden rows, then the positional one
        assert positional.shape[:2] == (1, 16)  # the 2 x 8 bucket embeddings
        fp8_hidden, = calls[f"fp8 {name}"]  # the FP8 layer is called once, on the hidden rows ...
        fp8_positional, = calls[f"fp8 {name}.work_precision"]  # ... its positional call runs here
        assert torch.equal(fp8_positional, positional), name
        assert not torch.allclose(fp8_hidden, hidden, atol=1e-3), f"{name}: the hidden rows are not FP8"
        every_hidden, every_positional = calls[f"every {name}"]
        if ".layer.0." in name:  # later layers see what the quantized positional products changed
            assert torch.equal(every_hidden, fp8_hidden)
        assert not torch.allclose(every_positional, positional, atol=1e-3), f"{name}: positional rows not FP8"
    assert not torch.equal(fp8, every)


def test_exclude_calls_names_declared_call_sites(base):
    """A recipe without `exclude_calls` quantizes every call (no work-precision path is made); one that
    names a call site no layer declares is refused, and so is a call at an undeclared site."""
    every = {k: v for k, v in RECIPE.items() if k != "exclude_calls"}
    model, summary = transforms.apply_variant(FAMILY.module(base["checkpoint"], "main", SETTING), FP8, every,
                                              base["amax"])
    assert "unquantized_calls" not in summary
    assert not [n for n, m in model.named_modules() if isinstance(m, quantization.WorkPrecisionLinear)]
    typo = {"precision": "float16", "transforms": [{"fp8": {"exclude_calls": ["relative_position"]}}]}
    with pytest.raises(ValueError, match="relative_position, which no layer declares"):
        transforms.apply_variant(FAMILY.module(base["checkpoint"], "main", SETTING), typo, RECIPE, base["amax"])
    with pytest.raises(ValueError, match="not a declared call site"):
        quantization.linear_call(torch.nn.Linear(4, 4), torch.zeros(1, 4), POSITIONS)


FP8_GPU = torch.cuda.is_available() and quantization.fp8_gemm_supported("cuda")


@pytest.mark.gpu
def test_real_fp8_gemms_keep_the_positional_products_in_fp16(base):
    """On a GPU: the FP8 layers run as torch._scaled_mm, the positional products are the fp16 GEMM's bit
    for bit, and the eager graph module captures as a CUDA graph (no CPU tensor made in its forward, as
    Transformers' make_log_bucket_position makes one)."""
    if not FP8_GPU:
        skip_without_gpu("needs a CUDA GPU with FP8 GEMMs (compute capability 8.9+)")
    inputs = {k: v.cuda() for k, v in base["inputs"].items()}
    fp16, fp8 = _variant(base, "fp16")[0].cuda(), _variant(base, "fp8")[0].cuda()
    assert len(quantization.use_fp8_gemm(fp8, "cuda")) == 12
    q = "deberta.encoder.layer.0.attention.self.query_proj"
    out: dict[str, list[torch.Tensor]] = {}
    for model, name in ((fp16, q), (fp8, f"{q}.work_precision")):
        hook = model.get_submodule(name).register_forward_hook(
            lambda _m, _i, o, name=name: out.setdefault(name, []).append(o.clone()))
        with torch.no_grad():
            model(**inputs)
        hook.remove()
    assert torch.equal(out[f"{q}.work_precision"][0], out[q][1])
    with torch.no_grad():
        eager = fp8(**inputs)["features"]
        fake = _variant(base, "fp8")[0](**base["inputs"])["features"]
    assert torch.equal(torch_backend.Runner(fp8, inputs, "cuda")(inputs)["features"], eager)
    # cuBLAS FP8 and fp16 GEMMs against CPU fake-quant: fp16 rounding, the odd FP8 flip (real tokens;
    # padded positions are ill-conditioned, see the reference evaluator test).
    real = base["inputs"]["attention_mask"].bool()
    assert (eager.float().cpu() - fake.float())[real].abs().max() <= 0.02


def test_reference_evaluator_agrees_with_onnxruntime(base, exported):
    """Q/DQ semantics, independently: ONNX's reference evaluator (numpy) on the FP8 graphs agrees
    with ONNX Runtime. The fp32 graph: to float32 rounding, every token. The fp16 graph: within a
    few fp16 ulps (2^-8 at |x| ~ 4) on the real tokens, where numpy rounds every fp16 op (its
    GEMMs and layer norms too) and ORT computes them in fp32. Padded positions are left out there:
    their embeddings are masked to zero, so their layer norms normalise a near-constant row (std
    ~1e-3 in the tiny model) and multiply that rounding difference by ~1000 (measured 0.1)."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops import op_gather_elements

    class GatherElements(op_gather_elements.GatherElements):
        """onnx 1.23's reference GatherElements rejects a negative axis (its shape check slices at
        axis + 1 = 0); the graph gathers along axis -1 (torch.gather(dim=-1)): the same op, the
        axis made non-negative."""

        def _run(self, data, indices, axis=None):
            return super()._run(data, indices, axis=axis % data.ndim)

    feeds = {k: v.numpy() for k, v in base["inputs"].items()}
    real = base["inputs"]["attention_mask"].bool()
    for variant, rows, tol in (("fp32-fp8", torch.ones_like(real), 1e-5), ("fp8", real, 0.02)):
        path = exported(variant)["info"]["onnx"]
        ops = {n.op_type for n in onnx.load(path).graph.node}
        assert {"QuantizeLinear", "DequantizeLinear", "GatherElements", "Tile", "LayerNormalization"} <= ops
        evaluator = ReferenceEvaluator(path, new_ops=[GatherElements])
        got = torch.from_numpy(evaluator.run(["features"], feeds)[0]).float()
        diff = (got - _ort(path, base["inputs"])).abs()[rows]
        print(f"{variant}: reference evaluator vs ORT max abs diff {diff.max():.3g}")
        assert diff.max() <= tol, variant


def test_torch_profile_groups(base):
    """The torch runner's CPU profile of the FP8 variant in the write-up's groups: FP8 projections,
    the positional products as fp16 projection GEMMs, attention matmuls and softmax."""
    model, _ = _variant(base, "fp8")
    runner = torch_backend.Runner(model, base["inputs"], "cpu")
    result = timing.kernel_profile(runner, 3, lambda *a: FAMILY.kernel_group(*a, setting=SETTING),
                                   set(FAMILY.regions) | {quantization.FP8_REGION})
    assert set(result["groups_ms"]) <= set(FAMILY.kernel_groups)
    for group in ("FP8 projection GEMMs", "projection GEMMs", "attention matmuls", "softmax", "pointwise"):
        assert result["groups_ms"].get(group, 0) > 0, group
    gemms = [k for k in result["top_kernels"] if k["group"] == "projection GEMMs"]
    assert gemms, "the positional products run as work-precision GEMMs"
    # Ops per call: one softmax per layer, and the two positional products (query_proj, key_proj on
    # the relative embeddings) of each of the two layers as work-precision GEMMs.
    counts = result["groups_count"]
    assert counts["softmax"] == 2 and counts["projection GEMMs"] == 4
    assert counts["attention matmuls"] == 8  # QK^T, c2p, p2c and PV of each layer


def _rows():
    import datasets

    from quantstudy import fixtures

    vocab = fixtures.words(100)
    texts = fixtures.passages(30, seed=3, vocab=vocab) + ["", " = A heading = "]
    passages = datasets.Dataset.from_dict({"text": texts})
    pairs = datasets.Dataset.from_dict({"premise": texts[:20], "hypothesis": texts[5:25],
                                        "label": [0, 1, 2, -1] * 5, "idx": list(range(20))})
    return passages, pairs


def test_draw_samples_passages_and_pairs(checkpoints):
    """Seeded, within token bounds, with content hashes; headings, blank lines and unlabelled pairs skipped."""
    import hashlib

    tok = FAMILY.processor(checkpoints["tiny-deberta-v3-base"])
    passages, pairs = _rows()
    spec = {"kind": "passages", "count": 10, "min_tokens": 16, "max_tokens": 200, "seed": 0}
    drawn = FAMILY.draw_samples(passages, spec, tok)
    assert drawn == FAMILY.draw_samples(passages, spec, tok)
    assert drawn != FAMILY.draw_samples(passages, {**spec, "seed": 1}, tok)
    assert 0 < len(drawn) <= 10
    for s in drawn:
        assert set(s) == {"id", "text", "tokens", "sha256"}
        assert s["text"] == passages[s["id"]]["text"].strip() and 16 <= s["tokens"] <= 200
        assert s["sha256"] == hashlib.sha256(s["text"].encode()).hexdigest()
    nli = FAMILY.draw_samples(pairs, {"kind": "nli_pairs", "count": 8, "seed": 0}, tok)
    assert len(nli) == 8 and all(s["label"] in (0, 1, 2) for s in nli)
    for s in nli:
        assert set(s) == {"id", "premise", "hypothesis", "label", "tokens", "sha256"}
        assert (s["premise"], s["hypothesis"], s["label"]) == (pairs[s["id"]]["premise"],
                                                              pairs[s["id"]]["hypothesis"], pairs[s["id"]]["label"])
    with pytest.raises(ValueError, match="nli_pairs"):
        FAMILY.draw_samples(pairs, {"kind": "sentence_pairs", "count": 1}, tok)


def test_calibration_batches_frame_texts_and_pairs(checkpoints):
    """Texts as [CLS] text [SEP], pairs as [CLS] a [SEP] b [SEP], padded to the window, in the
    samples' order, in batches of 8; the fp32 module runs them."""
    ckpt = checkpoints["tiny-deberta-v3-base"]
    tok = FAMILY.processor(ckpt)
    passages, pairs = _rows()
    samples = (FAMILY.draw_samples(passages, {"kind": "passages", "count": 6, "seed": 0}, tok)
               + FAMILY.draw_samples(pairs, {"kind": "nli_pairs", "count": 5, "seed": 0}, tok))
    samples = samples[::2] + samples[1::2]  # texts and pairs interleaved
    batches = FAMILY.calibration_batches(ckpt, samples, SETTING)
    assert [b["input_ids"].shape for b in batches] == [(8, 24), (3, 24)]
    ids = torch.cat([b["input_ids"] for b in batches])
    mask = torch.cat([b["attention_mask"] for b in batches])
    for row, m, s in zip(ids, mask, samples):
        seps = int((row == tok.sep_token_id).sum())
        assert row[0] == tok.cls_token_id and seps == (2 if "premise" in s else 1)
        assert torch.equal(m, (row != tok.pad_token_id).long())
    with torch.no_grad():
        out = FAMILY.module(ckpt, "main", SETTING)(**batches[1])["features"]
    assert out.shape == (3, 24, 64) and torch.isfinite(out).all()


def test_settings_and_graphs():
    assert FAMILY.check_setting(SETTING) == []
    assert FAMILY.check_setting(Setting("bad", 1, {"height": 8, "width": 8}))
    assert FAMILY.check_setting(Setting("short", 1, {"window": 1}))
    graph = FAMILY.graphs(Setting("b32-w256", 32, {"window": 256}), {})["main"]
    assert {k: (v.dtype, v.shape, dict(v.dynamic)) for k, v in graph.inputs.items()} == {
        "input_ids": ("int64", (32, 256), {}), "attention_mask": ("int64", (32, 256), {})}
    assert graph.outputs == ("features",)


# --- reference and evaluate -------------------------------------------------------------------

METRICS = {"mnli_labels": ["entailment", "neutral", "contradiction"], "one_token_inputs": 5, "stress_inputs": 4}
SEEDS = {"one_token": 0, "stress": 0}
EVAL_SETTING = Setting("w32", 1, {"window": 32})


def _tiny_data(files: dict, kind: str, rows: int):
    """A split of the family's tiny dataset files, read as the workflow reads it (parquet)."""
    import io

    import datasets
    import pandas as pd

    (path, data), = FAMILY.tiny_dataset_files(files, {"kind": kind, "seed": 0, "rows": rows},
                                              {"vocab_size": 512}).items()
    assert path.endswith(".parquet")
    return datasets.Dataset.from_pandas(pd.read_parquet(io.BytesIO(data)))


@pytest.fixture(scope="module")
def eval_samples(checkpoints):
    tok = FAMILY.processor(checkpoints["tiny-deberta-v3-base"])
    texts = _tiny_data({"test": "wikitext-2-raw-v1/test-*.parquet"}, "passages", 40)
    pairs = _tiny_data({"validation_matched": "mnli/validation_matched-*.parquet"}, "nli_pairs", 40)
    return {"heldout": FAMILY.draw_samples(texts, {"kind": "passages", "count": 6, "min_tokens": 8, "seed": 1}, tok),
            "mnli": FAMILY.draw_samples(pairs, {"kind": "nli_pairs", "count": 12, "seed": 1}, tok)}


def _engine(module, batch: int = 1):
    """The harness's view (steps_measure.batched_run) of a module run as the engine."""
    from quantstudy import steps_measure

    def runner(inputs):
        with torch.no_grad():
            return module(**inputs)
    return steps_measure.batched_run({"main": runner}, batch)


def test_tiny_nli_pairs_are_labelled_like_mnli():
    pairs = _tiny_data({"train": "mnli/train-*.parquet"}, "nli_pairs", 60)
    assert set(pairs.column_names) == {"premise", "hypothesis", "label", "idx"}
    assert set(pairs["label"]) == {0, 1, 2}
    # Entailed hypotheses keep more of their premise's words than contradicting ones.
    overlap = lambda r: len(set(r["hypothesis"].split()) & set(r["premise"].split())) / len(set(r["hypothesis"].split()))
    by = {k: [overlap(r) for r in pairs if r["label"] == k] for k in (0, 2)}
    assert sum(by[0]) / len(by[0]) > sum(by[2]) / len(by[2])


def test_tiny_head_checkpoint_is_a_classifier_with_labels_by_name(checkpoints):
    """The NLI-head checkpoint loads as DebertaV2ForSequenceClassification (safetensors) with the
    architecture's id2label, in another order than MNLI's; its encoder is the graph module's."""
    ckpt = checkpoints["tiny-deberta-v3-base-mnli"]
    model, head, id2label = FAMILY.head(ckpt)
    assert model.num_labels == 3 and id2label == {0: "contradiction", 1: "entailment", 2: "neutral"}
    assert FAMILY.head(checkpoints["tiny-deberta-v3-base"]) is None
    inputs = FAMILY.example_inputs(ckpt, "main", SETTING)
    with torch.no_grad():
        features = FAMILY.module(ckpt, "main", SETTING)(**inputs)["features"]
        assert torch.equal(head(features), model(**inputs).logits)


def test_an_engine_equal_to_the_reference_measures_no_error(checkpoints, eval_samples):
    """The fp32 graph module as the engine: feature error 0, one-token cosine 1, and on the head
    checkpoint agreement 1 and no accuracy difference; the reference's accuracy maps the head's
    classes to MNLI's labels by name. A checkpoint without a head has no MNLI block."""
    for arch in ("tiny-deberta-v3-base", "tiny-deberta-v3-base-mnli"):
        ckpt = checkpoints[arch]
        tensors, blocks = FAMILY.reference(ckpt, eval_samples, EVAL_SETTING, METRICS, SEEDS, "cpu")
        mask = tensors["heldout_attention_mask"].bool()
        assert tensors["heldout_features"].shape == (int(mask.sum()), 64)  # real tokens only
        result = FAMILY.evaluate(ckpt, _engine(FAMILY.module(ckpt, "main", EVAL_SETTING)), tensors, eval_samples,
                                 EVAL_SETTING, METRICS, SEEDS, "cpu", {})
        b = result.blocks
        assert b["features"]["mean"] <= 1e-6 and b["features"]["texts"] == len(eval_samples["heldout"])
        assert b["one_token"]["min"] >= 1 - 1e-6 and b["one_token"]["tokens"] == 3 * METRICS["one_token_inputs"]
        assert result.total_nonfinite == 0
        assert set(result.nonfinite) == {"heldout", "mnli", "one_token", "stress"}
        assert b["checkpoint"]["classification_head"] == (arch.endswith("mnli"))
        if not arch.endswith("mnli"):
            assert "mnli" not in b and "mnli" not in blocks
            continue
        assert b["mnli"]["agreement"] == 1.0 and b["mnli"]["accuracy_diff_points"] == 0.0
        assert_declares_its_quality_columns(FAMILY, result, blocks, list(eval_samples))
        model, _, _ = FAMILY.head(ckpt)
        enc = FAMILY.encode(FAMILY.processor(ckpt), eval_samples["mnli"], 32)
        with torch.no_grad():
            classes = model(**enc).logits.argmax(-1)
        names = [model.config.id2label[int(c)] for c in classes]
        gold = [METRICS["mnli_labels"][p["label"]] for p in eval_samples["mnli"]]
        want = sum(n == g for n, g in zip(names, gold)) / len(gold)
        assert blocks["mnli"]["accuracy"] == b["mnli"]["reference_accuracy"] == pytest.approx(want)


def test_nonfinite_rows_are_counted_and_fail_the_head(checkpoints, eval_samples):
    """An engine whose embedding of one token is NaN: every text holding that token is non-finite
    (attention spreads it over the text, not to other texts), is counted in the scan, left out of the
    feature error, and disagrees with PyTorch in the head check; the other rows are unaffected."""
    ckpt = checkpoints["tiny-deberta-v3-base-mnli"]
    tensors, _ = FAMILY.reference(ckpt, eval_samples, EVAL_SETTING, METRICS, SEEDS, "cpu")
    ids, mask = tensors["mnli_input_ids"], tensors["mnli_attention_mask"].bool()
    counts = torch.bincount(ids[mask].long(), minlength=512)
    rows_with = lambda t: int(((ids == t) & mask).any(1).sum())
    token = next(t for t in counts.argsort(descending=True).tolist() if t > 4 and 0 < rows_with(t) < ids.shape[0])
    broken = FAMILY.module(ckpt, "main", EVAL_SETTING)
    with torch.no_grad():
        broken.deberta.embeddings.word_embeddings.weight[token] = math.nan
    result = FAMILY.evaluate(ckpt, _engine(broken), tensors, eval_samples, EVAL_SETTING, METRICS, SEEDS, "cpu", {})
    bad = rows_with(token)
    assert result.nonfinite["mnli"] == {"bad": bad, "of": ids.shape[0]}
    held = tensors["heldout_input_ids"]
    held_bad = int(((held == token) & tensors["heldout_attention_mask"].bool()).any(1).sum())
    assert result.nonfinite["heldout"]["bad"] == held_bad
    assert result.blocks["features"]["nonfinite_texts"] == held_bad
    assert result.blocks["mnli"]["nonfinite_pairs"] == bad
    assert result.blocks["mnli"]["agreement"] == pytest.approx(1 - bad / ids.shape[0])


# --- the recipe's GEMMs alone (g of the Amdahl bound) -----------------------------------------

def test_gemm_calls_are_the_recipe_layers_on_the_hidden_rows(base, one_cpu_thread):
    """What the gemm rule times: the six projections of each of the 2 tiny layers, each once, on the
    batch x window hidden rows; the positional calls of query_proj and key_proj, which the recipe
    keeps in fp16 (`exclude_calls`), are not FP8 GEMMs and are not counted, unless a variant
    quantizes them too."""
    from quantstudy import gemm

    calls = {}
    for name in ("fp8", "fp8-all-calls"):
        model, _ = _variant(base, name)
        calls[name] = gemm.recipe_calls(model, quantization.cast_inputs(base["inputs"], "float16"))
    rows, h, i = SETTING.batch * SETTING["window"], 64, 256
    dims = {"attention.self.query_proj": [rows, h, h], "attention.self.key_proj": [rows, h, h],
            "attention.self.value_proj": [rows, h, h], "attention.output.dense": [rows, h, h],
            "intermediate.dense": [rows, h, i], "output.dense": [rows, i, h]}
    assert sorted((c["layer"], tuple(c["dims"])) for c in calls["fp8"]) == sorted(
        (f"deberta.encoder.layer.{n}.{p}", tuple(d)) for n in (0, 1) for p, d in dims.items())
    extra = collections.Counter(c["layer"].rsplit(".", 1)[-1] for c in calls["fp8-all-calls"]) - collections.Counter(
        c["layer"].rsplit(".", 1)[-1] for c in calls["fp8"])
    assert extra == {"query_proj": 2, "key_proj": 2}  # each layer's positional products, now FP8
    shapes = gemm.time_calls({"fp8": calls["fp8"]}, {"fp8": "float16"}, config.Target(name="cpu-torch", backend="torch", device="cpu"),
                             {"warmup": 1, "rounds": 2, "calls_per_round": 1})
    assert sorted((s["dims"][1:], s["copies"]) for s in shapes.values()) == [([h, h], 8), ([h, i], 2), ([i, h], 2)]
