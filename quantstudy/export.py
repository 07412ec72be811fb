"""ONNX export of a variant: the graph ONNX Runtime and TensorRT get.

One ONNX per graph of a variant, with the graph's named inputs and outputs, and dynamic sizes
where the graph declares them:
  fp32, fp16  the variant module as it is (fp16 keeps fp32 where the family computes in fp32,
              e.g. FNet's sequence-axis DFT), exported with torch.onnx.export(dynamo=True);
  FP8         every FP8Linear becomes explicit Q/DQ, as the write-ups build it:
                activation -> QuantizeLinear -> DequantizeLinear(dq) -> MatMul -> + bias
                FP8 weight initializer -> DequantizeLinear(dq)
              standard QuantizeLinear / DequantizeLinear with a float8e4m3fn zero point
              (opset >= 19), scales the FP8Linear buffers (amax / 448, rounded to dq), dq
              the recipe's Dequantize dtype (fp16, or fp32 under `fp32_dequantize`).

How: each FP8Linear is swapped for a QDQLinear whose forward calls two torch custom ops
(quantstudy::quantize_fp8, quantstudy::dequantize_fp8) that compute exactly what the fake-quant
FP8Linear computes; the exporter's `custom_translation_table` turns them into QuantizeLinear /
DequantizeLinear. Nodes are then named after the modules they come from, e.g.
`fnet.encoder.layer.0.intermediate.dense.input_quantizer/QuantizeLinear`, so TensorRT's layer
names and the profiles trace back to the recipe's layers.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from quantstudy import quantization

OPSET = 21  # float8e4m3fn Q/DQ needs >= 19; ONNX Runtime CPU runs it at 19 and 21
ONNX_FILE = "model.onnx"
ZERO_POINT = "fp8_zero_point"
# Protobuf caps a single file at 2 GiB: larger models keep their weights in an external file.
EXTERNAL_DATA_BYTES = 1_500_000_000


# --- the two ops the exporter turns into Q/DQ ------------------------------------------------

@torch.library.custom_op("quantstudy::quantize_fp8", mutates_args=())
def _quantize_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantization.quantize_fp8(x, scale.float())


@_quantize_op.register_fake
def _(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=quantization.FP8)


@torch.library.custom_op("quantstudy::dequantize_fp8", mutates_args=())
def _dequantize_op(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # DequantizeLinear's output type is its scale's type (opsets 19 to 23).
    return quantization.dequantize_fp8(q, scale.float(), scale.dtype)


@_dequantize_op.register_fake
def _(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, dtype=scale.dtype)


@torch.library.custom_op("quantstudy::dequantize_fp8_channels", mutates_args=())
def _dequantize_channels_op(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DequantizeLinear per channel of the last axis ([in, out] weight, [out] scales)."""
    return quantization.dequantize_fp8(q, scale.float(), scale.dtype)


@_dequantize_channels_op.register_fake
def _(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, dtype=scale.dtype)


def _translations(opset: int) -> dict:
    import onnx_ir as ir
    import onnxscript

    op = getattr(onnxscript, f"opset{opset}")
    zero = ir.tensor(np.zeros((), dtype=ir.DataType.FLOAT8E4M3FN.numpy()), name=ZERO_POINT)

    # The float8e4m3fn zero point is what makes QuantizeLinear produce FP8 (saturating, the default).
    def quantize(x, scale):
        return op.QuantizeLinear(x, scale, op.Constant(value=zero))

    def dequantize(q, scale):
        return op.DequantizeLinear(q, scale, op.Constant(value=zero))

    # Per axis: no zero point (optional for DequantizeLinear; FP8 in, the scale's type out).
    def dequantize_channels(q, scale):
        return op.DequantizeLinear(q, scale, axis=1)

    return {torch.ops.quantstudy.quantize_fp8.default: quantize,
            torch.ops.quantstudy.dequantize_fp8.default: dequantize,
            torch.ops.quantstudy.dequantize_fp8_channels.default: dequantize_channels}


