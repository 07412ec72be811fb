"""The Amdahl bound beside a measured x: how fast FP8 could make a variant if only its GEMMs changed.

    bound = 1 / ((1 - f) + f / g)

f: the share of the baseline's profiled time (kernels.json, same target, model, setting and
   graph) spent in the GEMMs the variant turns into FP8 (recipe_share);
g: the FP8 speed-up of those GEMMs alone, fp16 time / FP8 time summed over them, at the model's
   own shapes on the target's backend (gemm.json, written by the gemm rule; gemm_speedup).

x near the bound: FP8 gave what the hardware gives the recipe's GEMMs; x far below it: time was
lost around them (quantize kernels, layout changes, fusions the FP8 engine missed). Pure
functions over JSON values: aggregate imports this module, and so may render.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable

AT_LIMIT = 0.9  # default: x at 90% of the bound or more counts as at the hardware limit (`bound.at_limit`)
DEFINITION = ("bound = 1 / ((1 - f) + f / g); f = the time of the GEMMs the variant runs in FP8 over the "
              "baseline's whole profiled time (kernels.json), g = fp16 time / FP8 time of those GEMMs alone "
              "at the model's shapes on the same target (gemm.json)")
_EPS = 1e-6
# A profile is read as a split of the timed call only where its total agrees with what the timing job
# measured for the same engine, setting and graph: within this factor either way. Beyond it the profile
# describes something else than the timed call (a CPU profile counts every op's profiler overhead and a
# loaded machine's stalls: 933 ms profiled against 38.5 ms timed was seen), and f, the bound and any
# share of "profiled time" built on it would mislead.
PROFILE_AGREEMENT = 1.5


def profile_vs_timed(profiled_ms: float | None, timed_ms: float | None) -> float | None:
    """The profile's total over the timed median of the same call; None where either is missing."""
    if profiled_ms is None or timed_ms is None or not timed_ms > 0 or profiled_ms != profiled_ms:
        return None
    return profiled_ms / timed_ms


def profile_agrees(ratio: float, factor: float = PROFILE_AGREEMENT) -> bool:
    """A profile total within `factor` of the timed median, either way."""
    return 1.0 / factor <= ratio <= factor


def amdahl_bound(f: float, g: float) -> float:
    """The speed-up of the whole when a share `f` of its time speeds up by `g` and the rest does not."""
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"f is a share of time, between 0 and 1, not {f}")
    if not g > 0:
        raise ValueError(f"g is a speed-up, above 0, not {g}")
    return 1.0 / ((1.0 - f) + f / g)


def gemm_speedup(shapes: dict[str, dict[str, Any]], calls: Iterable[dict[str, Any]]) -> dict[str, float]:
    """g of a variant: the fp16 and FP8 time of its GEMM calls (each call at its shape's per-GEMM
    time, `shapes[call["shape"]]`), summed, and their ratio."""
    fp16 = fp8 = 0.0
    for call in calls:
        shape = shapes[call["shape"]]
        fp16 += shape["fp16_gemm_ms"]
        fp8 += shape["fp8_gemm_ms"]
    if fp8 <= 0:
        raise ValueError("no FP8 GEMM time to compare with: the variant has no GEMM call")
    return {"fp16_ms": fp16, "fp8_ms": fp8, "g": fp16 / fp8}


def _names(layer: str) -> re.Pattern:
    # `<layer>/` as a whole module path: blocks.0.attn.proj must not match cls_attn_blocks.0.attn.proj/...
    return re.compile(r"(?<![\w.])" + re.escape(layer) + "/")


def recipe_share(profile: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """f: the share of a profiled graph's time (a kernels.json graph entry) in the variant's GEMM
    calls (gemm.json: each with its `layer` and `dims` [M, K, N]), and how it was found (`basis`).

    Where the profile names GEMMs after their modules (ONNX Runtime nodes, TensorRT layers:
    `gemm_names: module`), a GEMM is the recipe's when its name holds a recipe layer and its
    dims, where known, are that call's. Where it names only ops (torch: `aten::linear`), a GEMM is
    the recipe's by its dims; GEMMs of the same dims that are not the recipe's (the count says how
    many) share that dims' time by call count, as equal GEMMs take equal time. `kind` says how
    exact f is: exact, split (same-shape time split by count), superset (more GEMMs under the
    recipe's names than it runs: f is an upper bound) or incomplete (some recipe GEMMs not found
    in the profile, e.g. compiled kernels no op claims: f is a lower bound).
    """
    entries = profile.get("gemms")
    total = profile.get("total_ms") or 0.0
    if entries is None:
        raise ValueError("the profile records no GEMM calls (a kernels.json from before the bound): rerun profile")
    if total <= 0:
        raise ValueError("the profile's total time is zero")
    expected = len(calls)
    notes: list[str] = []
    if profile.get("gemm_names") == "module":
        how = "by module name"
        patterns = {layer: _names(layer) for layer in {c["layer"] for c in calls}}
        wanted = defaultdict(list)  # layer -> dims of its recipe calls
        for c in calls:
            wanted[c["layer"]].append(c["dims"])
        attributed, found = 0.0, 0.0
        for e in entries:
            named = [layer for layer, p in patterns.items() if p.search(e["name"])
                     and (e["dims"] is None or e["dims"] in wanted[layer])]
            if named:
                attributed += e["ms"]
                found += e["count"] * len(named)
        kind = "exact"
        if found > expected + _EPS:
            kind = "superset"
            notes.append(f"{found:g} GEMM calls run under the names of the recipe's {expected} "
                         "(calls it keeps out of FP8, or GEMMs of unknown shape): f counts them all, an upper bound")
    else:
        how = "by shape [M, K, N]"
        want: dict[tuple, int] = defaultdict(int)
        for c in calls:
            want[tuple(c["dims"])] += 1
        have_ms: dict[tuple, float] = defaultdict(float)
        have_n: dict[tuple, float] = defaultdict(float)
        for e in entries:
            if e["dims"] is not None:
                have_ms[tuple(e["dims"])] += e["ms"]
                have_n[tuple(e["dims"])] += e["count"]
        attributed = sum(have_ms[d] * min(1.0, n / have_n[d]) for d, n in want.items() if have_n[d] > 0)
        found = sum(min(float(n), have_n[d]) for d, n in want.items())
        others = sum(have_n[d] - n for d, n in want.items() if have_n[d] > n + _EPS)
        kind = "exact"
        if others:
            kind = "split"
            notes.append(f"{others:g} GEMM calls of the recipe's shapes are not the recipe's: "
                         "each shape's time is split by call count")
    if found < expected - _EPS:
        kind = "incomplete"
        notes.append(f"only {found:g} of the recipe's {expected} GEMM calls are in the profile: f is a lower bound")
    f = min(1.0, attributed / total)
    return {"f": f, "recipe_ms": attributed, "total_ms": total, "gemm_calls": expected, "found": found,
            "kind": kind, "basis": "; ".join([how] + notes)}


def at_limit(x: float | None, bound: float | None, threshold: float = AT_LIMIT) -> bool | None:
    """Whether x reached the bound (x >= threshold x bound): then the hardware, not the engine, set x."""
    if x is None or bound is None:
        return None
    return x >= threshold * bound
