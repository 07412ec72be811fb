"""Backends: one interface, three implementations (torch, onnxruntime, tensorrt).

A backend turns a prepared graph (a module, or its exported ONNX) into an engine (`build`) and
opens it as a runner that maps named inputs to named outputs. Timing and profiling go through the runner, so the
same contract tests run against every backend importable on the machine. Backends never
import a family: the study steps hand them a module or an ONNX file.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

_MODULES = {"torch": "quantstudy.backends.torch_backend",
            "onnxruntime": "quantstudy.backends.onnxruntime_backend",
            "tensorrt": "quantstudy.backends.tensorrt_backend"}


class Runner(Protocol):
    """A loaded engine: `runner({input: tensor}) -> {output: tensor}`; `replay()` runs one call on the
    example inputs it was opened with (no data transfer), `synchronize()` waits for the device."""

    device: torch.device

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def replay(self) -> None: ...

    def synchronize(self) -> None: ...


def get(name: str):
    """The backend module of a target (imports it: only then are its libraries needed)."""
    if name not in _MODULES:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name])


def available(name: str) -> tuple[bool, str]:
    """Whether a backend's libraries import here, and why not."""
    try:
        get(name)
        return True, ""
    except ImportError as e:
        return False, str(e)