class QDQLinear(nn.Module):
    """An FP8Linear as explicit Q/DQ ops: the same math as its fake-quant path, exportable.

    The FP8 weight is stored transposed ([in, out]): the exporter then needs no Transpose
    between the weight's DequantizeLinear and the MatMul (per-tensor scales commute with it).
    Calls the variant keeps out of FP8 (`exclude_calls`) keep the FP8Linear's `work_precision`
    child: a plain MatMul on the work-precision weight, without Q/DQ.
    """

    def __init__(self, fp8: quantization.FP8Linear):
        super().__init__()
        if fp8.activation_scales != "static":  # a recorded export failure, with the reason
            raise NotImplementedError(f"{fp8.activation_scales} activation scales are computed at run time, and "
                                      "explicit Q/DQ as TensorRT builds it takes a constant activation scale")
        dq = fp8.dequantize_dtype
        self.register_buffer("weight", fp8.weight.t().contiguous())
        # per_channel: one scale per output channel, the transposed weight's axis 1 (DequantizeLinear axis=1)
        self.per_channel = fp8.weight_scales == "per_channel"
        self.register_buffer("weight_scale", fp8.weight_scale.reshape(-1).to(dq) if self.per_channel
                             else fp8.weight_scale.to(dq))  # exact: already rounded to dq
        self.register_buffer("input_scale", fp8.input_scale.to(dq))
        self.register_buffer("bias", None if fp8.bias is None else fp8.bias.detach().to(dq))
        self.call_sites, self.unquantized_calls = fp8.call_sites, fp8.unquantized_calls
        self.work_precision = fp8.work_precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Fake-quant divides in fp32, exactly; QuantizeLinear takes input and scale in one type.
        # The wider of work and Dequantize dtype holds both exactly (the scale is dq-rounded):
        # fp32 work with fp16 Dequantize quantizes the fp32 activation, fp16 work with fp32
        # Dequantize casts the activation up first.
        qtype = torch.promote_types(x.dtype, self.input_scale.dtype)
        xq = torch.ops.quantstudy.quantize_fp8(x.to(qtype), self.input_scale.to(qtype))
        xd = torch.ops.quantstudy.dequantize_fp8(xq, self.input_scale)
        w = (torch.ops.quantstudy.dequantize_fp8_channels if self.per_channel
             else torch.ops.quantstudy.dequantize_fp8)(self.weight, self.weight_scale)
        y = torch.matmul(xd, w)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def to_qdq(model: nn.Module) -> list[str]:
    """Swap every FP8Linear of `model` (in place) for a QDQLinear; return their module names."""
    names = [n for n, m in model.named_modules() if isinstance(m, quantization.FP8Linear)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, QDQLinear(owner.get_submodule(child)))
    return names


# --- export ----------------------------------------------------------------------------------

