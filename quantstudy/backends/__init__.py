"""Backends: one declared contract (`Backend`, `Runner`), three implementations (torch, onnxruntime, tensorrt).

A backend turns a prepared graph (a module, or its exported ONNX: `builds_from`) into an engine in a
folder (`build`), and every later job opens that folder as a runner (`open`) that maps named inputs
to named outputs. Build once, measure that build: what a job times, profiles or evaluates is the
file `build` wrote, never something made again in the job. Backends never import a family: the
steps hand them a module or an ONNX file and example inputs.

A backend is a class in `<name>_backend.py` of this package, `@register`ed, as families are
(quantstudy.registry: a name taken twice, or a protocol member missing, is an error as the module
loads). A module whose libraries do not import here (TensorRT on a machine without it) is still
listed, with the reason, so that a config naming it gets a clear error and the contract test says
what it skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from quantstudy import registry
from quantstudy.config import Target

Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Shapes:
    """The input shapes an engine is built for.

    `examples`: inputs at each shape its jobs will run, one per setting it serves (the first is the
    build's own setting); `profile`: each dynamic input's (min, opt, max), TensorRT's optimization
    profile. A torch engine is compiled at every example's shape, and runs no other.
    """

    examples: tuple[Inputs, ...]
    profile: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)


@runtime_checkable
class Runner(Protocol):
    """An opened engine: `runner({input: tensor}) -> {output: tensor}`. A call with more rows than the
    engine's batch runs in chunks of that batch (the last one padded); a shape the engine was not built
    for is an error. `replay()` runs one call on the example inputs it was opened with (no data
    transfer), as timing does; `profile_call()` one call for a profiler, kernel by kernel where replay
    runs a captured graph, so that each kernel is seen with the op that launched it (timing.fp8_proof
    and timing.kernel_profile); `synchronize()` waits for the device (`device`: where it runs)."""

    device: torch.device
    # What the runner knows of its FP8 layers: their names, and those that run real FP8 GEMMs
    # (torch: FP8Linear layers, and those on torch._scaled_mm). None where the engine itself
    # decides and its kernels or inspector tell (ONNX Runtime, TensorRT).
    fp8_layers: list[str] | None
    fp8_gemm: list[str] | None
    # Seconds it took to open the engine from a compiled program (torch); None where nothing is loaded
    # but the engine file itself. And the work that opening redid which its build should have done,
    # seconds by kind (torch: C++ compiling, Triton autotuning); empty where it loaded nothing.
    open_seconds: float | None
    open_redone: dict[str, float]

    def __call__(self, inputs: Inputs) -> Inputs: ...

    def replay(self) -> None: ...

    def profile_call(self) -> None: ...

    def synchronize(self) -> None: ...


# classify(region, kernel or op name, device, op) -> the family's kernel group (timing.kernel_profile)
Classify = Callable[..., str]


@runtime_checkable
class Backend(Protocol):
    """What every backend declares and implements.

    `builds_from`: what `build` takes, the variant's module or its exported ONNX file.
    `build_times_kernels`: whether `build` times candidate kernels on the device (TensorRT's tactics),
    so that the build job takes the device alone. Both are traits the rules read before importing a
    backend (quantstudy.backend_traits, which must say the same).
    `builder_options(target)`: how this target builds and runs engines (recorded in measurements.json).
    `build(source, out_dir, target, shapes)`: the engine files in `out_dir`; returns the build record
    of its graph (`engine`: the file every job opens, `engine_bytes`, and what the backend knows).
    `open(out_dir, example, target, skeleton)`: the built engine as a Runner at the example's shape;
    `skeleton` gives a module backend the structure its weights file fills (None for ONNX backends).
    `profile(runner, calls, classify, regions)`: time per call by kernel (GPU) or op (CPU), grouped by
    `classify`, in timing.kernel_profile's form.
    """

    name: str
    builds_from: Literal["module", "onnx"]
    build_times_kernels: bool

    def builder_options(self, target: Target) -> dict[str, Any]: ...

    def build(self, source: nn.Module | Path, out_dir: Path, target: Target, shapes: Shapes) -> dict[str, Any]: ...

    def open(self, out_dir: Path, example: Inputs, target: Target, skeleton: nn.Module | None = None) -> Runner: ...

    def profile(self, runner: Runner, calls: int, classify: Classify, regions: set[str]) -> dict[str, Any]: ...


BACKENDS: registry.Registry[Backend] = registry.Registry("backend", __name__, Backend, suffix="_backend")


def register(cls: type) -> type:
    """Class decorator: register a backend under its `name` (one instance, it holds no state)."""
    BACKENDS.add(cls.name, cls(), registry.origin(cls))
    return cls


def names() -> list[str]:
    """Every declared backend (a `<name>_backend` module here), whether or not it imports here."""
    return BACKENDS.declared()


def get(name: str) -> Backend:
    """The backend of a target. Only its own libraries are imported, and only now: a backend that
    cannot be imported here raises ImportError with the reason."""
    return BACKENDS.get(name)


def available(name: str) -> tuple[bool, str]:
    """Whether a backend's libraries import here, and why not."""
    try:
        get(name)
        return True, ""
    except ImportError as e:
        return False, str(e)


def batch_chunks(inputs: Inputs, batch: int) -> list[Inputs]:
    """Rows in chunks of an engine's static batch, the last chunk padded by repeating its last row
    (the caller drops the pad rows from the outputs)."""
    rows = next(iter(inputs.values())).shape[0]
    chunks = []
    for i in range(0, rows, batch):
        c = {k: v[i:i + batch] for k, v in inputs.items()}
        n = next(iter(c.values())).shape[0]
        chunks.append({k: torch.cat([v, v[-1:].expand(batch - n, *v.shape[1:])]) if n < batch else v
                       for k, v in c.items()})
    return chunks
