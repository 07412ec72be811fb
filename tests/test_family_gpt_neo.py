"""gpt_neo family: the recipe's layers at real size, the static-cache engines against Transformers,
and both engines exported (fp16, FP8 Q/DQ) and run in ONNX Runtime and the ONNX reference evaluator.

The embedded default's tiny random-init GPT-Neo cut to 2 layers (one global, one local attention
layer) with a local window of 8, prefill 12 and cache 16: prompts and decode positions pass the
window, so the local layer's mask is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantstudy import config, export, families, quantization, timing, transforms
from quantstudy.families import base, gpt_neo_data, gpt_neo_metrics

from helpers import assert_declares_its_quality_columns, observed_amax, tiny_checkpoint

from quantstudy.backends.onnxruntime_backend import session as ort_session  # noqa: E402  (pinned: a broken install fails, it does not skip)

# The write-up's recipe: q_proj, k_proj, v_proj, c_fc and c_proj of every layer.
RECIPE = {"quantize": ["transformer.h.*.attn.attention.q_proj", "transformer.h.*.attn.attention.k_proj",
                       "transformer.h.*.attn.attention.v_proj", "transformer.h.*.mlp.c_fc",
                       "transformer.h.*.mlp.c_proj"],
          "dequantize_dtype": "float16"}
VARIANTS = {
    "fp16": {"precision": "float16", "transforms": []},
    "fp8": {"precision": "float16", "transforms": [{"fp8": {}}]},
    # All of it in fp32 but the FP8 rounding: the Q/DQ math, checked to float32 rounding.
    "fp32-fp8": {"precision": "float32", "transforms": [{"fp8": {}}, {"fp32_dequantize": {}}]},
}
SETTING = base.Setting("p12-c16", 1, {"prefill": 12, "cache": 16})
# Two layers (one global, one local; the tolerances below were measured over two) and a window of 8.
ARCH = {**config.load_architecture("tiny-gpt-neo-125m"), "num_layers": 2,
        "attention_types": [[["global", "local"], 1]], "window_size": 8}
EPS32, EPS16 = torch.finfo(torch.float32).eps, torch.finfo(torch.float16).eps


@pytest.fixture(scope="module")
def fam():
    return families.get("gpt_neo")


@pytest.fixture(scope="module")
def checkpoint(fam, tmp_path_factory):
    """The tiny checkpoint, written as files and loaded like a real one."""
    return tiny_checkpoint(fam, ARCH, tmp_path_factory.mktemp("tiny-gpt-neo"))


def _cache(out: dict) -> dict:
    """A graph's present_* outputs as the next decode's past_* inputs."""
    return {k.replace("present_", "past_"): v for k, v in out.items() if k.startswith("present_")}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> float:
    """Max abs difference over the output's scale; asserts it is within `rel`."""
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= rel, f"max abs diff {err:.3g} of the output's scale > {rel:.3g}"
    return err


# --- real size -------------------------------------------------------------------------------

def test_recipe_selects_the_write_ups_60_projections(fam):
    """gpt-neo-125m on the meta device: 12 layers x (q, k, v, out_proj, c_fc, c_proj) + the tied
    lm_head = 73 linears; the recipe selects q, k, v, c_fc and c_proj of all 12 = 60, never out_proj
    or lm_head."""
    layers = fam.quantizable_layers(config.load_architecture("gpt-neo-125m"))
    assert len(layers) == 73 and "lm_head" in layers
    chosen = quantization.select(layers, RECIPE["quantize"])
    assert len(chosen) == 60
    for kind in ("q_proj", "k_proj", "v_proj", "c_fc", "c_proj"):
        assert sum(n.endswith(f".{kind}") for n in chosen) == 12
    assert not [n for n in chosen if n.endswith("out_proj") or n == "lm_head"]
    assert len([n for n in layers if n.endswith(".out_proj")]) == 12


