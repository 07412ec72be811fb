"""TensorRT backend: a strongly typed engine from the exported Q/DQ ONNX.

Written against the documented TensorRT 10 / 11 Python API. TensorRT 11 has no precision
flags: fp16 comes from an fp16 ONNX and FP8 from its explicit Q/DQ, so the network is
strongly typed (the flag is required in 10 and ignored, always on, in 11). The build records
what really runs in FP8 from the engine inspector (detailed verbosity): a recipe whose FP8
GEMMs fell back to fp16 is flagged. Timing replays a CUDA graph of one enqueue on static
device buffers (no data transfer); per-layer times come from an IProfiler in a separate run.
A failed parse or build raises with TensorRT's own error text, which the build step records.

The module stays whole (about 400 lines): it is one wrapper of one API, the build, the engine
inspector's FP8 summary and the Runner sharing TensorRT's logger and types, and it is the only
module that imports tensorrt, so that where TensorRT is missing one import fails and the registry
names the backend unavailable. Its tests skip on a machine without TensorRT, so a split could not
be checked where most changes are made.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable

import tensorrt as trt
import torch
from torch import nn

from quantstudy.backends import Shapes, batch_chunks, register
from quantstudy.config import Target
from quantstudy.kernel_kinds import FP8_REGION
from quantstudy.timing import gemm_calls, projection_dims

PLAN_FILE = "engine.plan"
LAYERS_FILE = "layers.json"  # the engine inspector's JSON, beside the plan
TIMING_CACHE_DIR = Path("resources/tensorrt-timing-cache")
GEMM = re.compile(r"gemm|matmul|matrixmultiply|convolution|cask|fc", re.I)


class ErrorCollector(trt.ILogger):
    """A logger that keeps TensorRT's errors (and warnings) so that a failure carries its text.

    TensorRT keeps one logger per process (a second ILogger is ignored while a builder or runtime
    made with the first is alive), so there is one instance, `LOGGER`; an operation reads the
    messages logged since it started (`since`).
    """

    def __init__(self, min_severity: "trt.ILogger.Severity" = trt.ILogger.Severity.WARNING):
        trt.ILogger.__init__(self)
        self.min_severity = min_severity
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def log(self, severity: "trt.ILogger.Severity", msg: str) -> None:
        if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
            self.errors.append(msg)
        elif severity == trt.ILogger.Severity.WARNING:
            self.warnings.append(msg)

    def mark(self) -> tuple[int, int]:
        return len(self.errors), len(self.warnings)

    def since(self, mark: tuple[int, int]) -> tuple[list[str], list[str]]:
        return self.errors[mark[0]:], self.warnings[mark[1]:]


LOGGER = ErrorCollector()


def _check(ok: bool, what: str, mark: tuple[int, int]) -> None:
    """TensorRT reports many failures as a False return value: make each one an error with its text."""
    if not ok:
        raise BuildError(f"TensorRT: {what} failed:\n" + "\n".join(LOGGER.since(mark)[0] or ["(no error text)"]))


class BuildError(RuntimeError):
    """TensorRT could not parse or build the network; the message is TensorRT's error text."""


def _require_gpu() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("the tensorrt backend needs a CUDA GPU, and torch sees none here")
    return torch.device("cuda", torch.cuda.current_device())


def gpu_key() -> str:
    """GPU model, compute capability and TensorRT version: what a timing cache is valid for."""
    device = _require_gpu()
    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    major, minor = torch.cuda.get_device_capability(device)
    return f"{name}-sm{major}{minor}-trt{trt.__version__}"


def timing_cache_path(target: Target) -> Path:
    """The timing cache this target's builds share, keyed by GPU and TensorRT version."""
    folder = Path(target.builder.get("timing_cache_dir", TIMING_CACHE_DIR))
    return folder / f"{gpu_key()}.cache"


def _atomic_bytes(path: Path, data: bytes) -> None:
    from quantstudy.artifacts import atomic_write

    atomic_write(path, data)


