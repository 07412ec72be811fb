"""The steps that measure a built variant: time (beside its baseline), profile (kernel groups), gemm (g of
the Amdahl bound) and evaluate (the family's quality metrics). Each opens the build's engines
(steps_engines.open_engines), records what it measured or its failure, and, where it ran the engine,
TEST01's probe of its outputs and the digests of the files it opened."""

from __future__ import annotations

import functools
import logging
import math
import traceback
from typing import TYPE_CHECKING, Any

from quantstudy.artifacts import read_json
from quantstudy.config import Target
from quantstudy.steps import (Progress, family_of, gpu_work, job_settings, record_result, samples_of, setting_of,
                              snapshot_of)
from quantstudy.steps_engines import example_inputs, open_engines, variant_modules
from quantstudy.steps_reference import read_amax
from quantstudy.timing import measures_speed

if TYPE_CHECKING:  # for annotations only: a step imports backends (and torch) when it runs
    from quantstudy.backends import Runner

log = logging.getLogger("quantstudy")


def _opened(runners: dict[str, Runner]) -> dict[str, float]:
    """{graph: seconds} it took to open each engine that a job opened from a compiled program."""
    return {g: round(r.open_seconds, 3) for g, r in runners.items() if r.open_seconds is not None}


def _redone(runners: dict[str, Runner]) -> dict[str, dict[str, float]]:
    """{graph: {kind: seconds}} of the work opening each engine redid that its build should have done
    (Runner.open_redone; the audit's redone_problems)."""
    return {g: {k: round(v, 3) for k, v in r.open_redone.items()} for g, r in runners.items() if r.open_redone}


def _probe(family: str, build_doc: dict[str, Any], checkpoint_json: str, setting, runners: dict[str, Runner]
           ) -> dict[str, Any]:
    """TEST01's probe: each graph's outputs on the setting's seeded example inputs, in brief (shape,
    non-finite count, L2 norm and 64 evenly spaced values of each output), so that the audit can
    check that the timing job and the evaluation job got the same answer from the same engine."""
    import torch

    precision, ckpt, probe = build_doc["spec"]["precision"], snapshot_of(checkpoint_json), {}
    for g, runner in runners.items():
        with torch.no_grad():
            outs = runner(example_inputs(family, ckpt, g, setting, precision))
        probe[g] = {}
        for name, t in outs.items():
            flat = t.detach().float().cpu().flatten()
            picks = torch.linspace(0, flat.numel() - 1, min(64, flat.numel())).long()
            finite = flat[torch.isfinite(flat)]
            probe[g][name] = {"shape": list(t.shape), "nonfinite": int(flat.numel() - finite.numel()),
                              "l2": float(finite.double().norm()),
                              "values": [v if math.isfinite(v) else None for v in flat[picks].tolist()]}
    return probe


def _engine_digests(build_doc: dict[str, Any]) -> dict[str, Any]:
    """What a job measured, by sha256 (TEST01: the timed and the evaluated engine are one file):
    `engine_sha256` {graph: sha256} and, for a compiled engine, `compiled_sha256` {graph: sha256}."""
    graphs = build_doc["graphs"].items()
    digests: dict[str, Any] = {"engine_sha256": {g: e["engine_sha256"] for g, e in graphs}}
    if any("compiled_sha256" in e for _, e in graphs):
        digests["compiled_sha256"] = {g: e["compiled_sha256"] for g, e in graphs}
    return digests


