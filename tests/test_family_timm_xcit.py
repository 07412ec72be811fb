"""The timm_xcit family: recipe layers at real size, the graph module against timm, ONNX export
(fp16, FP8 Q/DQ, fp32-Dequantize FP8) checked with ONNX Runtime and onnx's ReferenceEvaluator,
and the WebDataset samples, calibration inputs and stress inputs.

Tiny random-init checkpoints (config/architectures/tiny-xcit-nano.json) and a tiny dataset of
scikit-image photographs, made by the family itself; real-size layouts on the meta device.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch


from quantstudy import config, export, families, quantization, transforms  # noqa: E402
from quantstudy.families.base import Family, Setting  # noqa: E402
from quantstudy.families.timm_xcit_data import load_images  # noqa: E402

from helpers import assert_declares_its_quality_columns, observed_amax, tiny_checkpoint

RECIPE = {"quantize": ["blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc1", "blocks.*.mlp.fc2",
                       "cls_attn_blocks.*.attn.k", "cls_attn_blocks.*.attn.v"],
          "dequantize_dtype": "float16"}
# The linears the write-up keeps in fp16: the class-attention q and proj, the class-attention
# MLP (all one-token GEMVs over the class token) and the head.
KEPT_FP16 = sorted([f"cls_attn_blocks.{i}.{layer}" for i in (0, 1)
                    for layer in ("attn.q", "attn.proj", "mlp.fc1", "mlp.fc2")] + ["head"])
S224 = Setting("224", 1, {"height": 224, "width": 224})
VARIANTS = {"fp16": {"precision": "float16", "transforms": []},
            "fp8": {"precision": "float16", "transforms": [{"fp8": {}}]},
            "fp8-fp32": {"precision": "float32", "transforms": [{"fp8": {}}, {"fp32_dequantize": {}}]}}
DATASET = {"seed": 0, "rows": 24, "shards": 2}
# Tolerances relative to a row's largest logit (the ORT test says why): fp16 graphs, and the
# fp32 FP8 graph, where only an activation on an FP8 rounding boundary can differ.
FP16_TOL, FP32_FP8_TOL = 3e-3, 5e-4


@pytest.fixture(scope="module")
def fam():
    return families.get("timm_xcit")


@pytest.fixture(scope="module")
def tiny(fam, tmp_path_factory):
    return tiny_checkpoint(fam, "tiny-xcit-nano", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def dataset(fam, tmp_path_factory):
    """The tiny WebDataset split, placed like a snapshot and read by the `datasets` webdataset builder."""
    import datasets
    root = tmp_path_factory.mktemp("wds")
    files = fam.tiny_dataset_files({"test": "test/*.tar"}, DATASET, config.load_architecture("tiny-xcit-nano"))
    for name, data in files.items():
        (root / "snapshot" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "snapshot" / name).write_bytes(data)
    shards = sorted(str(p) for p in (root / "snapshot").glob("test/*.tar"))
    rows = datasets.load_dataset("webdataset", data_files=shards, split="train", cache_dir=str(root / "cache"))
    return {"files": files, "rows": rows}


# --- 1. the recipe at real size ---------------------------------------------------------------

@pytest.mark.parametrize("architecture,fp8,linears", [
    ("xcit-nano-12-p16-224", 52, 61), ("xcit-tiny-12-p16-224", 52, 61),
    # the larger configs: depth x 4 + 2 x 2 FP8 layers, and the 9 one-token linears and head
    ("xcit-small-12-p8-224", 52, 61), ("xcit-tiny-24-p8-224", 100, 109), ("xcit-small-24-p8-224", 100, 109),
    ("xcit-medium-24-p8-224", 100, 109), ("xcit-large-24-p8-224", 100, 109)])
def test_recipe_selects_the_write_ups_layers_at_real_size(fam, architecture, fp8, linears):
    layers = fam.quantizable_layers(config.load_architecture(architecture))
    chosen = quantization.select(layers, RECIPE["quantize"])
    assert len(chosen) == fp8 and len(layers) == linears
    assert sorted(set(layers) - set(chosen)) == KEPT_FP16


@pytest.mark.parametrize("architecture", ["xcit-nano-12-p16-224", "xcit-tiny-12-p16-224", "xcit-small-12-p8-224",
                                          "xcit-tiny-24-p8-224", "xcit-small-24-p8-224", "xcit-medium-24-p8-224",
                                          "xcit-large-24-p8-224"])
def test_recorded_model_args_are_the_timm_entry_points(architecture, monkeypatch):
    """The architecture JSON's constructor kwargs are the ones timm's entry point passes (read from
    the call the entry point makes, before anything is built)."""
    import timm
    from timm.models import xcit

    passed = {}

    def read_kwargs(_cls, _variant, _pretrained, **kwargs):
        passed.update(kwargs)
        raise StopIteration  # nothing to build: only the entry point's kwargs are wanted

    monkeypatch.setattr(xcit, "build_model_with_cfg", read_kwargs)
    arch = config.load_architecture(architecture)
    with pytest.raises(StopIteration):
        timm.create_model(arch["architecture"])
    assert {k: passed[k] for k in arch["model_args"]} == arch["model_args"]


# --- 4. the graph module is timm's math --------------------------------------------------------

def test_fp32_module_equals_the_timm_model(fam, tiny):
    """The tiny checkpoint, two images: the graph module's logits are the timm model's."""
    x = fam.example_inputs(tiny, "main", Setting("b2", 2, {"height": 224, "width": 224}))["pixel_values"]
    with torch.no_grad():
        want = fam.load_reference(tiny, torch.float32)(x)
        got = fam.module(tiny, "main", S224)(pixel_values=x)["logits"]
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, 10)
    assert torch.equal(got, want)  # the same ops in the same order: timm's class attention fused, as here


@pytest.mark.parametrize("fused", [False, True])
def test_the_graph_module_attends_as_timms_modules_do(fam, tiny, fused):
    """Each attention runs fused (scaled dot-product attention) or unfused as timm's module says
    (`fused_attn`; by default the class attention fused, the channel attention not): the same bits
    as timm's forward either way, and the two ways differ."""
    x = fam.example_inputs(tiny, "main", Setting("b1", 1, {"height": 224, "width": 224}))["pixel_values"]
    reference, module = fam.load_reference(tiny, torch.float32), fam.module(tiny, "main", S224)
    for model in (reference, module):
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = fused
    with torch.no_grad():
        want, got = reference(x), module(pixel_values=x)["logits"]
        default = fam.module(tiny, "main", S224)(pixel_values=x)["logits"]
    assert torch.equal(got, want)
    assert not torch.equal(got, default)  # neither way is the default mix of the two