def _save_timing_cache(config: "trt.IBuilderConfig", cache: "trt.ITimingCache", path: Path) -> None:
    """Merge this build's timing cache into the shared file: parallel builds (several Snakemake jobs,
    one GPU model) each add their tactics instead of the last writer dropping the others'."""
    from quantstudy.artifacts import file_lock

    with file_lock(path.with_name(path.name + ".lock")):
        if path.exists():
            mark = LOGGER.mark()  # same GPU and version, so a mismatch is an error
            _check(cache.combine(config.create_timing_cache(path.read_bytes()), False), "combining timing caches", mark)
        _atomic_bytes(path, bytes(cache.serialize()))


DEFAULT_OPTIMIZATION_LEVEL = 3  # TensorRT's own default


def builder_options(target: Target) -> dict[str, Any]:
    """The builder settings `build` uses for this target, and the FP8 path."""
    opts = target.builder
    return {"network": "strongly typed (types from the ONNX: fp16 from an fp16 graph, FP8 from its Q/DQ)",
            "builder_optimization_level": int(opts.get("optimization_level", DEFAULT_OPTIMIZATION_LEVEL)),
            "workspace_bytes": int(opts["workspace_bytes"]) if "workspace_bytes" in opts else "TensorRT default",
            "profiling_verbosity": "DETAILED", "timing_cache": str(timing_cache_path(target)),
            "fp8_path": "explicit Q/DQ: TensorRT fuses them into FP8 GEMMs; the engine inspector says which ran in FP8"}


def _require_version(target: Target) -> None:
    """A target pins its TensorRT version: an engine built by another version would be mislabelled."""
    wanted = str(target.version or "")
    if wanted and not (trt.__version__ == wanted or trt.__version__.startswith(wanted + ".")):
        raise BuildError(f"target {target.name} wants TensorRT {wanted}, this environment has "
                         f"{trt.__version__}: run it in {target.env or 'its own environment'}")


def build(onnx_path: str | Path, out_dir: str | Path, target: Target, shapes: Shapes) -> dict[str, Any]:
    """Parse the ONNX into a strongly typed network, build the plan, inspect what runs in FP8.

    `shapes.profile` gives (min, opt, max) shapes for each dynamic input: one optimization profile.
    """
    profile = shapes.profile
    _require_gpu()
    _require_version(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    builder_opts = target.builder
    mark = LOGGER.mark()
    builder = trt.Builder(LOGGER)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, LOGGER)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT could not parse {onnx_path}:\n" + "\n".join(errors + LOGGER.since(mark)[0]))

    config = builder.create_builder_config()
    level = int(builder_opts.get("optimization_level", DEFAULT_OPTIMIZATION_LEVEL))
    config.builder_optimization_level = level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the inspector sees every layer's types
    if "workspace_bytes" in builder_opts:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(builder_opts["workspace_bytes"]))
    if profile:
        opt = builder.create_optimization_profile()
        for name, (lo, mid, hi) in profile.items():
            opt.set_shape(name, lo, mid, hi)
        if config.add_optimization_profile(opt) < 0:
            raise BuildError(f"TensorRT rejected the optimization profile {profile}:\n" + "\n".join(LOGGER.since(mark)[0]))
    cache_path = timing_cache_path(target)
    cache_in = cache_path.read_bytes() if cache_path.exists() else b""
    cache = config.create_timing_cache(cache_in)
    _check(config.set_timing_cache(cache, False), "set_timing_cache", mark)  # False: another device's cache is an error

    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - start
    if plan is None:
        raise BuildError("TensorRT could not build the engine:\n" + "\n".join(LOGGER.since(mark)[0] or ["(no error text)"]))
    plan_bytes = bytes(plan)
    _atomic_bytes(out_dir / PLAN_FILE, plan_bytes)
    _save_timing_cache(config, cache, cache_path)

    runtime = trt.Runtime(LOGGER)
    engine = runtime.deserialize_cuda_engine(plan_bytes)
    if engine is None:
        raise BuildError("TensorRT could not load the plan it built:\n" + "\n".join(LOGGER.since(mark)[0]))
    layers = json.loads(engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON))
    _atomic_bytes(out_dir / LAYERS_FILE, json.dumps(layers, indent=1).encode())
    expected = _recipe_fp8_layers(onnx_path)
    return {"engine": str(out_dir / PLAN_FILE), "engine_bytes": len(plan_bytes),
            "tensorrt": {"version": trt.__version__, "gpu": gpu_key(), "strongly_typed": True,
                         "builder_optimization_level": level, "build_seconds": build_s,
                         "optimization_profile": {k: [list(v) for v in shapes] for k, shapes in (profile or {}).items()},
                         "timing_cache": {"path": str(cache_path), "warm_start": bool(cache_in)},
                         "warnings": LOGGER.since(mark)[1][-20:]},
            "inspector": {"file": str(out_dir / LAYERS_FILE), **fp8_summary(layers, expected)}}