def test_real_size_graphs(fam):
    """The write-up's setting (prefill 256, cache 256, batch 1): 12 layers' caches [1, 12, 256, 64]."""
    graphs = fam.graphs(base.Setting("p256-c256", 1, {"prefill": 256, "cache": 256}),
                        config.load_architecture("gpt-neo-125m"))
    prefill, decode = graphs["prefill"], graphs["decode"]
    assert prefill.inputs["input_ids"].shape == (1, 256)
    assert prefill.outputs[0] == "logits" and len(prefill.outputs) == 1 + 24
    assert decode.inputs["input_ids"].shape == (1, 1) and decode.inputs["position"].shape == (1,)
    assert decode.inputs["past_value_11"].shape == (1, 12, 256, 64)
    assert decode.outputs == prefill.outputs
    assert not any(spec.dynamic for g in graphs.values() for spec in g.inputs.values())  # CUDA graphs


# --- the contract on the tiny model ----------------------------------------------------------

def test_settings(fam):
    assert isinstance(fam, base.Family)
    assert fam.check_setting(SETTING) == []
    assert fam.check_setting(base.Setting("s", 1, {"prefill": 32, "cache": 16}))  # does not fit
    assert fam.check_setting(base.Setting("s", 1, {"window": 16}))
    assert fam.check_setting(base.Setting("s", 0, {"prefill": 8, "cache": 16}))


def test_reference_loads_in_the_asked_dtype(fam, checkpoint):
    """The study's reference is bf16; the tied lm_head stays tied after loading."""
    ref = fam.load_reference(checkpoint, torch.bfloat16)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert ref.lm_head.weight.data_ptr() == ref.transformer.wte.weight.data_ptr()
    assert not ref.training


def test_graph_inputs_and_outputs(fam, checkpoint):
    """example_inputs have the graphs' names, dtypes and shapes; the modules return the graphs' outputs."""
    graphs = fam.graphs(SETTING, ARCH)
    for name, graph in graphs.items():
        inputs = fam.example_inputs(checkpoint, name, SETTING)
        assert list(inputs) == list(graph.inputs)
        for key, spec in graph.inputs.items():
            assert (str(inputs[key].dtype).removeprefix("torch."), tuple(inputs[key].shape)) == (spec.dtype, spec.shape)
        with torch.no_grad():
            out = fam.module(checkpoint, name, SETTING)(**inputs)
        assert tuple(out) == graph.outputs
        assert out["logits"].shape == (1, SETTING["prefill"] if name == "prefill" else 1, 512)
    decode = fam.example_inputs(checkpoint, "decode", SETTING)
    assert decode["position"].tolist() == [12]  # the token after a full prefill
    assert decode["past_key_1"][:, :, 12:].abs().max() == 0  # rows not yet written are zero