@pytest.mark.parametrize("tokens_norm,global_pool", [(True, "token"), (False, "avg")])
def test_graph_module_equals_timm_on_its_other_paths(fam, tokens_norm, global_pool, tmp_path):
    """The branches the tiny checkpoint does not take: class-attention blocks that normalize every
    token (xcit_tiny and the larger configs; nano normalizes the class token only), and average
    pooling. A tiny checkpoint of that layout, one image."""
    arch = config.load_architecture("tiny-xcit-nano")
    arch = {**arch, "global_pool": global_pool, "model_args": {**arch["model_args"], "tokens_norm": tokens_norm}}
    folder = tiny_checkpoint(fam, arch, tmp_path, {"seed": 1})
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = fam.load_reference(folder, torch.float32)(x)
        got = fam.module(folder, "main", S224)(pixel_values=x)["logits"]
    assert torch.equal(got, want)


# --- 2. and 3. export, ONNX Runtime, ReferenceEvaluator ----------------------------------------

def _qdq_layers(path) -> set[str]:
    """The layers whose MatMul reads an FP8 weight through DequantizeLinear and a quantized
    activation through QuantizeLinear -> DequantizeLinear, read from the graph's structure."""
    import onnx

    g = onnx.load(str(path)).graph
    producer = {o: n for n in g.node for o in n.output}
    fp8 = {i.name for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN and i.dims}
    layers = set()
    for node in g.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        sources = [producer.get(i) for i in node.input]
        dq = [s for s in sources if s is not None and s.op_type == "DequantizeLinear"]
        weights = [s.input[0] for s in dq if s.input[0] in fp8]
        activations = [s for s in dq if getattr(producer.get(s.input[0]), "op_type", None) == "QuantizeLinear"]
        assert bool(dq) == bool(weights and activations), f"{node.name}: a MatMul with only part of its Q/DQ"
        if weights:
            layers.add(weights[0].removesuffix(".weight"))
    return layers