def _recipe_fp8_layers(onnx_path: str | Path) -> list[str]:
    from quantstudy import export

    return export.describe(onnx_path)["fp8_layers"]


# The inspector's tensor type field: one "Format/Datatype" in TensorRT 10, announced to split into
# "Format" and "Datatype" in 11; every form is read.
_TYPE_FIELDS = ("Format/Datatype", "Datatype", "DataType", "Format")
FP8_NAMES = re.compile(r"fp8|e4m3", re.I)


def _datatypes(layer: dict[str, Any], side: str) -> list[str]:
    return [" ".join(str(t[f]) for f in _TYPE_FIELDS if f in t) for t in layer.get(side, []) if isinstance(t, dict)]


def _is_fp8_gemm(layer: dict[str, Any]) -> bool:
    """A GEMM-like layer with an FP8 input (by its tensor types or its tactic's name, e.g. `e4m3`):
    a projection that really runs in FP8."""
    if not isinstance(layer, dict):
        return False
    kind = " ".join(str(layer.get(k, "")) for k in ("LayerType", "ParameterType", "TacticName", "Name"))
    fp8 = any(FP8_NAMES.search(t) for t in _datatypes(layer, "Inputs")) or bool(FP8_NAMES.search(str(layer.get("TacticName", ""))))
    return bool(GEMM.search(kind)) and fp8


def fp8_summary(inspector: dict[str, Any], expected: list[str]) -> dict[str, Any]:
    """Which recipe layers the engine runs as FP8 GEMMs (by the inspector), and which fell back.

    A recipe layer counts as FP8 when an FP8 GEMM layer's name or ONNX metadata names it (the
    exporter names nodes after modules, and TensorRT names fused layers after their nodes).
    """
    layers = [layer for layer in inspector.get("Layers", []) if isinstance(layer, dict)]
    fp8 = [layer for layer in layers if _is_fp8_gemm(layer)]
    text = [f"{layer.get('Name', '')} {layer.get('Metadata', '')}" for layer in fp8]
    covered = [n for n in expected if any(f"{n}/" in t or f"{n}." in t for t in text)]
    return {"layers": len(layers), "fp8_gemm_layers": len(fp8), "recipe_fp8_layers": len(expected),
            "recipe_layers_in_fp8": len(covered),
            "fp8_fallback": sorted(set(expected) - set(covered)),
            "fp8_fell_back": len(covered) < len(expected)}


_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
                 "INT64": torch.int64, "INT8": torch.int8, "BOOL": torch.bool, "FP8": torch.float8_e4m3fn}


