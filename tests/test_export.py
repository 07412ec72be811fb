"""ONNX export: the graph structure the write-ups describe, and Q/DQ math layer by layer.

Real exports (torch.onnx dynamo) of small modules and of the tiny FNet, read back with onnx
and run with ONNX Runtime on CPU.
"""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper
from torch import nn

from quantstudy import config, export, families, quantization, transforms
from quantstudy.families.base import Setting

from quantstudy.backends.onnxruntime_backend import session as ort_session  # noqa: E402  (pinned: a broken install fails, it does not skip)

RECIPE = {"quantize": ["fnet.encoder.layer.*.intermediate.dense", "fnet.encoder.layer.*.output.dense"],
          "dequantize_dtype": "float16"}


class OneLayer(nn.Module):
    """A named projection in a parent module, as in a model: `block.dense`."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.block = nn.Module()
        self.block.dense = layer

    def forward(self, x):
        return {"y": self.block.dense(x)}


def _fp8_layer(dq: torch.dtype, work: torch.dtype, seed: int = 0) -> OneLayer:
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(48, 32, generator=g) * 0.1, torch.randn(48, generator=g) * 0.1
    return OneLayer(quantization.FP8Linear(w, b, input_amax=3.0, weight_amax=float(w.abs().max()),
                                           dequantize_dtype=dq, work_dtype=work)).eval()


def _nodes(path):
    return {n.name: n for n in onnx.load(str(path)).graph.node}


def _run_ort(path, x: torch.Tensor) -> torch.Tensor:
    session = ort_session(path)
    return torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


@pytest.mark.parametrize("dq,work", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                     (torch.float16, torch.float32), (torch.float32, torch.float32)])
def test_one_fp8_layer_matches_fake_quant(dq, work, tmp_path):
    """One FP8 layer: ONNX Runtime's Q/DQ graph gives the fake-quant FP8Linear's output to the
    output dtype's rounding (the only difference left is GEMM accumulation order)."""
    model = _fp8_layer(dq, work)
    x = (torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)) * 1.5).to(work)
    with torch.no_grad():
        want = model(x)["y"].float()
    got = _run_ort(export.export(model, {"x": x}, tmp_path)["onnx"], x).float()
    assert got.dtype == want.dtype
    ulp = torch.finfo(torch.float16 if torch.float16 in (dq, work) else torch.float32).eps
    assert (got - want).abs().max() <= 2 * ulp * want.abs().max()


def test_qdq_structure_of_one_layer(tmp_path):
    """activation -> QuantizeLinear -> DequantizeLinear(fp16) -> MatMul -> + bias;
    FP8 weight initializer -> DequantizeLinear(fp16); float8e4m3fn zero point; scales from the layer."""
    model = _fp8_layer(torch.float16, torch.float16)
    layer = model.block.dense
    path = export.export(model, {"x": torch.randn(1, 4, 32).half()}, tmp_path)["onnx"]
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    nodes = _nodes(path)
    q = nodes["block.dense.input_quantizer/QuantizeLinear"]
    dq_x = nodes["block.dense.input_quantizer/DequantizeLinear"]
    dq_w = nodes["block.dense.weight_quantizer/DequantizeLinear"]
    mm, add = nodes["block.dense/MatMul"], nodes["block.dense/Add"]
    assert dq_x.input[0] == q.output[0]
    assert set(mm.input) == {dq_x.output[0], dq_w.output[0]}
    assert mm.output[0] in add.input
    # The zero point is float8e4m3fn (it makes the Q output FP8); the scales are fp16 scalars.
    for node in (q, dq_x, dq_w):
        assert inits[node.input[2]].data_type == TensorProto.FLOAT8E4M3FN
        assert inits[node.input[1]].data_type == TensorProto.FLOAT16 and list(inits[node.input[1]].dims) == []
    assert float(numpy_helper.to_array(inits[q.input[1]])) == float(layer.input_scale)
    assert float(numpy_helper.to_array(inits[dq_w.input[1]])) == float(layer.weight_scale)
    weight = inits[dq_w.input[0]]
    assert weight.data_type == TensorProto.FLOAT8E4M3FN and list(weight.dims) == [32, 48]  # [in, out]
    stored = torch.frombuffer(bytearray(weight.raw_data), dtype=torch.uint8).view(32, 48)
    assert torch.equal(stored, layer.weight.t().contiguous().view(torch.uint8))
    info = export.describe(path)
    assert info["opset"] >= 19 and info["fp8_layers"] == ["block.dense"] and info["fp8_weight_initializers"] == 1


def test_fp16_dequantize_in_fp32_graph_quantizes_the_fp32_activation(tmp_path):
    """fp32 work, fp16 Dequantize: Q takes the fp32 activation (no fp16 rounding before FP8),
    with the scale as an fp32 initializer; the DQ scales stay fp16."""
    path = export.export(_fp8_layer(torch.float16, torch.float32), {"x": torch.randn(1, 4, 32)}, tmp_path)["onnx"]
    inits = {i.name: i for i in onnx.load(str(path)).graph.initializer}
    nodes = _nodes(path)
    q, dq = nodes["block.dense.input_quantizer/QuantizeLinear"], nodes["block.dense.input_quantizer/DequantizeLinear"]
    assert inits[q.input[1]].data_type == TensorProto.FLOAT
    assert inits[dq.input[1]].data_type == TensorProto.FLOAT16
    assert float(numpy_helper.to_array(inits[q.input[1]])) == float(numpy_helper.to_array(inits[dq.input[1]]))