@pytest.fixture(scope="module")
def exported(fam, tiny, dataset, tmp_path_factory):
    """The three variants of the tiny model, exported at batch 1 as the export step does (inputs
    in the variant's precision), and the rows they are run on: two calibration photographs and
    two stress images (saturated white, 1 px checkerboard)."""
    samples = fam.draw_samples(dataset["rows"], {"kind": "images", "count": 8, "seed": 0}, None)
    batches = fam.calibration_batches(tiny, samples, S224)
    amax = observed_amax(fam.module(tiny, "main", S224), batches)
    stress = fam.stress_inputs(7, seed=0)
    stress_x = torch.stack([fam.processor(tiny)(stress["images"][i]) for i in (0, 6)])
    x = torch.cat([batches[0]["pixel_values"][:2], stress_x])
    out = {"variants": {}}
    for name, spec in VARIANTS.items():
        fresh = lambda: transforms.apply_variant(fam.module(tiny, "main", S224), spec, RECIPE, amax)
        model, summary = fresh()
        rows = quantization.cast_inputs({"pixel_values": x}, spec["precision"])["pixel_values"]
        with torch.no_grad():
            torch_out = torch.cat([model(pixel_values=rows[i:i + 1])["logits"] for i in range(len(rows))])
        example = quantization.cast_inputs(fam.example_inputs(tiny, "main", S224), spec["precision"])
        info = export.export(fresh()[0], example, tmp_path_factory.mktemp(name))
        out["variants"][name] = {"summary": summary, "info": info, "x": rows, "torch": torch_out.float().numpy()}
    return out


def _ort(path, x: torch.Tensor) -> np.ndarray:
    from quantstudy.backends.onnxruntime_backend import session as ort_session

    session = ort_session(path)
    rows = [session.run(["logits"], {"pixel_values": x[i:i + 1].numpy()})[0] for i in range(len(x))]
    return np.concatenate(rows).astype(np.float32)


def _row_error(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Largest difference of each row, relative to the row's largest |logit|."""
    return np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)