def test_static_cache_matches_transformers_incremental_decoding(fam, checkpoint):
    """fp32 prefill of a right-padded prompt, then decode steps, equal Transformers' own forward and
    its incremental decoding (past_key_values) to float32 rounding: logits and every cache row.

    Float32 rounding: the static cache sums over all `cache` keys (zeros where masked), Transformers
    over the keys so far; reordered sums of this length stay within a few float32 ulps of the
    output's scale (measured 3e-7), 32 ulps allowed.
    """
    ref = fam.load_reference(checkpoint, torch.float32)
    prefill, decode = fam.module(checkpoint, "prefill", SETTING), fam.module(checkpoint, "decode", SETTING)
    g = torch.Generator().manual_seed(1)
    n, steps = 5, 10  # positions 5..14: past the local window (8), inside the cache (16)
    tokens = torch.randint(0, 512, (1, n + steps), generator=g)
    padded = torch.cat([tokens[:, :n], torch.randint(0, 512, (1, SETTING["prefill"] - n), generator=g)], dim=1)
    tol = 32 * EPS32
    with torch.no_grad():
        whole = ref(input_ids=padded).logits
        out = prefill(input_ids=padded)
        _close(out["logits"], whole, tol)  # the full prompt, padding included, as Transformers runs it
        want = ref(input_ids=tokens[:, :n], use_cache=True)
        _close(out["logits"][:, :n], want.logits, tol)
        past, hf_cache = _cache(out), want.past_key_values
        no_window = fam.module(checkpoint, "decode", SETTING)
        no_window.windows = [None] * len(no_window.windows)
        without = []
        for step in range(steps):
            p = n + step
            token = tokens[:, p:p + 1]
            want = ref(input_ids=token, past_key_values=hf_cache, use_cache=True)
            hf_cache = want.past_key_values
            got = decode(input_ids=token, position=torch.tensor([p]), **past)
            _close(got["logits"], want.logits, tol)
            for i, layer in enumerate(hf_cache.layers):
                _close(got[f"present_key_{i}"][:, :, :p + 1], layer.keys, tol)
                _close(got[f"present_value_{i}"][:, :, :p + 1], layer.values, tol)
                # Rows p+1..prefill-1 still hold the padding's keys (masked: the logits match); rows
                # neither prefilled nor decoded stay zero.
                assert got[f"present_key_{i}"][:, :, max(p + 1, SETTING["prefill"]):].abs().max() == 0
            without.append((no_window(input_ids=token, position=torch.tensor([p]), **past)["logits"] - want.logits)
                           .abs().max() / want.logits.abs().max())
            past = _cache(got)
    # Discriminating: ignoring the local layer's window changes the logits once a position passes it.
    window = ARCH["window_size"]
    assert max(without[:window - n]) <= tol < min(without[window - n:])


# --- export, ONNX Runtime, the ONNX reference evaluator ----------------------------------------

@pytest.fixture(scope="module")
def exported(fam, checkpoint, tmp_path_factory):
    """(graph, variant) -> the variant's inputs, torch fake-quant outputs and its export; amax from
    a prefill forward, shared by both graphs as the study's one amax file is."""
    amax = observed_amax(fam.module(checkpoint, "prefill", SETTING), [fam.example_inputs(checkpoint, "prefill", SETTING)])
    made = {}

    def get(graph: str, variant: str):
        if (graph, variant) not in made:
            spec = VARIANTS[variant]
            fresh = lambda: transforms.apply_variant(fam.module(checkpoint, graph, SETTING), spec, RECIPE, amax)
            model, summary = fresh()
            work = quantization.DTYPES[spec["precision"]]
            # A variant's caches are in its work precision.
            inputs = {k: v.to(work) if v.is_floating_point() else v
                      for k, v in fam.example_inputs(checkpoint, graph, SETTING).items()}
            with torch.no_grad():
                want = model(**inputs)
            info = export.export(fresh()[0], inputs, tmp_path_factory.mktemp(f"{graph}-{variant}"))
            made[graph, variant] = {"model": model, "inputs": inputs, "want": want, "info": info,
                                    "summary": summary}
        return made[graph, variant]
    return get


def _qdq_gemms(path) -> list[str]:
    """The layers whose GEMM takes both operands from a DequantizeLinear: what runs in FP8.

    Counted at the MatMul, not by QuantizeLinear names: q_proj, k_proj and v_proj read the same
    activation with the same scale, and the exporter's optimizer merges their three identical
    QuantizeLinear / DequantizeLinear pairs into one (named after q_proj) that feeds all three.
    """
    import onnx

    graph = onnx.load(str(path)).graph
    producer = {out: node for node in graph.node for out in node.output}
    from_dq = lambda name: name in producer and producer[name].op_type == "DequantizeLinear"
    return sorted(node.name.rsplit("/", 1)[0] for node in graph.node
                  if node.op_type == "MatMul" and all(from_dq(i) for i in node.input))


