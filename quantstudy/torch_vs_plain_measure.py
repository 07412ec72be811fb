"""One setting of torch_vs_plain (quantstudy.torch_vs_plain, which says what is compared and why):
the workflow's builds made, the project's and the plain engines opened (compile workers, inductor's
caches), their outputs checked against each other within what rounding does (`check`,
`fp8_layers_agree`), timed together and profiled, a row per graph.
"""

from __future__ import annotations

import argparse
import functools
import gc
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from quantstudy import artifacts, config, families, paths, plain, quantization, steps_engines, timing as qt
from quantstudy.backends import torch_backend
from quantstudy.plain import fp8 as plain_fp8

# The command a compile worker runs: the benchmark's own, with --open-only.
COMMAND = "quantstudy.torch_vs_plain"


def say(msg: str, started: float = time.perf_counter()) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)


def workflow_builds(todo: list[tuple[config.Study, str, str]], target: config.Target, config_files: list[Path],
                    cores: int) -> None:
    """Have the workflow make the baseline and candidate builds of every planned setting (and what
    they need: local hub, checkpoint, samples, calibration), as `snakemake <build.json>` would: these
    are the study's own engines, cached and rebuilt only when their inputs change."""
    wanted = sorted({study.build_json(target.name, m, st, v) for study, m, st in todo
                     for v in (study.baseline.of(st), study.candidate)})
    say(f"snakemake: {len(wanted)} builds")
    done = subprocess.run([sys.executable, "-m", "snakemake", "--configfile", *map(str, config_files), "--cores", str(cores),
                           "--keep-going", "--rerun-incomplete", *wanted], capture_output=True, text=True)
    if done.returncode != 0:  # a setting whose build is missing fails alone (measure), the others run
        say("snakemake failed; its last lines:\n" + "\n".join(done.stderr.splitlines()[-30:]))


def difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """||a - b|| / ||b|| over the whole output (fp32), the largest |a - b|, and non-finite values."""
    a, b = a.float().cpu(), b.float().cpu()
    bad = int((~torch.isfinite(a)).sum() + (~torch.isfinite(b)).sum())
    if bad:
        return {"rel_l2": None, "max_abs": None, "nonfinite": bad}
    norm = float(b.norm())
    return {"rel_l2": float((a - b).norm()) / norm if norm > 0 else float((a - b).norm()),
            "max_abs": float((a - b).abs().max()), "nonfinite": 0}


LAYER_TOLERANCE = 2.0 ** -11  # fp16's unit roundoff: one FP8 layer, the same input, weights and scales