def test_export_io_and_qdq_on_exactly_the_recipe_layers(exported):
    recipe_layers = {f"blocks.{b}.{layer}" for b in (0, 1) for layer in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    recipe_layers |= {f"cls_attn_blocks.{b}.attn.{p}" for b in (0, 1) for p in ("k", "v")}
    for name, v in exported["variants"].items():
        info, dtype = v["info"], VARIANTS[name]["precision"]
        assert info["inputs"] == [{"name": "pixel_values", "dtype": dtype, "shape": [1, 3, 224, 224]}]
        assert info["outputs"] == [{"name": "logits", "dtype": dtype, "shape": [1, 10]}]
        expected = set() if name == "fp16" else recipe_layers
        assert set(v["summary"]["fp8_layers"]) == expected
        assert _qdq_layers(info["onnx"]) == expected
        assert info["fp8_weight_initializers"] == len(expected)
        assert set(info["fp8_layers"]) == expected
        if name != "fp16":
            # The class-attention k and v read one tensor at one scale: the exporter gives them one
            # input Quantize, so 10 of the 12 layers' activations are quantized apart.
            assert info["op_counts"]["QuantizeLinear"] == len(expected) - 2


def test_onnx_runtime_matches_the_torch_variants(exported):
    variants = exported["variants"]
    for name, v in variants.items():
        err = _row_error(_ort(v["info"]["onnx"], v["x"]), v["torch"])
        if name == "fp8-fp32":
            # Same fp32 math, same Q/DQ: a row agrees to fp32 rounding (2e-7) unless a one-ulp
            # difference of an activation that sits on an FP8 rounding boundary moves it one FP8
            # step (1/16 relative) in one of ORT and torch; a row with such flips differs by 1e-6
            # to 1e-4 (measured on 22 images). Far below FP8's own effect (2e-3 to 1e-2).
            assert err.max() <= FP32_FP8_TOL, (name, err)
        else:
            # fp16 work precision: ORT and torch round at different points (torch CPU rounds each
            # op's fp32-computed result to fp16, ORT fuses and accumulates its own way): half an
            # fp16 ulp per rounding, through 4 blocks and into fp16 logits, whose ulp is 6e-4 of
            # the largest; FP8 adds the rare boundary flip of an activation before its
            # QuantizeLinear. Measured up to 1.2e-3 on 22 images (2 ulps).
            assert err.max() <= FP16_TOL, (name, err)
    # The tolerance sees FP8: FP8 rounding moves these rows' logits by more (measured 2e-3 to 1e-2).
    assert _row_error(variants["fp8"]["torch"], variants["fp16"]["torch"]).max() > FP16_TOL


def test_reference_evaluator_agrees_with_onnx_runtime_on_the_fp8_graphs(exported):
    """onnx.reference runs every op of both FP8 graphs (Conv, QuantizeLinear / DequantizeLinear to
    float8e4m3fn ...): an implementation independent of ONNX Runtime for the Q/DQ semantics."""
    from onnx.reference import ReferenceEvaluator

    for name, tol in (("fp8-fp32", FP32_FP8_TOL), ("fp8", FP16_TOL)):
        # One photograph and the saturated image: the evaluator is numpy, slow.
        path, x = exported["variants"][name]["info"]["onnx"], exported["variants"][name]["x"][[0, 2]]
        evaluator = ReferenceEvaluator(str(path))
        ref = np.concatenate([evaluator.run(["logits"], {"pixel_values": x[i:i + 1].numpy()})[0]
                              for i in range(len(x))]).astype(np.float32)
        # fp8-fp32: fp32 everywhere, up to an FP8 boundary flip (measured 2e-7 to 1.5e-5). fp8:
        # numpy's float16 kernels round and accumulate unlike ORT's (measured up to 1.5e-3).
        assert _row_error(ref, _ort(path, x)).max() <= tol, name


# --- settings, graphs, processor, inputs ------------------------------------------------------

def test_settings_and_graphs(fam):
    assert isinstance(fam, Family)
    b32 = Setting("b32", 32, {"height": 224, "width": 224})
    assert fam.check_setting(S224) == [] and fam.check_setting(b32) == []
    assert "384 x 384" in fam.check_setting(Setting("384", 1, {"height": 384, "width": 384}))[0]
    assert fam.check_setting(Setting("w", 1, {"window": 128}))
    assert fam.check_setting(Setting("b0", 0, {"height": 224, "width": 224}))
    g = fam.graphs(b32, config.load_architecture("xcit-nano-12-p16-224"))["main"]
    assert g.outputs == ("logits",) and g.inputs["pixel_values"].shape == (32, 3, 224, 224)
    assert not g.inputs["pixel_values"].dynamic  # one static engine per setting


def test_processor_is_the_checkpoints_eval_transform(fam, tiny):
    from PIL import Image

    pixels = fam.processor(tiny)(Image.new("RGB", (451, 300), (128, 64, 255)))
    assert pixels.shape == (3, 224, 224)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    want = (torch.tensor([128, 64, 255]) / 255 - mean) / std
    assert torch.allclose(pixels.mean(dim=(1, 2)), want, atol=1e-5)


def test_example_inputs_are_deterministic_at_the_settings_batch(fam, tiny):
    b4 = Setting("b4", 4, {"height": 224, "width": 224})
    a, b = fam.example_inputs(tiny, "main", b4), fam.example_inputs(tiny, "main", b4)
    assert a["pixel_values"].shape == (4, 3, 224, 224) and torch.equal(a["pixel_values"], b["pixel_values"])
    assert not torch.equal(a["pixel_values"][0], a["pixel_values"][1])


# --- samples ----------------------------------------------------------------------------------

def test_tiny_dataset_is_webdataset_shards_of_distinct_photographs(fam, dataset):
    files, rows = dataset["files"], dataset["rows"]
    assert sorted(files) == ["test/0.tar", "test/1.tar"]
    again = fam.tiny_dataset_files({"test": "test/*.tar"}, DATASET, config.load_architecture("tiny-xcit-nano"))
    assert again == files  # seeded: the same spec gives the same bytes
    assert len(rows) == DATASET["rows"] and "webp" in rows.column_names and "cls" in rows.column_names
    assert set(rows["cls"]) <= set(range(10))
    samples = fam.draw_samples(rows, {"kind": "images", "count": DATASET["rows"], "seed": 0}, None)
    assert len({s["sha256"] for s in samples}) == DATASET["rows"]  # jittered views all differ


def test_sample_sets_are_disjoint_and_load_back_by_hash(fam, dataset, tiny):
    rows = dataset["rows"]
    spec = {"kind": "images", "seed": 3}
    sets = {"calibration": fam.draw_samples(rows, {**spec, "count": 8, "offset": 0}, None),
            "heldout": fam.draw_samples(rows, {**spec, "count": 6, "offset": 8}, None),
            "extra_heldout": fam.draw_samples(rows, {**spec, "count": 10, "offset": 14}, None)}
    ids = {name: [s["id"] for s in samples] for name, samples in sets.items()}
    assert [len(set(v)) for v in ids.values()] == [8, 6, 10]
    assert len(set().union(*map(set, ids.values()))) == 24  # disjoint, and together every row
    assert fam.draw_samples(rows, {**spec, "count": 8, "offset": 0}, None) == sets["calibration"]
    assert json.loads(json.dumps(sets["heldout"])) == sets["heldout"]  # plain JSON, no pixels
    for s in sets["calibration"]:
        assert set(s) == {"id", "label", "sha256", "shard", "member"} and s["member"] == f"{s['id']}.webp"
    batches = fam.calibration_batches(tiny, sets["calibration"], S224)
    assert [b["pixel_values"].shape[0] for b in batches] == [8]
    direct = torch.stack([fam.processor(tiny)(img) for img in load_images(sets["calibration"])])
    assert torch.equal(batches[0]["pixel_values"], direct)
    tampered = [{**sets["heldout"][0], "sha256": "0" * 64}]
    with pytest.raises(ValueError, match="sha256"):
        load_images(tampered)


def test_stress_inputs_cover_the_extremes(fam, tiny):
    stress = fam.stress_inputs(26, seed=0)
    assert len(stress["images"]) == 26 and len(set(stress["kinds"])) >= 17
    again = fam.stress_inputs(26, seed=0)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(stress["images"], again["images"]))
    x = torch.stack([fam.processor(tiny)(img) for img in stress["images"]])
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    # Both ends of the normalized range, per channel: 0 and 255 pixels are in the set.
    assert torch.allclose(x.amax(dim=(0, 2, 3)), (1 - mean) / std, atol=1e-5)
    assert torch.allclose(x.amin(dim=(0, 2, 3)), -mean / std, atol=1e-5)