@register
class TensorRTBackend:
    """A strongly typed TensorRT plan from the exported Q/DQ ONNX."""

    name = "tensorrt"
    builds_from = "onnx"
    build_times_kernels = True  # tactic selection times candidate kernels on the GPU
    builder_options = staticmethod(builder_options)
    build = staticmethod(build)

    @staticmethod
    def open(out_dir: str | Path, example: dict[str, torch.Tensor], target: Target, skeleton: nn.Module | None = None) -> "Runner":
        """The plan in `out_dir` as a runner at the example inputs' shapes, captured as a CUDA graph."""
        return Runner(Path(out_dir), example, target)

    @staticmethod
    def profile(runner: "Runner", calls: int, classify, regions: set[str]) -> dict[str, Any]:
        """TensorRT's IProfiler per layer (Runner.kernel_profile); FP8 GEMM layers form the FP8 region."""
        return runner.kernel_profile(calls, classify, FP8_REGION)


class Runner:
    """A TensorRT execution context on static device buffers at the example's shapes; timing
    replays a CUDA graph of one enqueue. Other shapes: a dynamic engine takes them in one call
    (set_input_shape, no graph); a static one takes more rows in chunks of its batch."""

    def __init__(self, out_dir: Path, example: dict[str, torch.Tensor], target: Target):
        self.device = _require_gpu()
        self.out_dir = out_dir
        self.fp8_layers = self.fp8_gemm = None  # the engine decides; its profile and inspector tell
        self.open_seconds = None
        self.open_redone: dict[str, float] = {}
        mark = LOGGER.mark()
        self.runtime = trt.Runtime(LOGGER)
        self.engine = self.runtime.deserialize_cuda_engine((out_dir / PLAN_FILE).read_bytes())
        if self.engine is None:
            raise BuildError(f"TensorRT could not load {out_dir / PLAN_FILE}:\n" + "\n".join(LOGGER.since(mark)[0]))
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = self.engine.get_tensor_mode
        self.input_names = [n for n in names if mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if mode(n) == trt.TensorIOMode.OUTPUT]
        if set(example) != set(self.input_names):
            raise ValueError(f"the plan takes inputs {self.input_names}, the example has {sorted(example)}")
        self.dynamic = any(-1 in tuple(self.engine.get_tensor_shape(n)) for n in self.input_names)
        self.stream = torch.cuda.Stream(self.device)
        self.context = self.engine.create_execution_context()
        self.static_inputs, self.static_outputs = self._bind(self.context, example)
        self.graph = self._capture()

    def _dtype(self, name: str) -> torch.dtype:
        return _TORCH_DTYPES[self.engine.get_tensor_dtype(name).name]

    def _bind(self, context, inputs: dict[str, torch.Tensor]):
        """Device buffers for `inputs` (copied in) and for the outputs at the shapes they imply."""
        mark = LOGGER.mark()
        bound_in, bound_out = {}, {}
        for name in self.input_names:
            value = inputs[name]
            _check(context.set_input_shape(name, tuple(value.shape)), f"set_input_shape({name}, {tuple(value.shape)})", mark)
            bound_in[name] = value.to(self.device, self._dtype(name)).contiguous()
            _check(context.set_tensor_address(name, bound_in[name].data_ptr()), f"set_tensor_address({name})", mark)
        for name in self.output_names:
            bound_out[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=self._dtype(name), device=self.device)
            _check(context.set_tensor_address(name, bound_out[name].data_ptr()), f"set_tensor_address({name})", mark)
        return bound_in, bound_out

    def _enqueue(self, context) -> None:
        mark = LOGGER.mark()
        _check(context.execute_async_v3(self.stream.cuda_stream), "enqueue", mark)

    def _capture(self) -> torch.cuda.CUDAGraph:
        # One plain enqueue first: TensorRT finishes its lazy setup outside the capture.
        self._enqueue(self.context)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self._enqueue(self.context)
        torch.cuda.synchronize(self.device)
        return graph

    @torch.no_grad()
    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        same = all(tuple(v.shape) == tuple(self.static_inputs[k].shape) for k, v in inputs.items())
        if self.dynamic and not same:
            context = self.engine.create_execution_context()
            _, outputs = self._bind(context, inputs)
            self._enqueue(context)
            self.stream.synchronize()
            return {k: v.clone() for k, v in outputs.items()}
        rows = next(iter(inputs.values())).shape[0]
        outs = []
        for chunk in batch_chunks(inputs, next(iter(self.static_inputs.values())).shape[0]):
            for k, v in chunk.items():
                self.static_inputs[k].copy_(v.to(self.device, self.static_inputs[k].dtype))
            self.graph.replay()
            self.stream.synchronize()
            outs.append({k: v.clone() for k, v in self.static_outputs.items()})
        return {k: torch.cat([o[k] for o in outs])[:rows] for k in self.output_names}

    def replay(self) -> None:
        """One timed call: graph replay on the static buffers, no data transfer."""
        self.graph.replay()

    def profile_call(self) -> None:
        """One call for a profiler: a plain enqueue on the static buffers, not the captured graph, so that
        each kernel is launched on its own (timing.fp8_proof profiles every runner a timing job times)."""
        self._enqueue(self.context)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def kernel_profile(self, calls: int, classify: Callable[[str | None, str, str], str],
                       fp8_region: str) -> dict[str, Any]:
        """Per-layer time per call from an IProfiler, in a separate context and run (no graph).

        A layer is classified by the engine inspector's view of it: its tactic (kernel) name,
        whether it is a GEMM and its input shapes; an FP8 GEMM layer (FP8 inputs) is in
        `fp8_region`.
        """
        from collections import defaultdict

        inspector = json.loads((self.out_dir / LAYERS_FILE).read_text())
        info = {layer.get("Name"): layer for layer in inspector.get("Layers", []) if isinstance(layer, dict)}
        times: dict[str, float] = defaultdict(float)

        class Profiler(trt.IProfiler):
            def __init__(self):
                trt.IProfiler.__init__(self)

            def report_layer_time(self, layer_name: str, ms: float) -> None:
                times[layer_name] += ms

        context = self.engine.create_execution_context()
        self._bind(context, self.static_inputs)
        context.profiler = Profiler()
        self._enqueue(context)  # warm-up
        self.stream.synchronize()
        times.clear()
        for _ in range(calls):
            self._enqueue(context)
            self.stream.synchronize()  # the profiler reports each layer once the call completes
        groups: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)  # layers: the profiler reports each layer once per call
        kernels: dict[tuple[str, str], float] = defaultdict(float)
        gemms: dict[tuple, tuple[float, int]] = {}  # (layer, dims) -> (ms, runs) over the calls
        for name, ms in times.items():
            layer = info.get(name, {})
            region = fp8_region if _is_fp8_gemm(layer) else None
            kernel = str(layer.get("TacticName") or layer.get("LayerType") or name)
            # The launching "op" of a TensorRT layer: a GEMM (by type or tactic) with its input shapes.
            kind = " ".join(str(layer.get(k, "")) for k in ("LayerType", "ParameterType", "TacticName"))
            op = {"name": "aten::matmul" if GEMM.search(kind) else str(layer.get("LayerType", "")),
                  "shapes": [list(t.get("Dimensions", [])) for t in layer.get("Inputs", []) if isinstance(t, dict)],
                  "dtypes": _datatypes(layer, "Inputs")}
            group = classify(region, f"{kernel} {name}", "cuda", op)
            groups[group] += ms / calls
            counts[group] += 1
            kernels[(group, name)] += ms / calls
            if op["name"] == "aten::matmul":
                dims = projection_dims(*op["shapes"][:2]) if len(op["shapes"]) >= 2 else None
                gemms[(name, tuple(dims) if dims else None)] = (ms, calls)
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
        return {"groups_ms": dict(groups), "groups_count": dict(counts), "total_ms": sum(groups.values()),
                "top_kernels": [{"group": g, "name": n, "ms": ms} for (g, n), ms in top],
                # layer names are built from the ONNX node names, `<module>/<op>`: the Amdahl bound
                # finds the recipe's GEMMs by them (a fused layer names each node it holds)
                "gemm_names": "module", "gemms": gemm_calls(gemms, calls)}