def check(outputs: dict[str, dict[str, torch.Tensor]], reference: dict[str, torch.Tensor], baseline: str,
          candidate: str, layers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Project against plain per variant, within what rounding does to this output.

    fp16 rounding: how far the project's baseline is from the fp32 graph module (`reference`). The
    baseline pair may differ by twice that (two fp16 roundings in different orders). The candidate
    pair must be closer than FP8 is to fp16 in either implementation (a plain model that computed
    the baseline instead of FP8 is as far as that), and its FP8 layers must agree one by one
    (`layers`, from fp8_layers_agree; where it is not given, only the outputs are checked).
    """
    name = next(iter(reference))
    out = {k: v[name] for k, v in outputs.items()}
    rounding = difference(out[f"project {baseline}"], reference[name])
    pairs = {v: difference(out[f"project {v}"], out[f"plain {v}"]) for v in (baseline, candidate)}
    apart = {impl: difference(out[f"{impl} {candidate}"], out[f"{impl} {baseline}"]) for impl in ("project", "plain")}
    tolerance = None
    if None not in (rounding["rel_l2"], apart["project"]["rel_l2"], apart["plain"]["rel_l2"]):
        tolerance = {baseline: 2 * rounding["rel_l2"], candidate: min(apart["project"]["rel_l2"], apart["plain"]["rel_l2"])}
    ok = (tolerance is not None and pairs[baseline]["rel_l2"] is not None and pairs[candidate]["rel_l2"] is not None
          and pairs[baseline]["rel_l2"] <= tolerance[baseline] and pairs[candidate]["rel_l2"] < tolerance[candidate]
          and (layers is None or layers["ok"]))
    return {"output": name, "fp16_rounding": rounding, "tolerance_rel_l2": tolerance, "project_vs_plain": pairs,
            "candidate_vs_baseline": apart, "fp8_layers": layers, "ok": ok}


@torch.no_grad()
def fp8_layers_agree(project: torch.nn.Module, plain_model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                     prefix: str = "") -> dict[str, Any]:
    """Each FP8 layer of the plain model on the input its project counterpart got in one eager
    forward of the project's engine, against that layer's output there. The same quantized weight,
    scales and GEMM give the same result; a plain model that quantized other layers, at other
    scales or with another rounding fails here, where whole-model outputs could not tell.
    `prefix`: what the plain model's layer names have before the project's (plain.layer_prefix)."""
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def keep(name: str):
        return lambda _module, args, output: calls.append((name, args[0].detach().clone(), output.detach().clone()))

    handles = [m.register_forward_hook(keep(n)) for n, m in project.named_modules()
               if isinstance(m, quantization.FP8Linear)]
    try:
        project(**inputs)
    finally:
        for h in handles:
            h.remove()
    plain_layers = {n.removeprefix(prefix): m for n, m in plain_model.named_modules()
                    if isinstance(m, plain_fp8.FP8Linear) and n.startswith(prefix)}
    missing = sorted({n for n, _, _ in calls} - set(plain_layers))
    worst: dict[str, Any] = {"layer": None, "rel_l2": 0.0, "max_abs": 0.0}
    for name, x, y in calls:
        if name in missing:
            continue
        d = difference(plain_layers[name](x), y)
        if d["rel_l2"] is None or d["rel_l2"] > worst["rel_l2"]:
            worst = {"layer": name, **d}
        if d["rel_l2"] is None:
            break
    ok = bool(calls) and not missing and worst["rel_l2"] is not None and worst["rel_l2"] <= LAYER_TOLERANCE
    return {"calls": len(calls), "layers": len({n for n, _, _ in calls}), "missing_in_plain": missing,
            "worst": worst, "tolerance_rel_l2": LAYER_TOLERANCE, "ok": ok}


def fp32_outputs(family: str, snapshot: str, st, graph: str, example: dict[str, torch.Tensor], device: str
                 ) -> dict[str, torch.Tensor]:
    """The fp32 graph module's outputs (eager, TF32 off): what fp16 rounding is measured against."""
    module = families.get(family).module(snapshot, graph, st).to(device).eval()
    with torch.no_grad():
        out = module(**{k: v.to(device) for k, v in quantization.cast_inputs(example, "float32").items()})
    return {k: v.float().cpu() for k, v in out.items()}


def free(device: str) -> None:
    gc.collect()
    torch._dynamo.reset()  # each setting compiles its own modules: keep the recompile limits for them
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def measure(study: config.Study, model: str, setting: str, target: config.Target, args: argparse.Namespace
            ) -> list[dict[str, Any]]:
    """Open the workflow's builds of the baseline and candidate, then per graph check, time (and
    profile) them against the plain ones: a row per graph."""
    seconds: dict[str, float] = {}
    lap = time.perf_counter()

    def done(what: str) -> None:
        nonlocal lap
        seconds[what] = round(time.perf_counter() - lap, 2)
        lap = time.perf_counter()
        say(f"{model}/{setting}: {what} {seconds[what]} s")

    baseline, candidate = study.baseline.of(setting), study.candidate
    builds = {}
    for v in (baseline, candidate):
        path = Path(study.build_json(target.name, model, setting, v))
        if not path.exists():
            raise RuntimeError(f"the workflow did not make {path}: see logs/{path.parent.relative_to(paths.RESULTS)}/")
        builds[v] = artifacts.read_json(path, "build")
        if builds[v]["status"] != "ok":
            raise RuntimeError(f"the project's build of {v} failed:\n{builds[v]['error']}")
    if args.compile_workers and not args.open_only:
        # The project's engines were compiled by their builds; the plain ones are compiled here.
        compile_in_workers(model, setting, [f"plain {v}" for v in (baseline, candidate)], args)
        done("compile workers (one process per engine, in parallel)")
    ckpt = builds[baseline]["provenance"]["inputs"]["checkpoint"]["path"]
    snapshot = artifacts.read_json(ckpt, "checkpoint")["snapshot"]
    rows = []
    st = study.setting(setting)
    for graph in families.get(study.family).graphs(st, study.models[model].architecture):
        row = measure_graph(study, model, setting, graph, target, snapshot, ckpt, builds, args, done)
        if row is not None:  # None: a compile worker, which only opens
            rows.append({**row, "seconds": dict(seconds)})
        seconds.clear()
    return rows


def compile_in_workers(model: str, setting: str, engines: list[str], args: argparse.Namespace) -> None:
    """Compile each engine of the setting in a process of its own, all at once, into inductor's
    on-disk caches (FX graph, Triton), which this process then reads when it opens them: compiling
    is mostly single-threaded Python, and one setting's four engines took ~9 minutes in a row on an H200.
    A worker that fails is logged and left: this process compiles that engine itself."""
    logs = args.work / "compile-workers"
    logs.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, "-m", COMMAND, "--config", *(str(p.resolve()) for p in run_config(args)), "--settings",
              f"{model}/{setting}", "--work", str(args.work.resolve()), "--workdir", str(Path.cwd())]
    workers = {}
    for engine in engines:
        log_file = logs / f"{model}-{setting}-{engine.replace(' ', '-')}.log"
        with open(log_file, "w") as f:
            workers[engine] = (subprocess.Popen([*common, "--open-only", engine], stdout=f, stderr=subprocess.STDOUT),
                               log_file)
    for engine, (proc, log_file) in workers.items():
        if proc.wait() != 0:
            tail = "\n".join(log_file.read_text().splitlines()[-15:])
            say(f"{model}/{setting}: the compile worker of {engine} failed ({log_file}); compiling it here:\n{tail}")