def test_fp32_dequantize_casts_before_quantize(tmp_path):
    """fp32 Dequantize in an fp16 graph: the fp16 activation is cast to fp32, the scales are fp32."""
    path = export.export(_fp8_layer(torch.float32, torch.float16), {"x": torch.randn(1, 4, 32).half()}, tmp_path)["onnx"]
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    nodes = _nodes(path)
    q = nodes["block.dense.input_quantizer/QuantizeLinear"]
    assert inits[q.input[1]].data_type == TensorProto.FLOAT
    producer = next(n for n in graph.node if q.input[0] in n.output)
    assert producer.op_type == "Cast" and producer.attribute[0].i == TensorProto.FLOAT


def test_opset_below_19_is_refused(tmp_path):
    with pytest.raises(ValueError, match="opset >= 19"):
        export.export(_fp8_layer(torch.float16, torch.float16), {"x": torch.randn(1, 4, 32).half()}, tmp_path, opset=18)


@pytest.fixture(scope="module")
def tiny_fnet(tmp_path_factory):
    fam = families.get("fnet")
    folder = tmp_path_factory.mktemp("tiny-fnet-base")
    files = fam.tiny_checkpoint_files(config.load_architecture("tiny-fnet-base"), {"seed": 0, "mixing_input_offset": 2.5})
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return fam, folder


def _fnet_variant(fam, folder, spec, window=64):
    model = fam.module(folder, "main", Setting(f"w{window}", 1, {"window": window}))
    amax = {n: {"input_amax": 4.0, "weight_amax": 0.1} for n in quantization.linear_names(model)}
    return transforms.apply_variant(model, spec, RECIPE, {"amax": amax, "outliers": {"layers": []}},
                                    fam.transforms())


def test_fnet_fp8_graph_follows_the_recipe(tiny_fnet, tmp_path):
    """Q/DQ exactly on the recipe's layers, named after them; nothing else quantized."""
    fam, folder = tiny_fnet
    model, summary = _fnet_variant(fam, folder, {"precision": "float16", "transforms": [{"fp8": {}}]})
    info = export.export(model, {"input_ids": torch.ones(1, 64, dtype=torch.long)}, tmp_path)
    assert info["fp8_layers"] == summary["fp8_layers"] == [
        f"fnet.encoder.layer.{i}.{p}.dense" for i in (0, 1) for p in ("intermediate", "output")]
    nodes = _nodes(info["onnx"])
    assert "fnet.encoder.layer.0.intermediate.dense.input_quantizer/QuantizeLinear" in nodes
    assert info["op_counts"]["QuantizeLinear"] == 4 and info["op_counts"]["DequantizeLinear"] == 8
    assert not any(n.startswith("fnet.embeddings") and "Linear" in nodes[n].op_type for n in nodes)
    assert info["inputs"] == [{"name": "input_ids", "dtype": "int64", "shape": [1, 64]}]
    assert info["outputs"][0]["name"] == "features" and info["outputs"][0]["dtype"] == "float16"


def test_fnet_fp16_graph_keeps_the_sequence_dft_in_fp32(tiny_fnet, tmp_path):
    """fp16 is an fp16 graph, except where the family computes in fp32: the sequence-axis DFT."""
    fam, folder = tiny_fnet
    model, _ = _fnet_variant(fam, folder, {"precision": "float16", "transforms": []})
    path = export.export(model, {"input_ids": torch.ones(1, 64, dtype=torch.long)}, tmp_path)["onnx"]
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(path))).graph
    dtypes = {v.name: v.type.tensor_type.elem_type for v in list(graph.value_info) + list(graph.output)}
    mixing = [n for n in graph.node if n.name.startswith("fnet.encoder.layer.0.fourier.self/MatMul")]
    assert [dtypes[n.output[0]] for n in mixing] == [TensorProto.FLOAT, TensorProto.FLOAT16]  # sequence, hidden
    projection = next(n for n in graph.node if n.name == "fnet.embeddings.projection/MatMul")
    assert dtypes[projection.output[0]] == TensorProto.FLOAT16


def test_per_channel_weight_scales_export_as_one_dequantize_per_axis(tmp_path):
    """fp8 {weight_scales: per_channel}: ONNX Runtime's graph (a weight DequantizeLinear with axis 1 and one scale
    per output channel) gives the fake-quant layer's output to fp16 rounding."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g) * torch.logspace(-2, 0, 48).unsqueeze(1)  # rows 100x apart
    layer = quantization.FP8Linear(w, None, input_amax=3.0, weight_amax=float(w.abs().max()),
                                   dequantize_dtype=torch.float16, work_dtype=torch.float16, weight_scales="per_channel")
    model = OneLayer(layer).eval()
    x = (torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)) * 1.5).half()
    path = export.export(model, {"x": x}, tmp_path)["onnx"]
    dq_w = _nodes(path)["block.dense.weight_quantizer/DequantizeLinear"]
    assert [a.i for a in dq_w.attribute if a.name == "axis"] == [1]
    scale = numpy_helper.to_array({i.name: i for i in onnx.load(str(path)).graph.initializer}[dq_w.input[1]])
    assert scale.shape == (48,)
    with torch.no_grad():
        want = model(x)["y"].float()
    got = _run_ort(path, x).float()
    assert (got - want).abs().max() <= 2 * torch.finfo(torch.float16).eps * want.abs().max()


def test_per_token_activation_scales_are_an_export_failure_with_the_reason(tmp_path):
    w = torch.randn(48, 32) * 0.1
    layer = quantization.FP8Linear(w, None, 3.0, float(w.abs().max()), torch.float16, torch.float16,
                                   weight_scales="per_channel", activation_scales="per_token")
    with pytest.raises(NotImplementedError, match="per_token activation scales are computed at run time"):
        export.export(OneLayer(layer).eval(), {"x": torch.randn(1, 4, 32).half()}, tmp_path)