# --- kernel groups ----------------------------------------------------------------------------

def test_kernel_groups(fam):
    from quantstudy.quantization import FP8_REGION

    op = lambda name, *shapes: {"name": name, "shapes": [list(s) for s in shapes], "dtypes": []}
    assert fam.kernel_group(FP8_REGION, "aten::mm", "cpu", None) == "FP8 GEMMs"
    assert fam.kernel_group("xcit.attention", "aten::softmax", "cpu", None) == "attention"
    assert fam.kernel_group("xcit.convolutions", "aten::batch_norm", "cpu", None) == "convolutions"
    assert fam.kernel_group(None, "aten::linear", "cpu", op("aten::linear", (1, 197, 128), (128, 128))) == "fp16 GEMMs"
    assert fam.kernel_group(None, "k", "cuda", op("aten::matmul", (1, 4, 32, 196), (1, 4, 196, 32))) == "attention"
    assert fam.kernel_group(None, "k", "cuda", op("aten::cudnn_convolution", (1, 128, 14, 14))) == "convolutions"
    # the fused class attention, by its op or, in compiled code, by its kernel's name (cuDNN's included)
    assert fam.kernel_group(None, "k", "cuda", op("aten::_scaled_dot_product_efficient_attention")) == "attention"
    assert fam.kernel_group(None, "cudnn_generated_fort_native_sdpa_sm90_knob_7", "cuda", None) == "attention"
    assert fam.kernel_group(None, "aten::_scaled_dot_product_flash_attention_for_cpu", "cpu", None) == "attention"
    assert fam.kernel_group(None, "aten::mkldnn_convolution", "cpu", None) == "convolutions"
    assert fam.kernel_group(None, "k", "cuda", op("aten::_scaled_mm", (196, 128), (128, 384))) == "FP8 GEMMs"
    assert fam.kernel_group(None, "sm90_xmma_gemm_e4m3f16_tn", "cuda", None) == "FP8 GEMMs"
    assert fam.kernel_group(None, "sm90_xmma_fprop_implicit_gemm_f16f16", "cuda", None) == "convolutions"
    assert fam.kernel_group(None, "sm90_xmma_gemm_f16f16_f32", "cuda", None) == "fp16 GEMMs"
    assert fam.kernel_group(None, "vectorized_layer_norm_kernel", "cuda", None) == "other"
    assert set(fam.regions.values()) <= set(fam.kernel_groups)