@measures_speed
def time(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any], recipe: dict,
         timing: dict[str, int], checkpoint_json: str, build_json: str, baseline_build_json: str, out: str,
         repeat: int = 1) -> None:
    """Time each graph of the variant and of its baseline side by side (one process, interleaved rounds).
    `repeat`: which of the variant's separate timing jobs this is (1, 2, ...)."""
    from quantstudy import timing as qt

    inputs = {"checkpoint": checkpoint_json, "build": build_json, "baseline_build": baseline_build_json}
    params = {"target": target, "timing": timing, "setting": setting, "repeat": repeat}
    variant_doc, base_doc = read_json(build_json, "build"), read_json(baseline_build_json, "build")
    baseline = base_doc["variant"]

    def measure() -> dict[str, Any]:
        job_settings()
        st, tgt = setting_of(setting), Target.from_params(target)
        # {variant: its runners}: the variant's engines, and its baseline's (the same ones for the baseline itself)
        with gpu_work(tgt.device):
            runners = {doc["variant"]: open_engines(family, doc, recipe, checkpoint_json, st, tgt)
                       for doc in {d["variant"]: d for d in (variant_doc, base_doc)}.values()}
        graphs = {}
        with qt.measuring(tgt.device) as measuring:  # one turn for every graph
            for g in runners[ident["variant"]]:
                pair = {name: r[g] for name, r in runners.items()}
                result = qt.time_interleaved(pair, timing["warmup"], timing["rounds"], timing["calls_per_round"],
                                             lambda line: log.info("%s %s", g, line), timing.get("min_round_ms", 0.0))
                # Proof of FP8: the kernels the variant's FP8 GEMM ops launch (a short profile, after timing).
                fp8 = qt.fp8_proof(pair[ident["variant"]])
                log.info("%s FP8 GEMMs: %s", g, fp8)
                v, b = result[ident["variant"]], result[baseline]
                graphs[g] = {"variant_ms": v, "baseline_ms": b, **qt.speedup(b["samples_ms"], v["samples_ms"]), "fp8": fp8}
        with gpu_work(tgt.device):
            probe = _probe(family, variant_doc, checkpoint_json, st, runners[ident["variant"]])
        return {"repeat": repeat, "baseline": baseline, "batch": st.batch, "shape": dict(st.shape), "graphs": graphs,
                **_engine_digests(variant_doc), "open_seconds": {v: _opened(r) for v, r in runners.items()},
                "open_redone": {v: _redone(r) for v, r in runners.items()}, "probe": probe, "measuring": measuring}

    record_result("timing", "time", out, ident, inputs, params, measure, {"baseline": baseline, "repeat": repeat})


@measures_speed
def profile(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any], recipe: dict,
            calls: int, checkpoint_json: str, build_json: str, out: str) -> None:
    """Kernel (GPU) or op (CPU) time per call of each graph, in the family's kernel groups."""
    from quantstudy import backends, quantization, timing as qt

    inputs = {"checkpoint": checkpoint_json, "build": build_json}
    params = {"target": target, "calls": calls, "setting": setting}

    def measure() -> dict[str, Any]:
        job_settings()  # as in the build: inductor's CPU code depends on the thread count
        fam, st, tgt = family_of(family), setting_of(setting), Target.from_params(target)
        build_doc = read_json(build_json, "build")
        with gpu_work(tgt.device):
            runners = open_engines(family, build_doc, recipe, checkpoint_json, st, tgt)
        regions = set(fam.regions) | {quantization.FP8_REGION}
        classify = functools.partial(fam.kernel_group, setting=st)
        with qt.measuring(tgt.device) as measuring:  # one turn for every graph
            graphs = {g: backends.get(tgt.backend).profile(runner, calls, classify, regions) for g, runner in runners.items()}
        return {"groups": fam.kernel_groups, "graphs": graphs, **_engine_digests(build_doc),
                "open_seconds": _opened(runners), "open_redone": _redone(runners), "measuring": measuring}

    record_result("kernels", "profile", out, ident, inputs, params, measure)


@measures_speed
def gemm(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any],
         architecture: dict[str, Any], specs: dict[str, dict[str, Any]], recipe: dict[str, Any],
         timing: dict[str, int], checkpoint_json: str, amax_json: str, out: str) -> None:
    """g of the Amdahl bound: each FP8 variant's GEMM calls at this setting (`specs`: variant -> spec),
    found by running its module on the setting's example inputs, then fp16 against FP8 at each
    distinct shape on the target's backend (gemm.py), and per variant g = its summed fp16 GEMM time
    over its summed FP8 GEMM time."""
    from quantstudy import bound, gemm as qg

    inputs = {"checkpoint": checkpoint_json, "amax": amax_json}
    params = {"specs": specs, "recipe": recipe, "target": target, "timing": timing, "setting": setting}

    def measure() -> dict[str, Any]:
        job_settings()
        amax_doc = read_amax(amax_json)
        fam, st, ckpt, tgt = family_of(family), setting_of(setting), snapshot_of(checkpoint_json), Target.from_params(target)
        graphs, measuring = {}, []
        for g in fam.graphs(st, architecture):
            calls, variants = {}, {}
            for variant, spec in specs.items():
                try:  # a variant that cannot be made (its build fails the same way) is its own failure
                    model, _ = variant_modules(family, ckpt, st, spec, recipe, amax_doc, [g])[g]
                except Exception:
                    variants[variant] = {"status": "failed", "error": traceback.format_exc(), "calls": []}
                    log.error("%s %s: %s", g, variant, variants[variant]["error"].strip().splitlines()[-1])
                    continue
                with gpu_work(tgt.device):
                    calls[variant] = qg.recipe_calls(model.to(tgt.device), {
                        k: v.to(tgt.device) for k, v in example_inputs(family, ckpt, g, st, spec["precision"]).items()})
                log.info("%s %s: %d FP8 GEMM calls", g, variant, len(calls[variant]))
            shapes = qg.time_calls(calls, {v: s["precision"] for v, s in specs.items()}, tgt, timing,
                                   lambda line: log.info("%s %s", g, line), spans=measuring)
            for variant, cs in calls.items():
                listed = [{"layer": c["layer"], "dims": c["dims"], "shape": qg.shape_key(c)} for c in cs]
                if not listed:  # no FP8 layer runs in this graph: nothing for FP8 to change
                    variants[variant] = {"status": "ok", "calls": [], "fp16_ms": 0.0, "fp8_ms": 0.0, "g": None,
                                         "emulated": None}
                    continue
                variants[variant] = {"status": "ok", "calls": listed, **bound.gemm_speedup(shapes, listed),
                                     "emulated": any(shapes[c["shape"]]["emulated"] for c in listed)}
                log.info("%s %s: g = %.3f", g, variant, variants[variant]["g"])
            graphs[g] = {"shapes": shapes, "variants": variants}
        return {"backend": tgt.backend, "batch": st.batch, "shape": dict(st.shape), "graphs": graphs,
                "definition": qg.DEFINITION, "measuring": measuring}

    record_result("gemm", "gemm", out, ident, inputs, params, measure)