def _ort(case) -> dict[str, torch.Tensor]:
    session = ort_session(case["info"]["onnx"])
    names = [o.name for o in session.get_outputs()]
    outs = session.run(None, {k: v.numpy() for k, v in case["inputs"].items()})
    return {n: torch.from_numpy(o) for n, o in zip(names, outs)}


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_exported_graphs_run_in_onnxruntime(graph, fam, checkpoint, exported):
    """fp16 and FP8 ONNX of each engine: the graph's I/O, Q/DQ on exactly the recipe's layers, and
    ONNX Runtime's outputs equal to the torch variant's.

    Tolerances, of each output's scale:
    - fp16: ONNX Runtime's CPU kernels compute fp16 ops in fp32 and round once where torch rounds
      every op to fp16; over two layers a few fp16 ulps (measured 0.9 ulp), 4 allowed.
    - FP8 in fp16: an fp16 ulp of difference before a QuantizeLinear (2^-11 of the value) moves
      it across an FP8 rounding boundary (steps of 2^-4 to 2^-3 of it) about once in 2^7 values,
      and each flip spreads through that position's later layers: measured 0.03 of the scale,
      0.06 allowed. This bound cannot tell FP8 from fp16 on its own (FP8 moves this model's logits
      by about as much); the Q/DQ math is checked where it can be, in fp32:
    - FP8 in fp32 with fp32 Dequantize: float32 reordering only (measured 2.6e-7 of the scale);
      a flip would need a value within ~1e-7 of a rounding boundary: 64 float32 ulps allowed,
      and the graph must be far from the same model without FP8 (below).
    """
    graph_spec = fam.graphs(SETTING, ARCH)[graph]
    recipe_layers = sorted(quantization.select(
        fam.quantizable_layers(ARCH), RECIPE["quantize"]))
    assert len(recipe_layers) == 2 * 5
    tolerance = {"fp16": 4 * EPS16, "fp8": 0.06, "fp32-fp8": 64 * EPS32}
    for variant, tol in tolerance.items():
        case = exported(graph, variant)
        info = case["info"]
        assert [i["name"] for i in info["inputs"]] == list(graph_spec.inputs)
        assert [o["name"] for o in info["outputs"]] == list(graph_spec.outputs)
        assert all(tuple(i["shape"]) == graph_spec.inputs[i["name"]].shape for i in info["inputs"])  # static
        assert _qdq_gemms(info["onnx"]) == (recipe_layers if "fp8" in variant else [])
        # export's own list names layers by their QuantizeLinear; q, k and v share one (_qdq_gemms).
        assert set(info["fp8_layers"]) <= set(recipe_layers)
        assert case["summary"]["fp8_layers"] == (recipe_layers if "fp8" in variant else [])
        assert info["fp8_weight_initializers"] == len(_qdq_gemms(info["onnx"]))  # one FP8 weight per layer
        got = _ort(case)
        for name, want in case["want"].items():
            assert got[name].dtype == want.dtype
            _close(got[name], want, tol)
    # Discriminating: the fp32 FP8 graph is far from the fp32 model without FP8 (its Q/DQ round):
    # FP8 moves the logits by about 0.04 of their scale, 10^4 times the tolerance above.
    fp8 = exported(graph, "fp32-fp8")
    with torch.no_grad():
        plain = fam.module(checkpoint, graph, SETTING)(**fp8["inputs"])["logits"]
    assert (_ort(fp8)["logits"] - plain).abs().max() > 0.01 * plain.abs().max()


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_reference_evaluator_agrees_with_onnxruntime(graph, exported):
    """onnx.reference (numpy, op by op from the ONNX spec) runs the FP8 graphs ONNX Runtime runs
    (it has every op they use: float8e4m3fn QuantizeLinear / DequantizeLinear, LayerNormalization,
    ScatterElements ...) and agrees: to float32 rounding in the fp32 graph, where the Q/DQ
    semantics (scale, float8e4m3fn rounding) decide; within the FP8-flip bound of the test above
    in the fp16 graph (the evaluator rounds every fp16 op, ONNX Runtime does not). Saturation is
    not reached here: the amax comes from these very prompts (decode reaches 0.6 to 0.95 of it)."""
    from onnx.reference import ReferenceEvaluator

    for variant, tol in (("fp32-fp8", 64 * EPS32), ("fp8", 0.06)):
        case = exported(graph, variant)
        evaluator = ReferenceEvaluator(case["info"]["onnx"])
        outs = evaluator.run(None, {k: v.numpy() for k, v in case["inputs"].items()})
        got = _ort(case)
        for name, out in zip(evaluator.output_names, outs):
            _close(torch.from_numpy(np.asarray(out)), got[name], tol)