# --- reference and evaluate -------------------------------------------------------------------

EVAL_METRICS, EVAL_SEEDS = {"stress_inputs": 18}, {"stress": 0}


@pytest.fixture(scope="module")
def eval_sets(fam, dataset):
    """Two disjoint evaluation sets of the tiny split (6 and 10 images), as fetch_dataset draws them."""
    spec = {"kind": "images", "seed": 3}
    return {"heldout": fam.draw_samples(dataset["rows"], {**spec, "count": 6, "offset": 8}, None),
            "extra_heldout": fam.draw_samples(dataset["rows"], {**spec, "count": 10, "offset": 14}, None)}


@pytest.fixture(scope="module")
def reference(fam, tiny, eval_sets):
    return fam.reference(tiny, eval_sets, S224, EVAL_METRICS, EVAL_SEEDS, "cpu", torch.float32)


def _engine(fam, checkpoint, batch: int, calls: list, poison_first_row: bool = False):
    """An engine as the evaluate step hands it to the family: the fp32 graph module run in whole
    batches of `batch`. Records each call's row count; `poison_first_row`: the first output row of
    every call is NaN (an engine that overflows on some inputs)."""
    module = fam.module(checkpoint, "main", S224)

    def run(inputs, what="", graph="main", whole=False):
        x = inputs["pixel_values"]
        calls.append(x.shape[0])
        with torch.no_grad():
            logits = torch.cat([module(pixel_values=x[i:i + batch])["logits"] for i in range(0, len(x), batch)])
        if poison_first_row:
            logits[0] = float("nan")
        return {"logits": logits}
    return run


def test_reference_is_the_timm_models_logits_on_each_set(fam, tiny, eval_sets, reference):
    tensors, blocks = reference
    assert sorted(tensors) == ["extra_heldout_labels", "extra_heldout_logits", "heldout_labels", "heldout_logits"]
    model = fam.load_reference(tiny, torch.float32)
    for name, samples in eval_sets.items():
        x = torch.stack([fam.processor(tiny)(img) for img in load_images(samples)])
        with torch.no_grad():
            want = model(x)
        assert tensors[f"{name}_logits"].shape == (len(samples), 10)
        assert torch.allclose(tensors[f"{name}_logits"], want, rtol=0, atol=1e-5 * want.abs().max())
        labels = torch.tensor([s["label"] for s in samples])
        assert torch.equal(tensors[f"{name}_labels"], labels)
        right = int((want.argmax(-1) == labels).sum())
        assert blocks[name] == {"top1_accuracy": right / len(samples), "images": len(samples)}