def measure_graph(study: config.Study, model: str, setting: str, graph: str, target: config.Target, snapshot: str,
                  ckpt: str, builds: dict[str, dict[str, Any]], args: argparse.Namespace,
                  done) -> dict[str, Any] | None:
    """One graph of the built baseline and candidate against the plain ones: open, check, time, profile.
    A compile worker (--open-only) opens its one engine and returns None."""
    family, st = study.family, study.setting(setting)
    baseline, candidate = study.baseline.of(setting), study.candidate
    on = "" if graph == "main" else f" {graph}"  # in the step names of a family with several graphs
    example = steps_engines.example_inputs(family, snapshot, graph, st, builds[baseline]["spec"]["precision"])
    runners, fp8_layers = {}, {}

    def opens(engine: str) -> bool:  # a compile worker opens its own engine alone
        return args.open_only in (None, engine)

    project = {}  # each project engine: the build it was opened from, its files' sha256, the opening
    for v in (baseline, candidate):
        if opens(f"project {v}"):
            with fx_graph_cache() as cache:
                runners[f"project {v}"] = steps_engines.open_engines(family, builds[v], study.recipe.as_params(), ckpt, st, target,
                                                                     [graph])[graph]
            done(f"project {v}{on}: open (compile, capture{cache})")
            opened, engine = runners[f"project {v}"], builds[v]["graphs"][graph]
            project[v] = {"build": study.build_json(target.name, model, setting, v),
                          **{k: engine[k] for k in ("engine_sha256", "compiled_sha256") if k in engine},
                          "open_seconds": opened.open_seconds, "open_redone": opened.open_redone}
        if opens(f"plain {v}"):
            module = plain.model(family, snapshot, st, builds[v], target.device, graph)
            fp8_layers[v] = {"project": len(builds[v]["fp8_layers"]),
                             "plain": sum(isinstance(m, plain_fp8.FP8Linear) for m in module.modules())}
            # Inputs of its own: a plain graph may write into them (a decode graph, its caches).
            with fx_graph_cache() as cache:
                runners[f"plain {v}"] = torch_backend.Runner(module, {k: t.clone() for k, t in example.items()},
                                                             target.device, target.compile)
            done(f"plain {v}{on}: open (compile, capture{cache})")
    if args.open_only:
        for runner in runners.values():
            runner.replay()  # a CPU runner compiles on its first timed call
        return None
    outputs = {name: r(example) for name, r in runners.items()}
    layers = fp8_layers_agree(runners[f"project {candidate}"].module, runners[f"plain {candidate}"].module,
                              runners[f"project {candidate}"].static_inputs, plain.layer_prefix(family))
    result_check = check(outputs, fp32_outputs(family, snapshot, st, graph, example, target.device), baseline,
                         candidate, layers)
    t = {**study.timing.job_params(), **{k: v for k, v in (("warmup", args.warmup), ("rounds", args.rounds),
                                                     ("calls_per_round", args.calls)) if v is not None}}
    with qt.device_lock(target.device):
        timed = qt.time_interleaved(runners, t["warmup"], t["rounds"], t["calls_per_round"])
        fp8 = {impl: qt.fp8_proof(runners[f"{impl} {candidate}"]) for impl in ("project", "plain")}
    done(f"check and timing{on}")
    row: dict[str, Any] = {
        "study": study.name, "family": family, "model": model, "setting": setting, "graph": graph, "batch": st.batch,
        "shape": dict(st.shape), "baseline": baseline, "candidate": candidate, "status": "ok", "timing": t,
        "ms": {name: r["median_ms"] for name, r in timed.items()}, "engines": timed,
        # project / plain per variant, with its range over the paired rounds
        "ratio": {v: qt.speedup(timed[f"project {v}"]["samples_ms"], timed[f"plain {v}"]["samples_ms"])
                  for v in (baseline, candidate)},
        "x": {impl: qt.speedup(timed[f"{impl} {baseline}"]["samples_ms"], timed[f"{impl} {candidate}"]["samples_ms"])
              for impl in ("project", "plain")},
        "check": result_check,
        "fp8_layers": fp8_layers,
        "project_engines": project,
        "fp8_gemm_calls_per_forward": {impl: p["calls_per_forward"] for impl, p in fp8.items()},
        "fp8_kernels": {impl: p["kernels"] for impl, p in fp8.items()},
    }
    if args.profile:
        fam = families.get(family)
        classify = functools.partial(fam.kernel_group, setting=st)
        regions = set(fam.regions) | {quantization.FP8_REGION}
        with qt.device_lock(target.device):
            row["profile"] = {name: qt.kernel_profile(r, args.profile_calls, classify, regions)
                              for name, r in runners.items()}
        done(f"profiles{on}")
    del runners, outputs
    return row


class fx_graph_cache:
    """Counts inductor's FX graph cache hits and misses inside the block; str() says them (or nothing
    when nothing was compiled): whether a compile worker's output was read."""

    def __enter__(self):
        self._before = self._read()
        return self

    def __exit__(self, *exc):
        after = self._read()
        self.hits, self.misses = after[0] - self._before[0], after[1] - self._before[1]

    @staticmethod
    def _read() -> tuple[int, int]:
        from torch._dynamo.utils import counters  # read anew: dynamo may replace the per-topic counters

        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    def __str__(self) -> str:
        hits, misses = getattr(self, "hits", 0), getattr(self, "misses", 0)
        return f"; FX graph cache {hits} hit, {misses} missed" if hits or misses else ""


def run_config(args: argparse.Namespace) -> list[Path]:
    """The run config and the layers over it (a default is the workdir's own)."""
    return args.config or [args.workdir / ("config/config.yaml" if args.tiny else "config/h200.yaml")]
