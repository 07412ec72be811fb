"""PyTorch backend: the variant module's weights, and on a compiling target its compiled program.

On CPU, FP8 layers are fake-quant (float8_e4m3fn casts). On a GPU with FP8 (sm_89+) they are
real FP8 GEMMs (torch._scaled_mm, static per-tensor scales), and a target with `compile` runs the
module through torch.compile and times it by CUDA graph replay.

Build once, measure that build. On a compiling target `build` compiles and autotunes the engine at
every shape its jobs will run and stores what inductor made as its portable cache artifacts
(`compiled.bin`, torch.compiler.save_cache_artifacts) beside the weights. A job that opens the engine
loads those artifacts into a cache of its own (and the Triton kernels' autotune choices where those
kernels look them up: _build_folder) and compiles nothing: dynamo traces the module again (seconds),
and every graph must then be found in the loaded artifacts, or opening fails and names the build to
rerun. So the timed, the profiled and the evaluated program are the same kernels with the
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

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from quantstudy import paths
from quantstudy.artifacts import atomic_write
from quantstudy.backends import Inputs, Shapes, batch_chunks, register
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


# Each process's inductor caches, in a folder named by its pid (_fresh_cache_dir); each build's, in
# builds/, in a folder named by its engine's path (_build_folder), kept for its openings while the
# engine exists (_new_build_folder).
CACHE_ROOT = Path(tempfile.gettempdir()) / f"quantstudy-inductor-{os.getuid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fresh_cache_dir() -> str:
    """A fresh folder for inductor's on-disk caches, in this process's folder under CACHE_ROOT. It must
    last as long as the process (compiled kernels load lazily from it), and a job may end by os._exit
    (the job server's workers), which runs no clean-up: so each call removes the folders of processes
    that have ended instead."""
    CACHE_ROOT.mkdir(exist_ok=True)
    for folder in CACHE_ROOT.iterdir():
        if folder.name.isdigit() and int(folder.name) != os.getpid() and not _alive(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)
    mine = CACHE_ROOT / str(os.getpid())
    mine.mkdir(exist_ok=True)
    return tempfile.mkdtemp(dir=mine)


def _build_folder(out_dir: str | Path) -> Path:
    """The folder the build of the engine in `out_dir` compiles in: a path its openings can name too, on
    any node (from the engine's path). torch keeps each compiled Triton kernel, with its launcher, in the
    compiled program, and the kernel looks up the build's choice among its configs (an autotune artifact)
    beside its own path, in the build's folder. An opening loads the artifacts into a folder of its own,
    where the kernel would not find the choice and would benchmark its configs again: so an opening
    also puts the choices where the kernels look (_place_autotune_choices)."""
    return CACHE_ROOT / "builds" / hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:16]


def _new_build_folder(out_dir: Path) -> Path:
    """An empty build folder for the engine in `out_dir`, which names its engine (a file `engine`); and
    the build folders of engines that are gone are removed (a build folder outlives its job: the
    engine's openings use it)."""
    for named in (CACHE_ROOT / "builds").glob("*/engine"):
        with contextlib.suppress(FileNotFoundError):  # another build removing it too
            if not Path(named.read_text()).exists():
                shutil.rmtree(named.parent, ignore_errors=True)
    folder = _build_folder(out_dir)
    shutil.rmtree(folder, ignore_errors=True)  # compiled from nothing, as its build's record says
    folder.mkdir(parents=True)
    atomic_write(folder / "engine", str(out_dir.resolve()))  # another build reads it to decide on removing
    return folder


def _place_autotune_choices(loaded: Path, out_dir: str | Path) -> None:
    """Copy the autotune choices an opening loaded (`*.best_config`, by their place in its cache folder)
    to the same places in the engine's build folder. Openings on one node write the same bytes there,
    each atomically."""
    build = _build_folder(out_dir)
    for choice in loaded.glob("*/*.best_config"):
        atomic_write(build / choice.relative_to(loaded), choice.read_bytes())


@contextlib.contextmanager
def _own_inductor_cache(folder: Path | None = None) -> Iterator[Path]:
    """Inductor's on-disk caches in a folder of their own (a fresh one, or `folder`), and a fresh record
    of cache artifacts: a build compiles from nothing (all it made is recorded), and an opening job finds
    only what it loaded."""
    from torch.compiler._cache import CacheArtifactManager

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = folder or Path(_fresh_cache_dir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    try:
        with CacheArtifactManager.with_fresh_cache():
            yield folder
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@contextlib.contextmanager
def _fx_graph_cache() -> Iterator[dict[str, int]]:
    """Inductor's FX graph cache lookups inside the block, by outcome: hit, miss (compiled), bypass
    (compiled, not cacheable). The dict is filled when the block ends."""
    from torch._dynamo.utils import counters

    def counts() -> dict[str, int]:
        return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}
    before, found = counts(), {}
    yield found
    found.update({k: v - before[k] for k, v in counts().items()})


# dynamo's own timers (torch._dynamo.utils.compile_times, seconds summed over the process). The parts
# of an opening: all of dynamo's work on a frame (`dynamo`), of which the backend's (AOTAutograd and
# inductor: on an opening job, loading the compiled graphs and kernels from the cache artifacts), or,
# where dynamo's own output was cached too (torch's experimental caching precompile), the loading of
# that in place of a trace. And two kinds of work an opening should not do again, summed wherever they
# ran (a compile thread pool's seconds may exceed the wall time): the C++ sources compiled (inductor's
# CPU kernels, whose source is what the artifacts hold; none on a GPU, whose Triton kernels they hold
# compiled), and the benchmarking of a Triton kernel's configs when it first runs (none where the
# artifacts hold the autotuning's choice).
DYNAMO_TIMERS = {"dynamo": "_compile.compile_inner", "compiler": "OutputGraph.call_user_compiler",
                 "precompiled": "after_deserialization",
                 "compiling": "compile_file", "autotuning": "CachingAutotuner.benchmark_all_configs"}
REDONE = ("compiling", "autotuning")


def _dynamo_seconds() -> dict[str, float]:
    """dynamo's DYNAMO_TIMERS so far in this process (0 for a timer that has not run)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    timed = dict(zip(names, values))
    return {k: float(timed.get(name, 0.0)) for k, name in DYNAMO_TIMERS.items()}


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
        with _own_inductor_cache(_new_build_folder(out_dir)):
            with _fx_graph_cache() as made:
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
        held = _artifact_counts(saved[1])
        log.info("compiled %s at %d shape(s) in %.1f s: %d graphs, %d bytes of cache artifacts (%s)", out_dir,
                 len(shapes.examples), seconds, made["miss"], len(saved[0]), _said(held))
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
        with _own_inductor_cache() as folder:
            held = _artifact_counts(torch.compiler.load_cache_artifacts(compiled.read_bytes()))
            _place_autotune_choices(folder, out_dir)
            artifacts, dynamo = time.perf_counter(), _dynamo_seconds()
            with _fx_graph_cache() as found:
                runner = Runner(model, example, target.device, compile=True)
            ran = time.perf_counter() - artifacts
        if found["miss"] or found["bypass"]:
            raise NotBuilt(f"opening {out_dir} at {_shape_of(example)} had to compile {found['miss'] + found['bypass']} "
                           f"graph(s) that its build did not: the build compiled other shapes or other code; "
                           f"rerun it: snakemake --forcerun build {paths.build_of_engine(out_dir)}")
        runner.open_seconds = time.perf_counter() - started
        spent = {k: v - dynamo[k] for k, v in _dynamo_seconds().items()}
        loading = spent["compiler"] + spent["precompiled"]
        # Where the opening went, the parts apart (they sum to open_seconds, less Python between them);
        # and the work redone within them, which the build should have done.
        runner.open_phases = {"weights": loaded - started, "artifacts": artifacts - loaded,
                              "trace": spent["dynamo"] - loading, "compiler": loading,
                              "calls": ran - spent["dynamo"] - runner.capture_seconds - runner.waiting_seconds,
                              "capture": runner.capture_seconds, "waiting": runner.waiting_seconds}
        runner.open_redone = {k: spent[k] for k in REDONE}
        log.info("opened %s at %s in %.1f s from %s (%s; FX graph cache: %d hits, 0 misses; %s; of which %s)",
                 out_dir, _shape_of(example), runner.open_seconds, compiled.name, _said(held), found["hit"],
                 ", ".join(f"{k} {v:.2f} s" for k, v in runner.open_phases.items()),
                 ", ".join(f"{k} {v:.2f} s" for k, v in runner.open_redone.items()))
        return runner

    @staticmethod
    def profile(runner: "Runner", calls: int, classify, regions: set[str]) -> dict[str, Any]:
        """torch.profiler's kernels (GPU) or ops (CPU), in the family's groups."""
        from quantstudy import timing

        return timing.kernel_profile(runner, calls, classify, regions)


def _artifact_counts(info) -> dict[str, int]:
    """What a compiled program holds, by kind of cache artifact (inductor: compiled graphs; autotune: the
    Triton configs chosen by benchmarking, which an opening then need not benchmark again)."""
    return {kind: len(keys) for kind, keys in sorted(info.artifacts.items())} if info is not None else {}


def _said(counts: dict[str, int]) -> str:
    return "artifacts: " + (", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none")


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
        if self.device.type == "cuda":
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
