"""Backends: one interface, three implementations (torch, onnxruntime, tensorrt).

A backend turns a prepared model into an engine (`build`), loads it (`load`), and gives a
runner that maps input ids to features. Timing and profiling go through the runner, so the
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
    """A loaded engine at a fixed input shape: `runner(input_ids) -> features`."""

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


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
