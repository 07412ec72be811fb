"""The measurements record of a built variant (`measurements.json`), written by the build job.

What an auditor asks of an engine before reading its numbers: which backend and version built it,
with which builder options; the weight and activation dtypes of each kind of layer; exactly which
layers are FP8; the amax file it was scaled from (path and sha256); and, for the targets that build
from ONNX, the opset and the Quantize / Dequantize ops of the exported graph. Each is read from the
files themselves (the engine file's tensors, the ONNX graph), not from the config, and checked against
what the build says. A field that does not apply says so ("none", "not exported"): the schema has no
empty field.

dtype names are torch's (`float8_e4m3fn`, `float16`, `float32`) for every backend.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import struct
from pathlib import Path
from typing import Any

from quantstudy.artifacts import provenance, sha256_file, write_json

NONE = "none"
NOT_EXPORTED = "not exported"
# safetensors header dtypes -> torch names
_SAFETENSORS = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F16": "float16", "BF16": "bfloat16",
                "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8",
                "BOOL": "bool"}
_FLOATING = {"float8_e4m3fn", "float8_e5m2", "float16", "bfloat16", "float32", "float64"}


def _onnx_dtype(elem_type: int) -> str:
    import onnx

    name = onnx.TensorProto.DataType.Name(elem_type).lower()  # float, float16, float8e4m3fn, ...
    return {"float": "float32", "double": "float64", "float8e4m3fn": "float8_e4m3fn",
            "float8e5m2": "float8_e5m2"}.get(name, name)


def safetensors_dtypes(path: str | Path) -> dict[str, str]:
    """{tensor name: dtype} of a safetensors file, from its header alone (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: _SAFETENSORS.get(v["dtype"], v["dtype"].lower()) for k, v in header.items() if k != "__metadata__"}


def _kind(names: list[str], weights: list[str], activations: list[str], **extra) -> dict[str, Any] | str:
    """A layer kind's entry: how many layers, and the distinct weight and activation dtypes they have."""
    if not names:
        return NONE
    return {"layers": len(names), "weight": sorted(set(weights)), "activation": sorted(set(activations)), **extra}


def torch_layers(engine: str | Path, fp8_layers: list[str], linear_layers: list[str], precision: str,
                 dequantize_dtype: str | None) -> dict[str, Any]:
    """Layer dtypes of a torch engine (its safetensors file): FP8 linear layers, the other linear
    layers of the variant module (`linear_layers`, FP8 ones included or not), and the rest of the
    weights. The FP8 layers are those whose weight the file holds in float8_e4m3fn: the variant's."""
    dtypes = safetensors_dtypes(engine)
    missing = [n for n in linear_layers + fp8_layers if f"{n}.weight" not in dtypes]
    if missing:
        raise RuntimeError(f"the engine {engine} holds no weight for the layers {missing}")
    in_fp8 = sorted(n for n in set(linear_layers) | set(fp8_layers) if dtypes[f"{n}.weight"] == "float8_e4m3fn")
    if in_fp8 != sorted(fp8_layers):
        raise RuntimeError(f"the engine {engine} has FP8 weights for {in_fp8}, the variant's FP8 layers are {fp8_layers}")
    plain = [n for n in linear_layers if n not in set(fp8_layers)]
    layer_weights = {f"{n}.weight" for n in linear_layers + fp8_layers}
    other = sorted({d for k, d in dtypes.items() if k not in layer_weights and d in _FLOATING})
    return {
        # fake-quant or _scaled_mm, the activation is quantized to FP8 (FP8Linear) before the GEMM
        "fp8_linear": _kind(fp8_layers, [dtypes[f"{n}.weight"] for n in fp8_layers],
                            ["float8_e4m3fn"] * len(fp8_layers), dequantized_to=[dequantize_dtype or NONE]),
        "linear": _kind(plain, [dtypes[f"{n}.weight"] for n in plain], [precision] * len(plain)),
        "other": {"weight": other or [NONE]},
    }