# --- samples, calibration, kernel groups -----------------------------------------------------

def test_draw_samples(fam, checkpoint):
    """Chat prompts (first user turn) and multiple-choice questions, seeded, within token bounds."""
    import datasets

    tokenizer = fam.processor(checkpoint)
    chat = datasets.Dataset.from_list([
        {"messages": [{"role": "system", "content": "ka"}, {"role": "user", "content": f" {' '.join(['lo'] * (i + 1))}\n"},
                      {"role": "assistant", "content": "mi"}]} for i in range(20)])
    spec = {"kind": "chat_prompts", "count": 5, "seed": 3, "min_tokens": 2, "max_tokens": 10}
    samples = fam.draw_samples(chat, spec, tokenizer)
    assert len(samples) == 5 and samples == fam.draw_samples(chat, spec, tokenizer)
    assert [s["id"] for s in samples] != sorted(s["id"] for s in samples)  # seeded order, not the split's
    for s in samples:
        assert s["text"] == " ".join(["lo"] * (s["id"] + 1)) and s["tokens"] == s["id"] + 1
        assert 2 <= s["tokens"] <= 10 and len(s["sha256"]) == 64
    mc = datasets.Dataset.from_list([
        {"id": f"q{i}", "question": "ka lo ?", "choices": {"text": ["mi", "ne ru", "sa"], "label": ["A", "B", "C"]},
         "answerKey": "ABC"[i % 3]} for i in range(6)])
    questions = fam.draw_samples(mc, {"kind": "multiple_choice", "count": 6, "seed": 0}, tokenizer)
    assert sorted(q["id"] for q in questions) == list(range(6))
    assert all(q["answer"] == q["id"] % 3 and q["choices"] == ["mi", "ne ru", "sa"] for q in questions)
    assert len({q["sha256"] for q in questions}) == 3  # the answer is part of what is hashed
    # A held-out set in the same seeded order from an offset past the rows the first set drew: disjoint.
    later = fam.draw_samples(chat, {**spec, "offset": 10}, tokenizer)
    seeded = fam.draw_samples(chat, {**spec, "count": 20, "min_tokens": 1, "max_tokens": 99}, tokenizer)
    assert [s["id"] for s in later] == [s["id"] for s in seeded[10:] if 2 <= s["tokens"] <= 10][:5]
    # WikiText's running text: the split's non-blank rows in order, as they are.
    wiki = datasets.Dataset.from_list([{"text": t} for t in [" = ka = \n", "", " lo mi \n", " \n", " ne \n"]])
    passages = fam.draw_samples(wiki, {"kind": "passages", "count": 3}, tokenizer)
    assert [(p["id"], p["text"]) for p in passages] == [(0, " = ka = \n"), (2, " lo mi \n"), (4, " ne \n")]
    with pytest.raises(ValueError, match="sentence_pairs"):
        fam.draw_samples(chat, {"kind": "sentence_pairs", "count": 1}, tokenizer)


def test_calibration_batches(fam, checkpoint):
    """One unpadded prefill input per prompt, truncated to the setting's prefill."""
    tokenizer = fam.processor(checkpoint)
    texts = ["ka lo mi ne ru sa ti vo be da fu go hi ja po ze", "ka lo", ""]
    batches = fam.calibration_batches(checkpoint, [{"id": i, "text": t} for i, t in enumerate(texts)], SETTING)
    assert [b["input_ids"].shape for b in batches] == [(1, 12), (1, 2)]  # the empty prompt gives none
    assert batches[0]["input_ids"][0].tolist() == tokenizer(texts[0])["input_ids"][:12]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 511