def batched_run(runners: dict[str, Runner], batch: int):
    """The family's view of the engines: run(inputs, what, graph, whole, on_device) -> outputs gathered on
    the CPU. Rows go to the engine `batch` at a time (`whole`: all in one call, which the engine itself
    runs in chunks of the batch it was built for); a call that names `what` logs its progress.
    `on_device`: the outputs stay where the engine made them, for a family that reduces large outputs
    (a vocabulary's logits, every K/V cache) there rather than bring them to the CPU."""
    import torch

    def run(inputs: dict[str, Any], what: str = "", graph: str = "main", whole: bool = False,
            on_device: bool = False) -> dict[str, Any]:
        runner = runners[graph]
        rows = next(iter(inputs.values())).shape[0]
        step = rows if whole else batch
        progress, outs = Progress(what, rows) if what else None, []
        for i in range(0, rows, step):
            out = runner({k: v[i:i + step] for k, v in inputs.items()})
            outs.append(out if on_device else {k: v.cpu() for k, v in out.items()})
            if progress:
                progress(min(i + step, rows))
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    return run


def evaluate(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any], recipe: dict,
             metrics: dict[str, Any], seeds: dict[str, int], checkpoint_json: str, build_json: str,
             reference_json: str, reference_tensors: str, samples_jsons: dict[str, str], out: str,
             against_builds: dict[str, str] | None = None, repeat: int = 1) -> None:
    """The family's quality metrics of the engine against the reference and against the engines
    of `against_builds` (variant -> build.json, same target and setting), and its non-finite scan;
    `repeat`: which of the engine's evaluation jobs this is (evaluation.repeats)."""
    import torch
    from safetensors.torch import load_file

    against_builds = against_builds or {}
    inputs = {"checkpoint": checkpoint_json, "build": build_json, "reference": reference_json,
              "reference_tensors": reference_tensors, **samples_jsons,
              **{f"against_{v}": p for v, p in against_builds.items()}}
    params = {"target": target, "metrics": metrics, "seeds": seeds, "setting": setting, "repeat": repeat}

    def measure() -> dict[str, Any]:
        job_settings()
        st, tgt = setting_of(setting), Target.from_params(target)
        build_doc = read_json(build_json, "build")
        with gpu_work(tgt.device), torch.no_grad():
            runners = open_engines(family, build_doc, recipe, checkpoint_json, st, tgt)
            against = {v: batched_run(open_engines(family, read_json(p, "build"), recipe, checkpoint_json, st, tgt),
                                      st.batch) for v, p in against_builds.items()}
            result = family_of(family).evaluate(snapshot_of(checkpoint_json), batched_run(runners, st.batch),
                                                load_file(reference_tensors), samples_of(samples_jsons, family), st, metrics,
                                                seeds, tgt.device, against)
            log.info("%s; non-finite %d", result.blocks, result.total_nonfinite)
            probe = _probe(family, build_doc, checkpoint_json, st, runners)
        return {"repeat": repeat, "blocks": result.blocks, **_engine_digests(build_doc), "open_seconds": _opened(runners),
                "open_redone": _redone(runners), "probe": probe, "nonfinite": {**result.nonfinite, "total_bad": result.total_nonfinite}}

    record_result("quality", "evaluate", out, ident, inputs, params, measure, {"repeat": repeat})