def onnx_graph(path: str | Path, fp8_layers: list[str]) -> dict[str, Any]:
    """What an exported graph says of itself: opset, Quantize / Dequantize counts and output types, and
    the dtypes each linear layer's GEMM consumes (types by ONNX shape inference; weights not loaded).
    A linear layer is a GEMM named after its module (`<module>/MatMul`, export._name_nodes) whose
    second operand is a weight (an initializer, or the Dequantize of one)."""
    import collections

    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types |= {i.name: i.data_type for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    initializers = {i.name for i in g.initializer}
    dtype = lambda name: _onnx_dtype(types[name]) if name in types else "unknown"

    qdq = {}
    for op in ("QuantizeLinear", "DequantizeLinear"):
        nodes = [n for n in g.node if n.op_type == op]
        out = collections.Counter(dtype(n.output[0]) for n in nodes)
        qdq[op] = {"count": len(nodes), "output_types": dict(sorted(out.items())) if nodes else NONE}

    def dequantized(name: str) -> str | None:  # the tensor a DequantizeLinear output comes from
        p = producer.get(name)
        return p.input[0] if p is not None and p.op_type == "DequantizeLinear" else None

    gemms = {n.name.rsplit("/", 1)[0]: n for n in g.node
             if n.op_type in ("MatMul", "Gemm") and n.name.rsplit("/", 1)[-1] == n.op_type
             and (n.input[1] in initializers or dequantized(n.input[1]) in initializers)}
    linear = sorted(set(gemms) - set(fp8_layers))

    used, kinds, unmatched = set(), {}, []
    for kind, names in (("fp8_linear", fp8_layers), ("linear", linear)):
        weights, activations, dq = [], [], []
        for layer in names:
            node = gemms.get(layer)
            if node is None:
                unmatched.append(layer)
                continue
            x, w = node.input[0], node.input[1]
            if kind == "fp8_linear":
                if dequantized(x) is None or dequantized(w) is None:
                    raise RuntimeError(f"{path}: the GEMM of FP8 layer {layer} does not take two dequantized operands")
                x, w, dq = dequantized(x), dequantized(w), dq + [dtype(node.input[0])]
            weights.append(dtype(w))
            activations.append(dtype(x))
            used.add(w)
        kinds[kind] = _kind(names, weights, activations, **({"dequantized_to": sorted(set(dq)) or [NONE]}
                                                             if kind == "fp8_linear" else {}))
    qdq_params = {i for n in g.node if n.op_type in qdq for i in n.input[1:]}
    other = sorted({_onnx_dtype(i.data_type) for i in g.initializer
                    if i.name not in used | qdq_params and i.dims and _onnx_dtype(i.data_type) in _FLOATING})
    kinds["other"] = {"weight": other or [NONE]}
    return {"opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
            "qdq": qdq, "layers": kinds,
            # linear layers whose GEMM the graph does not name after them: left out of the dtypes above
            **({"unmatched_layers": unmatched} if unmatched else {})}


def measurements(ident: dict[str, Any], target, build_doc: dict[str, Any], build_json: str,
                 linear_layers: dict[str, list[str]] | None, amax_json: str | None, export_doc: dict[str, Any] | None,
                 export_json: str | None, out: str, started: str, rule: str = "build") -> None:
    """Write the measurements record of an ok build (build_doc, as written to build_json), made by
    `rule` (build, or rebuild for an evaluation job's own build). A torch build gives its variant
    modules' linear layers by graph (`linear_layers`); an ONNX graph names its own."""
    from quantstudy import backends

    backend = backends.get(target.backend)
    fp8_layers, precision = build_doc["fp8_layers"], build_doc["precision"]
    options = backend.builder_options(target)
    fp8_path = options.pop("fp8_path")
    fp8_path = fp8_path if fp8_layers else NONE
    graphs = {}
    if export_doc is None:
        onnx = NOT_EXPORTED
        for name, e in build_doc["graphs"].items():
            graphs[name] = {"engine": e["engine"], "engine_sha256": e["engine_sha256"],
                            "compiled": ({"path": e["compiled"], "sha256": e["compiled_sha256"], "shapes": e["shapes"]}
                                         if "compiled" in e else NONE),
                            "layers": torch_layers(e["engine"], fp8_layers, linear_layers[name], precision,
                                                   build_doc.get("dequantize_dtype") if fp8_layers else None)}
    else:
        onnx = {}
        for name, g in export_doc["graphs"].items():
            if sha256_file(g["onnx"]) != g["onnx_sha256"]:
                raise RuntimeError(f"{g['onnx']} is not the ONNX its export wrote (sha256 differs from {export_json})")
            described = onnx_graph(g["onnx"], fp8_layers)
            onnx[name] = {"path": g["onnx"], "sha256": g["onnx_sha256"], "opset": described["opset"], **described["qdq"]}
            e = build_doc["graphs"][name]
            graphs[name] = {"engine": e["engine"], "engine_sha256": e["engine_sha256"], "layers": described["layers"],
                            **({"unmatched_layers": described["unmatched_layers"]} if "unmatched_layers" in described
                               else {}),
                            **({"engine_fp8": {k: v for k, v in e["inspector"].items() if k != "file"}}
                               if "inspector" in e else {})}
    inputs = {"build": build_json, **({"amax": amax_json} if amax_json else {}),
              **({"export": export_json} if export_json else {})}
    write_json(out, "measurements", {
        "status": "ok", **ident,
        "backend": {"name": target.backend, "version": importlib.import_module(target.backend).__version__,
                    "pinned_version": str(target.version or NONE), "device": target.device},
        "precision": precision, "fp8_layers": {"count": len(fp8_layers), "names": sorted(fp8_layers) or NONE},
        "fp8_path": fp8_path, "amax": {"path": amax_json, "sha256": sha256_file(amax_json)} if amax_json else NONE,
        "onnx": onnx, "builder": options, "graphs": graphs,
        "provenance": provenance(rule, inputs, {"target": dataclasses.asdict(target)}, started)})


def failed(ident: dict[str, Any], error: str, build_json: str, out: str, started: str, rule: str = "build") -> None:
    """The record of a build that failed (made by `rule`, as measurements): its error, nothing measured."""
    write_json(out, "measurements", {"status": "failed", **ident, "error": error,
                                     "provenance": provenance(rule, {"build": build_json}, {}, started)})