def _scope(node) -> str:
    """The module a node was exported from (dynamo exporter metadata), '' for the top level."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return ""
    import ast

    names = ast.literal_eval(scopes)
    return names[-2] if len(names) >= 2 else ""


def _name_nodes(graph, fp8_layers: set[str]) -> None:
    """Name every node `<module>/<OpType>` (Q/DQ under the layer's input/weight quantizer)."""
    used: collections.Counter = collections.Counter()
    for node in graph:
        scope = _scope(node) or "model"
        if scope in fp8_layers and node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            source = node.inputs[0]
            weight = source is not None and (source.is_initializer() or source.const_value is not None)
            scope = f"{scope}.{'weight' if weight else 'input'}_quantizer"
        base = f"{scope}/{node.op_type}"
        used[base] += 1
        node.name = base if used[base] == 1 else f"{base}_{used[base] - 1}"


def _dynamic_shapes(inputs: dict[str, torch.Tensor], dynamic: Mapping[str, Mapping[int, Any]] | None):
    """torch.export's dynamic_shapes for the inputs: a Dim per declared dynamic axis, None elsewhere."""
    if not dynamic:
        return None
    dims: dict[str, Any] = {}

    def dim(d):  # one torch Dim per name: axes that share a name share a size
        if d.name not in dims:
            dims[d.name] = torch.export.Dim(d.name, min=d.min, max=d.max)
        return dims[d.name]
    return {name: ({axis: dim(d) for axis, d in dynamic[name].items()} if dynamic.get(name) else None)
            for name in inputs}


def export(model: nn.Module, inputs: dict[str, torch.Tensor], out_dir: str | Path, opset: int = OPSET,
           dynamic: Mapping[str, Mapping[int, Any]] | None = None) -> dict[str, Any]:
    """Export a graph module (`forward(**inputs) -> {name: tensor}`) to `out_dir/model.onnx`, atomically.

    The ONNX inputs and outputs carry the module's names; `dynamic` maps an input name to its
    dynamic axes ({axis: base.Dim}). FP8Linear layers become Q/DQ (the module is changed in
    place: pass a fresh variant). Returns what the graph holds.
    """
    import onnx

    if opset < 19:
        raise ValueError(f"float8e4m3fn QuantizeLinear needs opset >= 19, not {opset}")
    microscaled = sorted({m.fmt for m in model.modules() if isinstance(m, quantization.MicroscaledLinear)})
    if microscaled:  # raised, so that the export records it as this variant's failure
        raise NotImplementedError(f"{' / '.join(f.upper() for f in microscaled)} layers have no ONNX form here: the "
                                  "exporter writes per-tensor FP8 Q/DQ only, and no backend builds a block-scaled "
                                  "engine from ONNX yet (their quality comes from a module target, e.g. cpu-torch)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp8_layers = to_qdq(model)
    model.eval()
    with torch.no_grad():
        output_names = list(model(**inputs))  # the dict's order is the flattened outputs' order
        program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, opset_version=opset,
                                    input_names=list(inputs), output_names=output_names,
                                    dynamic_shapes=_dynamic_shapes(inputs, dynamic),
                                    custom_translation_table=_translations(opset), verbose=False)
    _name_nodes(program.model.graph, set(fp8_layers))
    # The exporter's node metadata holds stack traces with the checkout's absolute paths: the same
    # graph exported from two checkouts would differ in bytes and sha256. Names carry the modules.
    for node in program.model.graph:
        node.metadata_props.clear()
    size = sum(v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None)
    # Written in a temporary folder beside the result, then moved: readers never see a part.
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".export."))
    try:
        program.save(tmp / ONNX_FILE, external_data=size > EXTERNAL_DATA_BYTES)
        onnx.checker.check_model(str(tmp / ONNX_FILE))
        for f in sorted(tmp.iterdir(), key=lambda p: p.name == ONNX_FILE):  # the graph file last
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"onnx": str(out_dir / ONNX_FILE), **describe(out_dir / ONNX_FILE)}


def describe(path: str | Path) -> dict[str, Any]:
    """What an exported graph holds: opset, I/O, op counts and its FP8 Q/DQ, by layer."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    dtype = lambda t: onnx.helper.tensor_dtype_to_np_dtype(t).name if t != onnx.TensorProto.FLOAT8E4M3FN \
        else "float8_e4m3fn"
    io = lambda v: {"name": v.name, "dtype": dtype(v.type.tensor_type.elem_type),
                    "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]}
    # An FP8 layer is a GEMM whose two operands are dequantized (activation and weight): counted by
    # the graph's structure, not by quantizer names, which the exporter's optimizer may merge
    # (q, k and v of one activation share one Quantize / Dequantize pair).
    producer = {o: n for n in g.node for o in n.output}
    dequantized = lambda name: name in producer and producer[name].op_type == "DequantizeLinear"
    layers = sorted({n.name.rsplit("/", 1)[0] for n in g.node
                     if n.op_type in ("MatMul", "Gemm") and all(dequantized(i) for i in n.input[:2])})
    fp8_weights = [i.name for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN and i.dims]
    files = [Path(path)] + [Path(path).parent / e.value for i in g.initializer for e in i.external_data
                            if e.key == "location"]
    return {"opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
            "inputs": [io(v) for v in g.input], "outputs": [io(v) for v in g.output],
            "op_counts": dict(sorted(collections.Counter(n.op_type for n in g.node).items())),
            "fp8_layers": layers, "fp8_weight_initializers": len(fp8_weights),
            "onnx_bytes": sum(f.stat().st_size for f in set(files))}
