"""ONNX Runtime backend (CPU): runs the very ONNX that TensorRT gets.

Its job in the study is proof: the exported graph (fp16 casts, FP8 Q/DQ) computes what the
fake-quant PyTorch variant computes, so what TensorRT builds is the recipe. The engine is
the exported ONNX, placed in the build folder; a session is opened once at build time so a
graph ONNX Runtime cannot load fails there, as a build failure.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from quantstudy.backends import Shapes, batch_chunks, register
from quantstudy.config import Target
from quantstudy.kernel_kinds import FP8_REGION
from quantstudy.timing import gemm_calls, projection_dims

ENGINE_FILE = "model.onnx"
PROVIDERS = ["CPUExecutionProvider"]
GEMM_NODES = {"MatMul", "Gemm", "FusedMatMul"}  # ONNX Runtime's GEMM nodes, fused ones included
# ONNX Runtime 1.30's QDQ fusion (QDQSelectorActionTransformer, its "MatMul" rule) turns a float8
# DequantizeLinear -> MatMul with no Q after it into MatMulIntegerToFloat, which takes no float8, and
# the session fails to open (GPT-Neo's fp32 FP8 graph). Our graphs' Q/DQ are float8 only, so the
# transformer has nothing else to fuse: with it off, 1.32 gives the same outputs bit for bit.
DISABLED_OPTIMIZERS = ["QDQSelectorActionTransformer"]
_DISABLE_KEY = "optimization.disable_specified_optimizers"


def session(model: str | Path | bytes, target: Target | None = None, profile_prefix: str | None = None) -> ort.InferenceSession:
    """A session on an ONNX model (its file, or its bytes) as this backend opens every engine: the
    target's builder options (no target: the defaults), DISABLED_OPTIMIZERS off. A test that runs an
    exported graph in ONNX Runtime opens it here too, so that it runs what the backend runs."""
    options = _session_options(target.builder if target else {}, profile_prefix)
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options, providers=PROVIDERS)


def _session_options(builder: dict[str, Any], profile_prefix: str | None = None) -> ort.SessionOptions:
    """Session options from a target's `builder` block (threads, optimization level), with
    DISABLED_OPTIMIZERS off."""
    so = ort.SessionOptions()
    level = builder.get("graph_optimization_level", "ORT_ENABLE_ALL")
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.add_session_config_entry(_DISABLE_KEY, ",".join(DISABLED_OPTIMIZERS))
    if "intra_op_num_threads" in builder:
        so.intra_op_num_threads = int(builder["intra_op_num_threads"])
    so.log_severity_level = 3  # errors only: warnings about fp16 casts are expected
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def _place(onnx_path: Path, out_dir: Path) -> Path:
    """The exported ONNX (and any external-data file) in the build folder: hard link, or copy."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    extra = {e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"}
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".engine."))
    try:
        for name in sorted(extra) + [onnx_path.name]:  # the graph file last
            src, dst = onnx_path.parent / name, tmp / (ENGINE_FILE if name == onnx_path.name else name)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
            os.replace(dst, out_dir / dst.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / ENGINE_FILE


@register
class OnnxRuntimeBackend:
    """The exported ONNX itself, run by ONNX Runtime's CPU kernels."""

    name = "onnxruntime"
    builds_from = "onnx"
    build_times_kernels = False

    @staticmethod
    def builder_options(target: Target) -> dict[str, Any]:
        """The session options this target's sessions are opened with (`_session_options`), and the FP8 path."""
        so = _session_options(target.builder)
        threads = so.intra_op_num_threads
        return {"graph_optimization_level": str(so.graph_optimization_level).rsplit(".", 1)[-1],
                "intra_op_num_threads": threads if threads > 0 else "ONNX Runtime default (one per core)",
                "execution_providers": PROVIDERS,
                "disabled_optimizers": so.get_session_config_entry(_DISABLE_KEY).split(","),
                "fp8_path": "float8e4m3fn QuantizeLinear / DequantizeLinear run by ONNX Runtime's CPU kernels"}

    @staticmethod
    def build(onnx_path: str | Path, out_dir: str | Path, target: Target, shapes: Shapes) -> dict[str, Any]:
        """Place the ONNX as the engine and open a session on it (a graph ORT rejects fails here).
        ONNX Runtime takes any shape a dynamic graph allows: it needs no shapes to build for."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        engine = _place(Path(onnx_path), out_dir)
        opened = session(engine, target)
        files = [p for p in out_dir.iterdir() if p.is_file() and not p.name.endswith(".json")]
        return {"engine": str(engine), "engine_bytes": sum(p.stat().st_size for p in files),
                "onnxruntime": {"version": ort.__version__, "providers": opened.get_providers(),
                                "graph_optimization_level": str(opened.get_session_options().graph_optimization_level)}}

    @staticmethod
    def open(out_dir: str | Path, example: dict[str, torch.Tensor], target: Target, skeleton: nn.Module | None = None) -> "Runner":
        """The engine in `out_dir` as a runner at the example inputs' shapes."""
        return Runner(Path(out_dir) / ENGINE_FILE, example, target)

    @staticmethod
    def profile(runner: "Runner", calls: int, classify, regions: set[str]) -> dict[str, Any]:
        """ONNX Runtime's own profiler (Runner.kernel_profile); FP8 layers' nodes form the FP8 region."""
        return runner.kernel_profile(calls, classify, FP8_REGION)


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
                "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}


class Runner:
    """An ONNX Runtime session on named inputs; timing replays the example inputs by I/O binding.

    A graph with a static batch takes more rows in chunks of that batch (the last one padded by
    repeating its last row); a dynamic graph takes any shape in one call.
    """

    def __init__(self, engine: Path, example: dict[str, torch.Tensor], target: Target):
        self.engine, self.target = engine, target
        self.device = torch.device("cpu")
        self.fp8_layers = self.fp8_gemm = None  # the engine decides; its profile and inspector tell
        self.open_seconds = None
        self.open_redone: dict[str, float] = {}
        self.session = session(engine, target)
        self.input_shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self.input_types = {i.name: _NUMPY_TYPES[i.type] for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        if set(example) != set(self.input_shapes):
            raise ValueError(f"{engine} takes inputs {sorted(self.input_shapes)}, the example has {sorted(example)}")
        batch = {s[0] for s in self.input_shapes.values() if s and isinstance(s[0], int)}
        self.static_batch = batch.pop() if len(batch) == 1 else None  # None: a dynamic batch
        self.static_inputs = self._numpy(example)
        # Replay binds the inputs and preallocated outputs: no allocation, no copy per call.
        self._binding = self.session.io_binding()
        for name, value in self.static_inputs.items():
            self._binding.bind_cpu_input(name, value)
        for name in self.output_names:
            self._binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(self._binding)
        for name, value in zip(self.output_names, self._binding.get_outputs()):
            self._binding.bind_ortvalue_output(name, value)

    def _numpy(self, inputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Inputs as the graph's declared types (an fp16 graph's image or KV cache is fp16)."""
        return {k: np.ascontiguousarray(v.detach().cpu().numpy().astype(self.input_types[k], copy=False))
                for k, v in inputs.items()}

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = next(iter(inputs.values())).shape[0]
        chunks = batch_chunks(inputs, self.static_batch) if self.static_batch else [inputs]
        outs = [self.session.run(self.output_names, self._numpy(c)) for c in chunks]
        return {name: torch.from_numpy(np.concatenate([o[i] for o in outs])[:rows])
                for i, name in enumerate(self.output_names)}

    def replay(self) -> None:
        """One timed call on the bound example inputs."""
        self.session.run_with_iobinding(self._binding)

    def profile_call(self) -> None:
        """One call for a profiler: the bound example inputs, as replay runs them (a session captures no
        graph whose kernels a profiler would not see one by one)."""
        self.session.run_with_iobinding(self._binding)

    def synchronize(self) -> None:
        """CPU sessions run synchronously: nothing to wait for."""

    def kernel_profile(self, calls: int, classify: Callable[[str | None, str, str], str],
                       fp8_region: str) -> dict[str, Any]:
        """Node time per call from ONNX Runtime's profiler, in the family's groups.

        A node of an FP8 layer (its Q/DQ, MatMul and bias Add) is in `fp8_region`; other nodes
        are classified as CPU ops, MatMul and Gemm under the names PyTorch gives them, with their
        input shapes: the family's record_function regions do not survive export, so its groups
        come from the shapes (FNet: the sequence-axis DFT is the GEMM with a [window, window]
        operand).
        """
        from collections import defaultdict

        with tempfile.TemporaryDirectory() as tmp:
            profiled = session(self.engine, self.target, f"{tmp}/ort")
            for _ in range(calls + 1):  # the first call warms up and is dropped
                profiled.run(None, self.static_inputs)
            events = _profile_events(profiled.end_profiling())
        events = events[len(events) // (calls + 1):]
        fp8_layers = _fp8_layers_of(self.engine)
        shapes = _input_shapes(self.engine)
        groups: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)  # node runs, over all calls
        kernels: dict[tuple[str, str], float] = defaultdict(float)
        gemms: dict[tuple, list] = defaultdict(lambda: [0.0, 0])  # (node, dims) -> [ms, runs]
        for e in events:
            node, op = e["name"].removesuffix("_kernel_time"), e["args"].get("op_name", "")
            layer = node.split("/")[0].removesuffix(".input_quantizer").removesuffix(".weight_quantizer")
            region = fp8_region if layer in fp8_layers else None
            name = {"MatMul": "aten::matmul", "Gemm": "aten::addmm"}.get(op, f"onnxruntime::{op}")
            # A node ONNX Runtime made by fusion (`<layer>/MatMul/MatMulAddFusion`) has its source node's shapes.
            node_shapes = shapes.get(node) or shapes.get(node.rsplit("/", 1)[0], [])
            group = classify(region, name, "cpu", {"name": name, "shapes": node_shapes, "dtypes": []})
            groups[group] += e["dur"] / 1e3 / calls
            counts[group] += 1
            kernels[(group, f"{node} ({op})")] += e["dur"] / 1e3 / calls
            if op in GEMM_NODES:
                dims = projection_dims(*node_shapes[:2]) if len(node_shapes) >= 2 else None
                gemms[(node, tuple(dims) if dims else None)][0] += e["dur"] / 1e3
                gemms[(node, tuple(dims) if dims else None)][1] += 1
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
        return {"groups_ms": dict(groups), "groups_count": {g: n / calls for g, n in counts.items()}, "total_ms": sum(groups.values()),
                "top_kernels": [{"group": g, "name": n, "ms": ms} for (g, n), ms in top],
                # node names are `<module>/<op>`: the Amdahl bound finds the recipe's GEMMs by them
                "gemm_names": "module", "gemms": gemm_calls(dict(gemms), calls)}


def _profile_events(path: str) -> list[dict[str, Any]]:
    """The per-node kernel events of an ONNX Runtime profile file, in order."""
    events = json.loads(Path(path).read_text())
    return [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]


def _input_shapes(engine: Path) -> dict[str, list[list[int]]]:
    """Each node's input shapes (static graph, after ONNX shape inference)."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(engine), load_external_data=False))
    g = model.graph
    known = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
             for v in list(g.input) + list(g.value_info) + list(g.output)}
    known.update({i.name: list(i.dims) for i in g.initializer})
    return {n.name: [known.get(i, []) for i in n.input if i] for n in g.node}


def _fp8_layers_of(engine: Path) -> set[str]:
    from quantstudy import export

    return set(export.describe(engine)["fp8_layers"])
