"""What a profiled op or kernel is: the pieces every family's `kernel_group` is made of.

A family classifies the ops and kernels of a profile into its write-up's groups (Family.kernel_group)
and never sees the profiler that produced them (quantstudy.timing), so these helpers live apart
from it. Plain values only: no torch, so that timing, which aggregate imports, stays free of it.
"""

from __future__ import annotations

import re
from typing import Any

FP8_REGION = "quantstudy.fp8_gemm"  # profiler region of an FP8 layer (quantize + GEMM), quantization marks it
GEMM_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_scaled_mm", "aten::_scaled_mm_v2"}
FP8_GEMM_OPS = {"aten::_scaled_mm", "aten::_scaled_mm_v2"}


def launching_op(name: str, device: str, op: dict[str, Any] | None) -> str | None:
    """The op a profiled event belongs to: a CPU op is its own, a GPU kernel the op that launched
    it (None where no recognised op did, e.g. compiled or TensorRT kernels)."""
    return op["name"] if op else (name if device == "cpu" else None)


def in_fp8_gemm(region: str | None, op_name: str | None) -> bool:
    """Inside an FP8 layer (eager regions), or an FP8 GEMM op (compiled code, exported graphs)."""
    return region == FP8_REGION or op_name in FP8_GEMM_OPS


def gemm_of_activations(op: dict[str, Any] | None) -> bool:
    """A GEMM whose two operands are both batched (rank 3 or more): attention scores or values,
    not a projection (whose weight is rank 2)."""
    shapes = op["shapes"] if op else []
    return len(shapes) >= 2 and all(len(s) >= 3 for s in shapes[:2])


def group_by_name(name: str, patterns: list[tuple[str, str]], default: str = "other") -> str:
    """The first group whose pattern the kernel's name matches (case-insensitive), else `default`."""
    return next((group for group, pattern in patterns if re.search(pattern, name, re.I)), default)
