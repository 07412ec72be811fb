"""Timing side by side and kernel-time profiles, for any backend's runner.

A runner has `replay()` (one call on its static input, no data transfer) and
`synchronize()`. A variant and its baseline are timed in one process, in interleaved rounds
whose order rotates, so that their ratio is measured side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from quantstudy.artifacts import file_lock
from quantstudy.compare import noise_between_jobs
from quantstudy.kernel_kinds import FP8_GEMM_OPS, GEMM_OPS

if TYPE_CHECKING:  # for annotations only: backends imports torch, and aggregate imports this module
    from quantstudy.backends import Runner

log = logging.getLogger("quantstudy")


def time_interleaved(runners: dict[str, Runner], warmup: int, rounds: int, calls: int,
                     progress: Callable[[str], None] | None = None, min_round_ms: float = 0.0) -> dict[str, dict[str, Any]]:
    """Per runner: raw per-round ms per call, median, min, max and relative spread, and the calls each
    round made. `min_round_ms` (pyperf's calibration): where one call is shorter, each round makes as many
    calls as fill that time for the fastest runner, and the warm-up as many again, so that a few-ms call's
    jitter and a fresh process's first slow calls do not move the median between jobs."""
    if rounds < 1 or calls < 1:
        raise ValueError(f"timing needs at least one round of one call, not {rounds} rounds of {calls}")
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            runners[name].replay()
        runners[name].synchronize()
    if min_round_ms > 0:
        fastest = min(_one_call_ms(runners[n]) for n in names)
        if fastest < min_round_ms:
            calls = max(calls, math.ceil(min_round_ms / max(fastest, 1e-6)))
            for name in names:  # warm up as long again as a round lasts (a long call needs no more)
                for _ in range(calls):
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
    return {n: {**summarize(s), "calls_per_round": calls} for n, s in samples.items()}


def _one_call_ms(runner: Runner) -> float:
    runner.synchronize()
    start = time.perf_counter()
    runner.replay()
    runner.synchronize()
    return (time.perf_counter() - start) * 1e3


def summarize(samples: list[float]) -> dict[str, Any]:
    median = statistics.median(samples)
    return {"median_ms": median, "min_ms": min(samples), "max_ms": max(samples),
            "spread": (max(samples) - min(samples)) / median if median > 0 else 0.0, "samples_ms": samples}


def round_ratios(baseline: list[float], variant: list[float]) -> list[float]:
    """x of each paired round: the baseline's time over the variant's."""
    return [b / v for b, v in zip(baseline, variant)]


def speedup(baseline: list[float], variant: list[float]) -> dict[str, float]:
    """x = baseline time / variant time: of the medians, and its range over the paired rounds."""
    per_round = round_ratios(baseline, variant)
    return {"x": statistics.median(baseline) / statistics.median(variant),
            "x_min": min(per_round), "x_max": max(per_round)}


def timing_noise(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """The study's spread between jobs (noise_between_jobs), from its timing JSONs:
    - ms: one baseline engine's median across the jobs that timed it (each variant of a setting times its
      baseline beside it), pooled over the baselines of every target, model, setting and graph;
    - x: one variant's x across its repeat jobs (`timing.repeats`), pooled; where the study has no repeats,
      the ms spread stands for it (x is a ratio of paired rounds: it moves less between jobs than an engine's
      median does).
    A forged job barely moves it: it is pooled over every job of the study."""
    baselines: dict[tuple, list[float]] = {}
    xs: dict[tuple, list[float]] = {}
    for doc in timings:
        if doc.get("status") != "ok":
            continue
        where = tuple(doc.get(k) for k in ("target", "model", "setting"))
        for g, graph in doc["graphs"].items():
            baselines.setdefault((*where, g, doc["baseline"]), []).append(graph["baseline_ms"]["median_ms"])
            xs.setdefault((*where, g, doc["variant"]), []).append(graph["x"])
    ms, ms_dof = noise_between_jobs(list(baselines.values()))
    x, x_dof = noise_between_jobs(list(xs.values()))
    return {"ms": ms, "ms_dof": ms_dof, "x": x if x_dof else ms, "x_dof": x_dof,
            "x_from": "repeats" if x_dof else "the baselines' ms"}


def projection_dims(a: list[int], b: list[int]) -> list[int] | None:
    """[M, K, N] of a GEMM of an activation [..., K] and a rank-2 operand (a weight, [K, N] or [N, K]):
    a projection. None for any other pair (a GEMM of two activations, a missing shape)."""
    if len(a) < 2 or len(b) != 2 or a[-1] not in b:
        return None
    k = a[-1]
    return [math.prod(a[:-1]), k, b[1] if b[0] == k else b[0]]


def gemm_dims(op: dict[str, Any] | None) -> list[int] | None:
    """[M, K, N] of a profiled torch GEMM op against a weight (see projection_dims), from its input shapes."""
    if not op or op["name"] not in GEMM_OPS:
        return None
    shapes = op["shapes"][1:] if op["name"] in ("aten::addmm", "aten::baddbmm") else op["shapes"]  # bias first
    return projection_dims(*shapes[:2]) if len(shapes) >= 2 else None


@contextlib.contextmanager
def device_lock(device: Any, shared: bool = False):
    """Jobs that share a device take turns on it through a lock file: a measurement (time, profile, gemm)
    holds it alone; work that would disturb one holds it `shared`, so such work runs in parallel, but
    never during a measurement.

    - A GPU (lock named by its UUID): shared by a runner's compile, warm-up and graph capture and the
      GPU work of calibrate, reference and evaluate; the CPU work of those jobs stays parallel.
    - The CPU (one lock per machine, CPU_LOCK): shared by every job of the workflow for its whole run
      (jobserver.call), but a measurement's own job, which takes it alone while it measures. On 2 cores
      a build beside a timing made one engine's median move up to 4x between the jobs of one run.

    Two measurement jobs of one Snakemake run never get here at once: they hold the run's one
    `speed_measurement` slot (rules/common.smk). This lock guards what that resource cannot: other
    jobs' work during a measurement, which Snakemake runs beside it, and measurements of two
    Snakemake runs (or a test) started separately on one machine."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index or 0))
        lock, what = Path(tempfile.gettempdir()) / f"quantstudy-gpu-{uuid}.lock", "GPU"
    else:
        lock, what = CPU_LOCK, "CPU"
    with gpu_turn(lock, shared, what):
        yield


@contextlib.contextmanager
def measuring(device: Any):
    """The device alone for a job's measurements (device_lock), and when they ran: {"started", "finished"},
    filled in as the turn ends (a JSON's `measuring`: measurements never overlap)."""
    from quantstudy.artifacts import now

    span: dict[str, str] = {}
    with device_lock(device):
        span["started"] = now()
        try:
            yield span
        finally:
            span["finished"] = now()


# The machine's cores: one lock file per host (its temporary directory).
CPU_LOCK = Path(tempfile.gettempdir()) / "quantstudy-cpu.lock"


def measures_speed(step: Callable) -> Callable:
    """Marks a step that measures speed: it takes its device alone while it measures (device_lock),
    so its job does not hold the cores shared for its whole run (jobserver.call)."""
    step.measures_speed = True
    return step


def job_turn(step: Callable):
    """What a workflow job holds for its whole run: a shared turn on the cores, unless it measures."""
    return contextlib.nullcontext() if getattr(step, "measures_speed", False) else gpu_turn(CPU_LOCK, shared=True)


_TURNS_HELD: dict[Path, bool] = {}  # lock file -> shared, for the turns this process holds


@contextlib.contextmanager
def gpu_turn(lock: Path, shared: bool = False, what: str = "GPU"):
    """A turn on the device of `lock` (`what`: GPU or CPU): alone, or `shared` with other shared holders. A measurement waiting
    for its turn closes a gate (lock.gate) that new shared holders must pass, so that it is not starved.

    Reentrant within a process: a turn inside a turn of the same process is already held (a shared
    turn inside evaluate's holds for the runner's capture). Taking it again would deadlock as soon as
    a measurement waits at the gate: it waits for this process to let go, and this process for it.
    A measurement inside shared work is refused, as it would run beside that work. A measurement's
    turn logs how long it waited (benchmarks/gpu_cost.py reads it): time in a measurement job that is
    neither opening nor measuring."""
    if lock in _TURNS_HELD:
        if _TURNS_HELD[lock] and not shared:
            raise RuntimeError(f"a measurement inside shared {what} work ({lock}): take the alone turn outside it")
        yield
        return
    gate = lock.with_suffix(".gate")
    asked = time.monotonic()
    if shared:
        with file_lock(gate, fcntl.LOCK_SH):
            pass
    _TURNS_HELD[lock] = shared
    try:
        with contextlib.ExitStack() as held:
            if not shared:
                held.enter_context(file_lock(gate, fcntl.LOCK_EX))
            held.enter_context(file_lock(lock, fcntl.LOCK_SH if shared else fcntl.LOCK_EX))
            if not shared:
                log.info("%s turn alone after waiting %.2f s for other %s work to end", what, time.monotonic() - asked, what)
            yield
    finally:
        del _TURNS_HELD[lock]


def _on_cuda(runner: Runner) -> bool:
    return runner.device.type == "cuda"


def _op_info(op: Any) -> dict[str, Any] | None:
    if op is None:
        return None
    return {"name": op.name, "shapes": [list(s) for s in (op.input_shapes or [])],
            "dtypes": [str(d) for d in (getattr(op, "input_dtypes", None) or [])]}  # dtypes: torch 2.13+


def _profiled(runner: Runner, calls: int):
    """Profile `calls` calls of the runner; yield (device, name, ms per call, op) for every CUDA
    kernel (op: the CPU op that launched it) or CPU op (op: the op itself)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    cuda = _on_cuda(runner)
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    runner.profile_call()
    runner.synchronize()
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(calls):
            runner.profile_call()
        runner.synchronize()
    events = prof.events()
    if not cuda:
        for event in events:
            yield "cpu", event.name, event.self_cpu_time_total / 1e3 / calls, event
        return
    # A kernel is listed under the CPU op that launched it (the innermost one, e.g. aten::mm).
    # Device time that no op claims comes from the device events, with op None; a device event
    # named like a CPU event is the GPU twin of a record_function range, not a kernel.
    launched: dict[str, float] = defaultdict(float)
    cpu_names = set()
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CPU:
            cpu_names.add(event.name)
            for kernel in event.kernels:
                launched[kernel.name] += kernel.duration
                yield "cuda", kernel.name, kernel.duration / 1e3 / calls, event
    on_device: dict[str, float] = defaultdict(float)
    for event in events:
        if (event.device_type == torch.autograd.DeviceType.CUDA and event.name not in cpu_names
                and not getattr(event, "is_user_annotation", False)):
            on_device[event.name] += event.self_device_time_total
    for name, us in on_device.items():
        if us - launched.get(name, 0.0) > 1e-3:
            yield "cuda", name, (us - launched.get(name, 0.0)) / 1e3 / calls, None


def _region(op: Any, regions: set[str]) -> str | None:
    """The innermost annotated region (record_function) around an op."""
    parent = op.cpu_parent if op is not None else None
    while parent is not None:
        if parent.name in regions:
            return parent.name
        parent = parent.cpu_parent
    return None


# Profiling sessions on a CPU, the median one kept: a CPU profile sums each op's self time, the
# time its process waited for a core included, so one session run while another job held the core
# came out slower than the timed median (DeBERTa-v3-base tiny at batch 8 x 64, measured in one
# process: 26.8 ms profiled against 25.1 ms timed alone, 42.1 ms against 27.4 ms beside two busy
# processes). A profile now runs alone (device_lock takes the cores), so one session is the machine's
# own; two more cost the embedded default about 60 s of its wall time. A GPU: one session as well.
CPU_SESSIONS = 1


def kernel_profile(runner: Runner, calls: int, classify: Callable[..., str], regions: set[str]) -> dict[str, Any]:
    """The profile of `calls` calls (one session on a GPU; on a CPU the session of median total among
    CPU_SESSIONS, as the timing keeps its median round), with every session's total. `runner`: a torch
    runner (torch_backend.Runner), whose `profile_call()` runs one forward op by op for the profiler."""
    sessions = 1 if _on_cuda(runner) else CPU_SESSIONS
    profiles = sorted((_profile_session(runner, calls, classify, regions) for _ in range(sessions)),
                      key=lambda p: p["total_ms"])
    kept = profiles[len(profiles) // 2]
    return {**kept, "sessions_total_ms": [p["total_ms"] for p in profiles]}


def _profile_session(runner: Runner, calls: int, classify: Callable[..., str], regions: set[str]) -> dict[str, Any]:
    """Self time per kernel group (ms per call) and how many ops or kernels ran in it per call,
    with the top kernels (ms and launches or ops per call).

    `classify(region, name, device, op)` names the group of a CPU op or a CUDA kernel: `region` is
    the innermost annotated region (record_function) around the op that ran or launched it,
    `op` that op's name, input shapes and dtypes. Compiled code keeps no regions, so on a GPU
    the launching op and the kernel's name decide. On CUDA the runner's `profile_call` runs the
    compiled forward kernel by kernel (graph replay would hide which op launched a kernel).
    """
    if calls < 1:
        raise ValueError(f"a kernel profile needs at least one call, not {calls}")
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)  # over all calls, divided at the end
    group_of: dict[int, str] = {}  # CPU op (id) -> its group
    kernels: dict[tuple[str, str], float] = defaultdict(float)
    kernel_counts: dict[tuple[str, str], int] = defaultdict(int)  # over all calls, like counts
    launched_by: dict[str, str] = {}
    gemms: dict[tuple, list] = {}  # (op name, dims) -> [ms per call, ids of the op calls over all calls]
    for device, name, ms, op in _profiled(runner, calls):
        if name in regions:
            continue
        info = _op_info(op)
        gemm_op = _outermost_gemm(op)
        if gemm_op is not None:
            dims = gemm_dims(_op_info(gemm_op))
            entry = gemms.setdefault((gemm_op.name, tuple(dims) if dims else None), [0.0, set()])
            entry[0] += ms
            entry[1].add(id(gemm_op))
        group = classify(_region(op, regions), name, device, info)
        groups[group] += ms
        # A kernel launch, or a CPU op not called by an op of its own group (aten::linear and the
        # addmm it calls are one GEMM); device time that no op claims comes summed by name, uncounted.
        if device == "cpu":
            group_of[id(op)] = group
        counted = op is not None and (device == "cuda" or group_of.get(id(op.cpu_parent)) != group)
        counts[group] += counted
        kernels[(group, name)] += ms
        kernel_counts[(group, name)] += counted
        if device == "cuda" and info:
            launched_by[name] = info["name"]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
    return {"groups_ms": dict(groups), "groups_count": {g: n / calls for g, n in counts.items()}, "total_ms": sum(groups.values()),
            "profiled": "forward, kernel by kernel (no graph replay)" if _on_cuda(runner) else "forward",
            "top_kernels": [{"group": g, "name": n, "ms": ms, "count": kernel_counts[(g, n)] / calls,
                             "op": launched_by.get(n)} for (g, n), ms in top],
            "gemm_names": "op", "gemms": gemm_calls({k: (ms * calls, len(ids)) for k, (ms, ids) in gemms.items()}, calls)}


def gemm_calls(gemms: dict[tuple, tuple[float, int]], calls: int) -> list[dict[str, Any]]:
    """A profile's GEMM calls, what the Amdahl bound's f is read from (bound.recipe_share): per
    (name, (M, K, N) or None) -> (ms, calls) over `calls` forwards, the ms and calls per forward."""
    return [{"name": name, "dims": list(dims) if dims else None, "ms": ms / calls, "count": n / calls}
            for (name, dims), (ms, n) in sorted(gemms.items(), key=lambda kv: -kv[1][0])]


def _outermost_gemm(op: Any) -> Any:
    """The outermost GEMM op (aten::linear, not the addmm it calls) that is or encloses `op`, so that a
    projection's time is its whole call (bias, transposes) under one name and shape; None outside GEMMs."""
    found = None
    while op is not None:
        if op.name in GEMM_OPS:
            found = op
        op = op.cpu_parent
    return found


def fp8_proof(runner: Runner, calls: int = 3) -> dict[str, Any]:
    """What runs the runner's FP8 layers: the GEMM path, and on a GPU the kernels that FP8 GEMM ops
    (torch._scaled_mm on float8_e4m3fn inputs) launched in a short profile of the forward."""
    layers = list(runner.fp8_gemm or [])
    fake = len(runner.fp8_layers or []) - len(layers)
    proof: dict[str, Any] = {"gemm": "torch._scaled_mm" if layers else ("fake-quant" if fake else "none"),
                             "fp8_gemm_layers": len(layers), "fake_quant_layers": fake, "kernels": [], "op_dtypes": [],
                             "calls_per_forward": 0}
    if not _on_cuda(runner):
        return proof
    names, dtypes, count = set(), set(), 0
    for device, name, _ms, op in _profiled(runner, calls):
        if device == "cuda" and op is not None and op.name in FP8_GEMM_OPS and not name.startswith("Mem"):
            names.add(name)
            dtypes.add(", ".join(_op_info(op)["dtypes"][:2]))
            count += 1
    proof.update(kernels=sorted(names), op_dtypes=sorted(d for d in dtypes if d), calls_per_forward=count / calls)
    return proof
