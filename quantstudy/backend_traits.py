"""What the workflow needs to know of a backend before importing it: its traits.

The rules read them while Snakemake builds the DAG, in a process that may not import the backend
at all (TensorRT's libraries live in its target's environment only) and that a cluster job starts
again for each job, so they are plain values here, not read from the backend's class. Each backend
class declares the same values (Backend.builds_from, Backend.build_times_kernels), and the contract
test reads them from every backend module, importable here or not, against this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Traits:
    builds_from: Literal["module", "onnx"]  # what its build takes: the variant module, or its exported ONNX
    # Its build times candidate kernels on the device to choose them (TensorRT's tactics): the build is a
    # measurement, and holds the device alone as a timing does.
    build_times_kernels: bool


TRAITS = {
    "torch": Traits(builds_from="module", build_times_kernels=False),
    "onnxruntime": Traits(builds_from="onnx", build_times_kernels=False),
    "tensorrt": Traits(builds_from="onnx", build_times_kernels=True),
}


def of(backend: str) -> Traits:
    """The traits of a backend a target names (the config schema admits these names only)."""
    return TRAITS[backend]