def test_an_engine_equal_to_the_reference_agrees_everywhere(fam, tiny, eval_sets, reference):
    calls = []
    batch4 = Setting("b4", 4, {"height": 224, "width": 224})
    result = fam.evaluate(tiny, _engine(fam, tiny, 4, calls), reference[0], eval_sets, batch4, EVAL_METRICS,
                          EVAL_SEEDS, "cpu", {})
    for name, samples in eval_sets.items():
        assert result.blocks[name]["top1_agreement"] == 1.0 and result.blocks[name]["kl_mean"] == 0.0
        assert result.blocks[name]["rows"] == len(samples) and result.blocks[name]["disagree"] == 0
        assert result.blocks[name]["top1_accuracy"] == reference[1][name]["top1_accuracy"]
        assert result.nonfinite[name] == {"bad": 0, "of": len(samples)}
    assert result.nonfinite["stress"]["bad"] == 0 and result.nonfinite["stress"]["of"] == 18
    assert len(result.nonfinite["stress"]["kinds"]) >= 17
    # A static batch-4 engine only ever gets whole batches: 6, 10 and 18 rows go in padded to 8, 12, 20.
    assert calls == [8, 12, 20]


def test_nan_rows_are_counted_and_disagree(fam, tiny, eval_sets, reference):
    """The first row of every engine call is NaN: one per set (each set is one call at batch 1 and
    EVAL_CHUNK images a call) and one of the stress inputs."""
    result = fam.evaluate(tiny, _engine(fam, tiny, 1, [], poison_first_row=True), reference[0], eval_sets, S224,
                          EVAL_METRICS, EVAL_SEEDS, "cpu", {})
    assert result.nonfinite["heldout"] == {"bad": 1, "of": 6}
    assert result.nonfinite["extra_heldout"] == {"bad": 1, "of": 10}
    assert result.nonfinite["stress"]["bad"] == 1 and result.total_nonfinite == 3
    assert result.blocks["heldout"]["top1_agreement"] == 5 / 6
    assert result.blocks["extra_heldout"]["top1_agreement"] == 9 / 10


def test_fp8_disagreement_is_measured_against_fp32_and_against_another_engine(fam, tiny, eval_sets, reference,
                                                                              dataset):
    """An FP8 fake-quant engine (the study's recipe, amax from the tiny calibration images): its
    agreement with the reference is what its own top classes say, and `against` compares engines."""
    samples = fam.draw_samples(dataset["rows"], {"kind": "images", "count": 8, "seed": 3, "offset": 0}, None)
    amax = observed_amax(fam.module(tiny, "main", S224), fam.calibration_batches(tiny, samples, S224))
    fp8, _ = transforms.apply_variant(fam.module(tiny, "main", S224), VARIANTS["fp8"], RECIPE, amax)
    run_fp8 = lambda inputs, what="", graph="main", whole=False: {
        "logits": torch.cat([fp8(pixel_values=inputs["pixel_values"][i:i + 1].half())["logits"].float()
                             for i in range(len(inputs["pixel_values"]))])}
    exact = _engine(fam, tiny, 1, [])
    result = fam.evaluate(tiny, run_fp8, reference[0], eval_sets, S224, EVAL_METRICS, EVAL_SEEDS, "cpu",
                          {"fp32": exact})
    for name, samples in eval_sets.items():
        x = torch.stack([fam.processor(tiny)(img) for img in load_images(samples)])
        with torch.no_grad():
            mine = run_fp8({"pixel_values": x})["logits"].argmax(-1)
        want = float((mine == reference[0][f"{name}_logits"].argmax(-1)).double().mean())
        assert result.blocks[name]["top1_agreement"] == want
        ref = reference[0][f"{name}_logits"].double()
        with torch.no_grad():
            q = torch.softmax(run_fp8({"pixel_values": x})["logits"].double(), -1)
        p = torch.softmax(ref, -1)
        assert abs(result.blocks[name]["kl_mean"] - float((p * (p.log() - q.log())).sum(-1).mean())) < 1e-9
        assert result.blocks[name]["kl_mean"] > 0
        # the fp32 engine is the reference up to rounding: the same agreement against it
        assert result.blocks[f"{name}_vs_fp32"]["top1_agreement"] == want
    assert_declares_its_quality_columns(fam, result, reference[1], list(eval_sets), ["fp32"])


