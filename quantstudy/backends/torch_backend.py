"""PyTorch backend: the variant module's weights, and on a compiling target its compiled program.

On CPU, FP8 layers are fake-quant (float8_e4m3fn casts). On a GPU with FP8 (sm_89+) they are
real FP8 GEMMs (torch._scaled_mm, static per-tensor scales), and a target with `compile` runs the
module through torch.compile and times it by CUDA graph replay.

Build once, measure that build. On a compiling target `build` compiles and autotunes the engine at
every shape its jobs will run and stores what inductor made as its portable cache artifacts
(`compiled.bin`, torch.compiler.save_cache_artifacts) beside the weights. A job that opens the engine
loads those artifacts into a cache of its own (and the Triton kernels' autotune choices where those
kernels look them up: inductor_cache.build_folder) and compiles nothing: dynamo traces the module
again (seconds), and every graph must then be found in the loaded artifacts, or opening fails and
names the build to rerun. So the timed, the profiled and the evaluated program are the same kernels with the
same autotuning choices. What keys a compiled graph includes process settings the build and every
job set alike (steps.job_settings; on a CPU, inductor's code depends on the intra-op thread count),
and the compile options (INDUCTOR_OPTIONS).
(An AOTInductor package would also skip the trace, but loading one segfaulted on torch 2.11.)
Each opening logs where its seconds went (`Runner.open_phases`: weights, artifacts, trace, compiler,
calls, capture, waiting) and the work it redid (`open_redone`: C++ compiling, Triton autotuning);
benchmarks/gpu_cost.py sums them per rule. On a CPU (no config compiles there; the tests do) an
opening compiles the C++ of inductor's kernels again, as the artifacts hold their source: 9.9 of the
tiny FNet's 11.7 s.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantstudy import paths
from quantstudy.artifacts import atomic_write, rerun_command
from quantstudy.backends import Inputs, Shapes, batch_chunks, register
from quantstudy.backends.inductor_cache import (REDONE, artifact_counts, artifact_summary, dynamo_seconds, fx_graph_cache,
                                           new_build_folder, own_inductor_cache, place_autotune_choices)
from quantstudy.config import Target

ENGINE_FILE = "engine.safetensors"
COMPILED_FILE = "compiled.bin"  # inductor's cache artifacts of the engine at its built shapes
# Inductor's deterministic mode: its code does not benchmark, when a process first runs it, choices that
# change numerics (reduction splits, padding), so every job that opens one build gets one answer. On an
# H200, 6 processes that opened one compiled tiny detector engine (fp32) at once got 4 answers without
# it, 1 with it (benchmarks/compile_determinism.py; its results are in the H200 evidence). A compile
# option, not a torch._inductor.config setting: torch.compile sets that back to torch's
# deterministic-algorithms flag (off) as it compiles each frame.
INDUCTOR_OPTIONS = {"deterministic": True}

log = logging.getLogger("quantstudy")


class NotBuilt(RuntimeError):
    """Opening the engine would compile: its build did not compile what this job runs."""


def _save_weights(model: nn.Module, out_dir: Path) -> dict[str, Any]:
    """The variant's weights (FP8 weights stay float8_e4m3fn) as the engine file."""
    from safetensors.torch import save_file

    # Tied weights (an LM head and its embedding) share memory, which safetensors refuses: each
    # tensor after the first of a shared storage is stored as a copy, and loads as its own tensor.
    state, seen = {}, set()
    for k, v in model.state_dict().items():
        ptr = v.untyped_storage().data_ptr()
        state[k] = v.contiguous().clone() if ptr in seen else v.contiguous()
        seen.add(ptr)
    tmp = out_dir / f".{ENGINE_FILE}.tmp"
    save_file(state, str(tmp))
    tmp.replace(out_dir / ENGINE_FILE)
    return {"engine": str(out_dir / ENGINE_FILE), "engine_bytes": (out_dir / ENGINE_FILE).stat().st_size,
            "weight_dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})}


def load(skeleton: nn.Module, out_dir: str | Path, device: str = "cpu") -> nn.Module:
    """Fill a variant skeleton (same structure, any weights) with the engine file's weights.

    On a GPU with FP8 (sm_89+) its FP8 layers then run as real FP8 GEMMs (torch._scaled_mm).
    """
    from safetensors.torch import load_file

    from quantstudy.quantization import use_fp8_gemm

    state = load_file(str(Path(out_dir) / ENGINE_FILE), device=device)
    skeleton.load_state_dict(state, strict=True, assign=True)
    model = skeleton.to(device).eval()
    use_fp8_gemm(model, device)
    return model


@register
class TorchBackend:
    """The variant module itself, fake-quant on CPU, real FP8 GEMMs and torch.compile on a GPU."""

    name = "torch"
    builds_from = "module"
    build_times_kernels = False  # a compiling build's autotuning runs in a shared device turn (Runner), as GPU work

    @staticmethod
    def builder_options(target: Target) -> dict[str, Any]:
        """How this target runs a variant module: device, torch.compile, CUDA graph, and the FP8 GEMM path."""
        from quantstudy.quantization import fp8_gemm_supported

        fp8 = ("real FP8 GEMMs: torch._scaled_mm with static per-tensor scales (a layer whose K or N is not a "
               "multiple of 16 stays fake-quant)" if fp8_gemm_supported(target.device) else
               "fake-quant: float8_e4m3fn round trip of weights and activations, GEMM in the work precision")
        cuda = torch.device(target.device).type == "cuda"
        return {"device": target.device, "torch_compile": bool(target.compile),
                "compiled_program": (f"{COMPILED_FILE}: inductor cache artifacts made by the build at the engine's "
                                     f"shapes, loaded by every job that opens it" if target.compile else "none"),
                **({"inductor_options": INDUCTOR_OPTIONS} if target.compile else {}),
                "cuda_graph": cuda, "fp8_path": fp8,
                **({"cudnn_deterministic": bool(torch.backends.cudnn.deterministic)} if cuda else {})}

    def build(self, model: nn.Module, out_dir: str | Path, target: Target, shapes: Shapes) -> dict[str, Any]:
        """Save the weights; on a compiling target, compile the engine as `open` will run it, at every
        example's shape (CUDA-graph capture included), and save what was compiled."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        info = _save_weights(model, out_dir)
        info["shapes"] = [{k: list(v.shape) for k, v in example.items()} for example in shapes.examples]
        if not target.compile:
            return info
        started = time.perf_counter()
        # Forget what this process compiled before: dynamo would reuse the code of an earlier module
        # of the same class and shapes, and this build would then compile, and record, nothing.
        torch.compiler.reset()
        with own_inductor_cache(new_build_folder(out_dir)):
            with fx_graph_cache() as made:
                for example in shapes.examples:
                    Runner(load(model, out_dir, target.device), example, target.device, compile=True)
            if made["bypass"]:
                raise NotBuilt(f"inductor could not cache {made['bypass']} of the engine's graphs, so every job "
                               f"would compile them again")
            saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise NotBuilt("torch.compile recorded no cache artifacts for the engine")
        atomic_write(out_dir / COMPILED_FILE, saved[0])
        seconds = time.perf_counter() - started
        held = artifact_counts(saved[1])
        log.info("compiled %s at %d shape(s) in %.1f s: %d graphs, %d bytes of cache artifacts (%s)", out_dir,
                 len(shapes.examples), seconds, made["miss"], len(saved[0]), artifact_summary(held))
        return {**info, "compiled": str(out_dir / COMPILED_FILE), "compiled_bytes": len(saved[0]),
                "compiled_artifacts": held, "compile_seconds": seconds}

    @staticmethod
    def open(out_dir: str | Path, example: Inputs, target: Target, skeleton: nn.Module | None = None) -> "Runner":
        """The engine in `out_dir` as a runner at the example inputs' shape (the skeleton gives its
        structure). On a compiling target the program comes from the build's compiled file: nothing is
        compiled here, and a graph the file does not hold raises NotBuilt."""
        started = time.perf_counter()
        model = load(skeleton, out_dir, target.device)
        if not target.compile:
            return Runner(model, example, target.device)
        loaded = time.perf_counter()
        compiled = Path(out_dir) / COMPILED_FILE
        if not compiled.exists():
            raise NotBuilt(f"{compiled} is missing: the engine was built without compiling; rebuild it")
        with own_inductor_cache() as folder:
            held = artifact_counts(torch.compiler.load_cache_artifacts(compiled.read_bytes()))
            place_autotune_choices(folder, out_dir)
            artifacts, dynamo = time.perf_counter(), dynamo_seconds()
            with fx_graph_cache() as found:
                runner = Runner(model, example, target.device, compile=True)
            ran = time.perf_counter() - artifacts
        if found["miss"] or found["bypass"]:
            raise NotBuilt(f"opening {out_dir} at {_shape_of(example)} had to compile {found['miss'] + found['bypass']} "
                           f"graph(s) that its build did not: the build compiled other shapes or other code; "
                           f"rerun it: {rerun_command(paths.build_of_engine(out_dir))}")
        runner.open_seconds = time.perf_counter() - started
        spent = {k: v - dynamo[k] for k, v in dynamo_seconds().items()}
        loading = spent["compiler"] + spent["precompiled"]
        # Where the opening went, the parts apart (they sum to open_seconds, less Python between them);
        # and the work redone within them, which the build should have done.
        runner.open_phases = {"weights": loaded - started, "artifacts": artifacts - loaded,
                              "trace": spent["dynamo"] - loading, "compiler": loading,
                              "calls": ran - spent["dynamo"] - runner.capture_seconds - runner.waiting_seconds,
                              "capture": runner.capture_seconds, "waiting": runner.waiting_seconds}
        runner.open_redone = {k: spent[k] for k in REDONE}
        log.info("opened %s at %s in %.1f s from %s (%s; FX graph cache: %d hits, 0 misses; %s; of which %s)",
                 out_dir, _shape_of(example), runner.open_seconds, compiled.name, artifact_summary(held), found["hit"],
                 ", ".join(f"{k} {v:.2f} s" for k, v in runner.open_phases.items()),
                 ", ".join(f"{k} {v:.2f} s" for k, v in runner.open_redone.items()))
        return runner

    @staticmethod
    def profile(runner: "Runner", calls: int, classify, regions: set[str]) -> dict[str, Any]:
        """torch.profiler's kernels (GPU) or ops (CPU), in the family's groups."""
        from quantstudy import timing

        return timing.kernel_profile(runner, calls, classify, regions)


def _shape_of(inputs: Inputs) -> str:
    return ", ".join(f"{k} {list(v.shape)}" for k, v in inputs.items())


class Runner:
    """Runs a graph module ({name: tensor} -> {name: tensor}) at fixed input shapes; on CUDA, by CUDA
    graph replay (compiled if asked).

    `fp8_layers` names its FP8 layers, `fp8_gemm` those that run real FP8 GEMMs (none on CPU, where
    they are fake-quant).
    """

    def __init__(self, model: nn.Module, example: dict[str, torch.Tensor], device: str = "cpu", compile: bool = False):
        from quantstudy.quantization import FP8Linear

        self.device = torch.device(device)
        self.model = self.module = model  # `module`: the uncompiled module, for inspection only
        self.open_seconds: float | None = None  # set by TorchBackend.open, with its parts and the work redone:
        self.open_phases: dict[str, float] = {}
        self.open_redone: dict[str, float] = {}
        self.waiting_seconds = self.capture_seconds = 0.0  # waiting for the device (another job measuring), capture
        self.fp8_layers = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
        self.fp8_gemm = [n for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.fp8_gemm]
        self.static_inputs = {k: v.to(self.device) for k, v in example.items()}
        self.graph = None
        if compile:
            self.model = torch.compile(model, dynamic=False, options=INDUCTOR_OPTIONS)
        # a module that makes host tensors inside its forward (cuda_graph_safe = False) runs eagerly on CUDA
        if self.device.type == "cuda" and all(getattr(m, "cuda_graph_safe", True) for m in model.modules()):
            self._capture()
        elif compile:
            with torch.no_grad():  # compile (or load) now: opening, not the first timed call, pays for it
                self.model(**self.static_inputs)

    @torch.no_grad()
    def _capture(self) -> None:
        from quantstudy.timing import device_lock

        asked = time.perf_counter()
        with device_lock(self.device, shared=True):  # not while another job measures
            self.waiting_seconds = time.perf_counter() - asked
            self._capture_graph()

    def _capture_graph(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up: compile, autotune, allocator
                self.model(**self.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        captured = time.perf_counter()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_outputs = self.model(**self.static_inputs)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - captured

    @torch.no_grad()
    def __call__(self, inputs: Inputs) -> Inputs:
        """Outputs of any number of rows, run in the engine's batch (the last chunk padded); a shape
        other than the engine's beyond the batch axis is an error, never a run of another program."""
        for k, v in inputs.items():
            if tuple(v.shape[1:]) != tuple(self.static_inputs[k].shape[1:]):
                raise ValueError(f"the engine runs {_shape_of(self.static_inputs)} (any number of rows); "
                                 f"asked {k} {list(v.shape)}")
        rows = next(iter(inputs.values())).shape[0]
        outs = []
        for chunk in batch_chunks(inputs, next(iter(self.static_inputs.values())).shape[0]):
            # Inputs take the engine's dtypes (an fp16 variant's KV cache is fp16).
            chunk = {k: v.to(self.device, self.static_inputs[k].dtype) for k, v in chunk.items()}
            if self.graph is not None:
                for k, v in chunk.items():
                    self.static_inputs[k].copy_(v)
                self.graph.replay()
                outs.append({k: v.clone() for k, v in self.static_outputs.items()})
            else:
                outs.append(self.model(**chunk))
        return {k: torch.cat([o[k] for o in outs])[:rows] for k in outs[0]}

    def replay(self) -> None:
        """One timed call: graph replay (no data transfer) on CUDA, a plain forward on CPU."""
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.no_grad():
                self.model(**self.static_inputs)

    @torch.no_grad()
    def profile_call(self) -> None:
        """One profiled call: the same (compiled) forward launched kernel by kernel, not as a graph,
        so that the profiler links every kernel to the op that launched it. Kernel times are the
        graph's; only the launch gaps differ."""
        self.model(**self.static_inputs)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