def test_kernel_groups_of_an_eager_fp8_decode(fam, exported):
    """A CPU profile of the FP8 decode module puts time in the FP8, attention and fp16 GEMM groups."""
    case = exported("decode", "fp8")
    model = case["model"]

    class Runner:
        device = torch.device("cpu")

        def profile_call(self):
            with torch.no_grad():
                model(**case["inputs"])

        def synchronize(self):
            pass

    groups = timing.kernel_profile(Runner(), 2, lambda *a: fam.kernel_group(*a, setting=SETTING),
                                   {quantization.FP8_REGION, *fam.regions})["groups_ms"]
    assert set(groups) <= set(fam.kernel_groups)
    assert all(groups.get(g, 0) > 0 for g in ("FP8 projection GEMMs", "attention", "fp16 GEMMs"))


# --- the quality steps: data, decode check, reference and evaluate ------------------------------

def _run(fam, checkpoint, setting=SETTING):
    """The harness's view (steps_measure.batched_run) of the fp32 prefill and decode modules."""
    from quantstudy import steps_measure

    modules = {g: fam.module(checkpoint, g, setting) for g in ("prefill", "decode")}
    as_runner = lambda m: (lambda inputs: m(**inputs))
    return steps_measure.batched_run({g: as_runner(m) for g, m in modules.items()}, setting.batch)


def _prompts(tokenizer, lengths: list[int], prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.full((len(lengths), prefill), 511)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, 511, (n,), generator=g)
    return ids, torch.tensor(lengths)


def test_decode_with_the_cache_equals_prefill_on_the_same_prefix(fam, checkpoint):
    """fp32 engines: every greedy decode step picks prefill's token on the same prefix, logits equal to
    float32 rounding; steps stop where the prefix fills the prefill (n + steps <= 12). Positions 4..11
    pass the local window of 8."""
    run = _run(fam, checkpoint)
    with torch.no_grad():
        block, nonfinite = gpt_neo_metrics.decode_check(run, *_prompts(fam.processor(checkpoint), [4, 9], 12), 12, 16,
                                                steps=8, tolerance=0.0)
    assert block["steps"] == 8 + 3 and block["same_token"] == block["steps"] and block["beyond_tolerance"] == 0
    assert block["max_logit_difference"] < 1e-4
    assert nonfinite == {"bad": 0, "of": 2 + 2 * 11}  # a prefill per prompt, a decode and a prefill per step


def test_the_decode_check_sees_a_decode_that_writes_the_token_one_row_late(fam, checkpoint):
    """The same check on a decode engine fed position + 1 (its key and value land one cache row late,
    and a stale row stays visible): the logits no longer match prefill's."""
    run = _run(fam, checkpoint)

    def late(inputs, what="", graph="main", whole=False, on_device=False):
        if graph == "decode":
            inputs = {**inputs, "position": inputs["position"] + 1}
        return run(inputs, what, graph, whole, on_device)
    with torch.no_grad():
        block, _ = gpt_neo_metrics.decode_check(late, *_prompts(fam.processor(checkpoint), [4, 9], 12), 12, 16,
                                        steps=8, tolerance=0.0)
    assert block["max_logit_difference"] > 1e-2


def test_teacher_forced_chunks_and_their_next_tokens(fam, checkpoint):
    """Passages' tokens as one stream: 2 chunks of 5, each position's target the stream's next token
    (the last chunk's last target is the first token after it)."""
    tok = fam.processor(checkpoint)
    words = [tok.convert_ids_to_tokens(i) for i in range(2, 14)]
    passages = [{"text": " ".join(words[:4])}, {"text": " ".join(words[4:])}]
    chunks, targets = gpt_neo_data.teacher_forced(tok, passages, 10, 5)
    assert chunks.tolist() == [list(range(2, 7)), list(range(7, 12))]
    assert targets.tolist() == list(range(3, 13))
    with pytest.raises(ValueError, match="need 13"):
        gpt_neo_data.teacher_forced(tok, passages, 12, 6)
    with pytest.raises(ValueError, match="not a whole number"):
        gpt_neo_data.teacher_forced(tok, passages, 10, 4)