# --- the study's configs ----------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [None, "config/tiny/timm_xcit.yaml", "config/realsize/timm_xcit.yaml"])
def test_the_studys_sample_sets_are_disjoint_and_fit_the_dataset(overrides, tmp_path, monkeypatch):
    """Same seed, non-overlapping offset ranges (disjoint by draw_samples' rule); a generated dataset
    has a row for every sample. The real study's ImageNet revision is the lock step's (stand-in here)."""
    from quantstudy import lockfile

    from helpers import stand_in_lock

    monkeypatch.setattr(lockfile, "LOCK_FILE", tmp_path / "revisions.lock.yaml")
    stand_in_lock(lockfile.LOCK_FILE, ["config/studies/timm_xcit.yaml"])
    study = config.load_study("config/studies/timm_xcit.yaml", overrides)
    sets = {n: s.as_params() for n, s in study.samples.items()}
    assert {s["seed"] for s in sets.values()} == {0} and {s["dataset"] for s in sets.values()} == {"imagenet"}
    ranges = sorted((s.get("offset", 0), s.get("offset", 0) + s["count"]) for s in sets.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
    tiny = study.datasets["imagenet"].tiny
    if tiny:
        assert ranges[-1][1] <= tiny["rows"]
    assert {n: s["count"] for n, s in sets.items()} == (
        {"calibration": 24, "heldout": 16, "extra_heldout": 24} if overrides and "tiny" in overrides else
        {"calibration": 500, "heldout": 500, "extra_heldout": 1500})


# --- the recipe's GEMMs alone (g of the Amdahl bound) -----------------------------------------

def test_gemm_calls_are_the_recipe_layers_at_the_engines_shapes(fam, tiny, one_cpu_thread):
    """What the gemm rule times: every FP8 GEMM call of the variant at the setting's example inputs,
    12 layers at tiny size (2 blocks x 4 + 2 class-attention blocks x k, v), each at its own input
    shape (196 patch tokens; the class attention's k and v also read the class token: 197), timed
    at 5 distinct shapes on the CPU torch backend, where FP8 is fake-quant (emulated)."""
    from quantstudy import bound, gemm

    example = fam.example_inputs(tiny, "main", S224)
    amax = observed_amax(fam.module(tiny, "main", S224), [example])
    model, summary = transforms.apply_variant(fam.module(tiny, "main", S224), VARIANTS["fp8"], RECIPE, amax)
    calls = gemm.recipe_calls(model, quantization.cast_inputs(example, "float16"))
    c = 64  # tiny embed_dim; mlp ratio 4
    expected = {**{f"blocks.{b}.{layer}": dims for b in (0, 1) for layer, dims in
                   (("attn.qkv", [196, c, 3 * c]), ("attn.proj", [196, c, c]), ("mlp.fc1", [196, c, 4 * c]),
                    ("mlp.fc2", [196, 4 * c, c]))},
                **{f"cls_attn_blocks.{b}.attn.{p}": [197, c, c] for b in (0, 1) for p in ("k", "v")}}
    assert {x["layer"]: x["dims"] for x in calls} == expected and len(calls) == len(summary["fp8_layers"]) == 12
    shapes = gemm.time_calls({"fp8": calls}, {"fp8": "float16"}, config.Target(name="cpu-torch", backend="torch", device="cpu"),
                             {"warmup": 1, "rounds": 2, "calls_per_round": 1})
    assert sorted(s["copies"] for s in shapes.values()) == [2, 2, 2, 2, 4]
    assert all(s["emulated"] and s["fp8_gemm"] is None and s["g"] > 0 for s in shapes.values())
    listed = [{"layer": x["layer"], "dims": x["dims"], "shape": gemm.shape_key(x)} for x in calls]
    assert bound.gemm_speedup(shapes, listed)["fp16_ms"] == pytest.approx(
        sum(s["fp16_gemm_ms"] * s["copies"] for s in shapes.values()))
