"""Timing side by side and kernel-time profiles, for any backend's runner.

A runner has `replay()` (one call on its static input, no data transfer) and
`synchronize()`. A variant and its baseline are timed in one process, in interleaved rounds
whose order rotates, so that their ratio is measured side by side.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable


def time_interleaved(runners: dict[str, Any], warmup: int, rounds: int, calls: int,
                     progress: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Per runner: raw per-round ms per call, median, min, max and relative spread."""
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            runners[name].replay()
        runners[name].synchronize()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runner = runners[name]
            runner.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                runner.replay()
            runner.synchronize()
            samples[name].append((time.perf_counter() - start) * 1e3 / calls)
        if progress:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {samples[n][-1]:.4f} ms" for n in names))
    return {n: summarize(s) for n, s in samples.items()}


def summarize(samples: list[float]) -> dict[str, Any]:
    median = statistics.median(samples)
    return {"median_ms": median, "min_ms": min(samples), "max_ms": max(samples),
            "spread": (max(samples) - min(samples)) / median if median > 0 else 0.0, "samples_ms": samples}


def speedup(baseline: list[float], variant: list[float]) -> dict[str, float]:
    """x = baseline time / variant time: of the medians, and its range over the paired rounds."""
    per_round = [b / v for b, v in zip(baseline, variant)]
    return {"x": statistics.median(baseline) / statistics.median(variant),
            "x_min": min(per_round), "x_max": max(per_round)}


def kernel_profile(runner: Any, calls: int, classify: Callable[[str | None, str, str], str],
                   regions: set[str]) -> dict[str, Any]:
    """Self time per kernel group (ms per call), with the top kernels of each group.

    CPU ops are attributed to the innermost annotated region they run in (record_function);
    CUDA kernels by their names. `classify(region, name, device)` names the group.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    cuda = getattr(runner, "device", None) is not None and runner.device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    runner.replay()
    runner.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            runner.profile_call() if hasattr(runner, "profile_call") else runner.replay()
        runner.synchronize()
    groups: dict[str, float] = defaultdict(float)
    kernels: dict[tuple[str, str], float] = defaultdict(float)
    for event in prof.events():
        if event.name in regions:
            continue
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            device, us = "cuda", event.self_device_time_total
        else:
            device, us = "cpu", event.self_cpu_time_total
        region = None
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in regions:
                region = parent.name
                break
            parent = parent.cpu_parent
        group = classify(region, event.name, device)
        groups[group] += us / 1e3 / calls
        kernels[(group, event.name)] += us / 1e3 / calls
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
    return {"groups_ms": dict(groups), "total_ms": sum(groups.values()),
            "top_kernels": [{"group": g, "name": n, "ms": ms} for (g, n), ms in top]}