def test_arc_rows_score_each_choice_after_the_same_prompt(fam, checkpoint):
    """"Question: <q>\\nAnswer:" then the choice: every row starts with the prompt's tokens, the choice
    starts where they end, rows are padded to the prefill; a question too long for it is refused."""
    tok = fam.processor(checkpoint)
    w = [tok.convert_ids_to_tokens(i) for i in range(2, 8)]
    sample = {"id": 0, "question": f"{w[0]} {w[1]}", "choices": [w[2], f"{w[3]} {w[4]}"], "answer": 1}
    prompt = tok(gpt_neo_data.ARC_PROMPT.format(question=sample["question"]))["input_ids"]
    arc = gpt_neo_data.arc_inputs(tok, [sample], 12, 511)
    assert arc["arc_starts"].tolist() == [len(prompt)] * 2
    assert arc["arc_ends"].tolist() == [len(prompt) + 1, len(prompt) + 2]
    assert arc["arc_ids"][1, :len(prompt) + 2].tolist() == prompt + [5, 6]
    assert (arc["arc_ids"][0, len(prompt) + 1:] == 511).all() and arc["arc_question"].tolist() == [0, 0]
    with pytest.raises(ValueError, match="max_tokens"):
        gpt_neo_data.arc_inputs(tok, [sample], len(prompt) + 1, 511)


def test_an_engine_equal_to_the_reference_scores_as_the_reference(fam, checkpoint):
    """reference (fp32 here) then evaluate of the fp32 engines: KL 0 and full agreement on the
    teacher-forced tokens, the reference's own perplexity and ARC accuracy, every ARC choice the
    reference's, decode agreeing with prefill, nothing non-finite."""
    from quantstudy import fixtures

    tok, vocab = fam.processor(checkpoint), fixtures.words(511)
    rows = lambda kind, n: fixtures.dataset_files({"x": "x-*.parquet"}, {"kind": kind, "seed": 0, "rows": n}, 512)
    import io

    import pandas as pd
    read = lambda kind, n: pd.read_parquet(io.BytesIO(next(iter(rows(kind, n).values())))).to_dict("records")
    arc_rows = [{**r, "choices": {k: list(v) for k, v in r["choices"].items()}} for r in read("multiple_choice", 40)]
    samples = {"wikitext": fam.draw_samples(read("passages", 10), {"kind": "passages", "count": 10}, tok),
               "arc_easy": fam.draw_samples(arc_rows, {"kind": "multiple_choice", "count": 3, "max_tokens": 32}, tok),
               "short_prompts": [{"id": 0, "text": " ".join(vocab[2:6])}]}
    assert len(samples["arc_easy"]) == 3
    metrics = {"teacher_forced_tokens": 64, "decode_steps": 4, "decode_tolerance": 0.0}
    setting = base.Setting("p32-c32", 1, {"prefill": 32, "cache": 32})
    with torch.no_grad():
        tensors, ref_blocks = fam.reference(checkpoint, samples, setting, metrics, {}, "cpu", torch.float32)
        result = fam.evaluate(checkpoint, _run(fam, checkpoint, setting), tensors, samples, setting, metrics, {}, "cpu")
    wiki, arc = result.blocks["wikitext"], result.blocks["arc_easy"]
    assert wiki["tokens"] == 64 and wiki["top1_agreement"] == 1.0 and wiki["kl_mean"] < 1e-9
    assert wiki["perplexity"] == pytest.approx(ref_blocks["wikitext"]["perplexity"], rel=1e-5)
    assert arc["accuracy"] == ref_blocks["arc_easy"]["accuracy"] and arc["agreement_with_reference"] == 1.0
    assert result.blocks["decode"]["steps"] == 4 and result.blocks["decode"]["beyond_tolerance"] == 0
    assert result.total_nonfinite == 0 and result.nonfinite["arc_easy"]["of"] == tensors["arc_ids"].shape[0]
    assert_declares_its_quality_columns(fam, result, ref_blocks, list(samples))
