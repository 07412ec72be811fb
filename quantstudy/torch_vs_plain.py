"""The torch backend's engines against plain torch implementations of the same math, in one process
(its command: benchmarks/torch_vs_plain.py, or `python -m quantstudy.torch_vs_plain`).

For each timed model and setting of a run config, the project's baseline and candidate engines are
the workflow's: `workflow_builds` runs `snakemake --configfile RUN.yaml <their build.json>` in the
checkout (local hub, checkpoints, samples, calibration and builds, cached as in any run), and
`measure` opens each build as a measurement job does (steps.open_engines: the backend contract, from
the build's compiled program on a compiling target). Beside them, the family's plain implementation
(quantstudy.plain, which says what plain means per family) with the same weights and the same amax,
opened by the same Runner (torch.compile and CUDA-graph replay on a GPU; eager on the CPU). A row per
graph of the setting. The four engines of a graph are timed together (timing.time_interleaved:
interleaved rounds, the study's warm-up, rounds and calls, median), and their outputs on the
setting's example input compared: project against plain, baseline with baseline and FP8 with FP8
(same scales), as the relative L2 difference ||project - plain|| / ||plain|| over the whole output
(`check`). The baseline pair may differ by twice fp16 rounding as measured on that output (the
project's baseline against the fp32 graph module). The FP8 pair cannot be held to that: a rounding
difference upstream of a quantizer flips FP8 roundings (an eighth to a sixteenth of a value each),
and through a deep random-weight model the flips add up. So each FP8 layer is checked on its own
(`fp8_layers_agree`: the plain layer on the very input the project's layer got, against the project
layer's output; the same weights, scales and GEMM agree to fp16's unit roundoff), and the whole FP8
outputs must be closer to each other than FP8 is to fp16 in either implementation. FP8 against fp16
is reported beside it, so that the check is seen to tell them apart.

Prints a markdown table per setting as it finishes and a summary of all of them: ms of both
implementations, project / plain, and x (baseline / candidate) of both; --out writes the same as a
`torch_vs_plain` JSON. --profile adds, from the same process, a kernel profile of each of the four
engines (timing.kernel_profile: the family's kernel groups and the top kernels with their launches
per call). Settings run in the order of the --settings patterns that match them, then as the run
config declares them; --budget-s stops before a setting that would not finish in time (as long as
the longest one so far), and what ran is printed and written; the JSON is written after every
setting. --compile-workers compiles a setting's two plain engines side by side, a process each, into
inductor's on-disk caches, and then opens them here from those caches (the project's engines were
compiled by their builds).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import gc
import logging
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

import torch

from quantstudy import artifacts, config, families, paths, plain, quantization, steps, timing as qt
from quantstudy.backends import torch_backend
from quantstudy.plain import fp8 as plain_fp8

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("torch_vs_plain")

# The bar: each engine of the project at most 3% slower than plain torch.
MARGIN = 1.03


def _say(msg: str, started: float = time.perf_counter()) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)


def workflow_builds(todo: list[tuple[config.Study, str, str]], target: config.Target, config_files: list[Path],
                    cores: int) -> None:
    """Have the workflow make the baseline and candidate builds of every planned setting (and what
    they need: local hub, checkpoint, samples, calibration), as `snakemake <build.json>` would: these
    are the study's own engines, cached and rebuilt only when their inputs change."""
    wanted = sorted({study.build_json(target.name, m, st, v) for study, m, st in todo
                     for v in (study.baseline.of(st), study.candidate)})
    _say(f"snakemake: {len(wanted)} builds")
    done = subprocess.run([sys.executable, "-m", "snakemake", "--configfile", *map(str, config_files), "--cores", str(cores),
                           "--keep-going", "--rerun-incomplete", *wanted], capture_output=True, text=True)
    if done.returncode != 0:  # a setting whose build is missing fails alone (measure), the others run
        _say("snakemake failed; its last lines:\n" + "\n".join(done.stderr.splitlines()[-30:]))


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


def _free(device: str) -> None:
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
        _say(f"{model}/{setting}: {what} {seconds[what]} s")

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
    common = [sys.executable, "-m", __name__, "--config", *(str(p.resolve()) for p in run_config(args)), "--settings",
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
            _say(f"{model}/{setting}: the compile worker of {engine} failed ({log_file}); compiling it here:\n{tail}")


def measure_graph(study: config.Study, model: str, setting: str, graph: str, target: config.Target, snapshot: str,
                  ckpt: str, builds: dict[str, dict[str, Any]], args: argparse.Namespace,
                  done) -> dict[str, Any] | None:
    """One graph of the built baseline and candidate against the plain ones: open, check, time, profile.
    A compile worker (--open-only) opens its one engine and returns None."""
    family, st = study.family, study.setting(setting)
    baseline, candidate = study.baseline.of(setting), study.candidate
    on = "" if graph == "main" else f" {graph}"  # in the step names of a family with several graphs
    example = steps.example_inputs(family, snapshot, graph, st, builds[baseline]["spec"]["precision"])
    runners, fp8_layers = {}, {}

    def opens(engine: str) -> bool:  # a compile worker opens its own engine alone
        return args.open_only in (None, engine)

    project = {}  # each project engine: the build it was opened from, its files' sha256, the opening
    for v in (baseline, candidate):
        if opens(f"project {v}"):
            with fx_graph_cache() as cache:
                runners[f"project {v}"] = steps.open_engines(family, builds[v], study.recipe.as_params(), ckpt, st, target,
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


# --- printing ------------------------------------------------------------------------------------

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _x(s: dict[str, float]) -> str:
    return f"{s['x']:.3f} ({s['x_min']:.3f} to {s['x_max']:.3f})"


def _rel(d: dict[str, Any]) -> str:
    return f"non-finite ({d['nonfinite']})" if d["rel_l2"] is None else f"{d['rel_l2']:.2e}"


def _where(row: dict[str, Any]) -> str:
    """The row's setting, and its graph where the family has several (prefill, decode)."""
    graph = row.get("graph", "main")
    return row["setting"] if graph == "main" else f"{row['setting']} {graph}"


def _shape(row: dict[str, Any]) -> str:
    return ", ".join([f"batch {row['batch']}"] + [f"{k} {v}" for k, v in row["shape"].items()])


def row_table(row: dict[str, Any]) -> str:
    head = f"### {row['family']}: {row['model']} {_where(row)} ({_shape(row)})\n"
    if row["status"] != "ok":
        return head + f"\n{row['status']}: {row['error'].strip().splitlines()[-1]}\n"
    b, c, chk = row["baseline"], row["candidate"], row["check"]
    lines = [head, "| engine | project ms | plain ms | project / plain (paired rounds) | "
                   "outputs, project vs plain (rel. L2) |", "|---|---|---|---|---|"]
    for v in (b, c):
        lines.append(f"| {v} | {_ms(row['ms'][f'project {v}'])} | {_ms(row['ms'][f'plain {v}'])} | "
                     f"{_x(row['ratio'][v])} | {_rel(chk['project_vs_plain'][v])} |")
    lines.append(f"| x = {b} / {c} | {_x(row['x']['project'])} | {_x(row['x']['plain'])} | | |")
    apart, tol = chk["candidate_vs_baseline"], chk["tolerance_rel_l2"] or {}
    lines[-3] = lines[-3].rstrip(" |") + f" (tolerance {tol[b]:.2e}) |" if tol else lines[-3]
    lines[-2] = lines[-2].rstrip(" |") + f" (below {tol[c]:.2e}: FP8 against fp16) |" if tol else lines[-2]
    lw = chk["fp8_layers"]
    lines += ["", f"Outputs ({chk['output']}) {'agree' if chk['ok'] else 'DIFFER'}. FP8 layers one by one (the "
                  f"project layer's input into the plain layer): {lw['calls']} calls of {lw['layers']} layers, largest "
                  f"rel. L2 {_rel(lw['worst'])} (tolerance {lw['tolerance_rel_l2']:.1e})"
                  + (f", missing in plain: {', '.join(lw['missing_in_plain'][:3])}" if lw["missing_in_plain"] else "")
                  + f". fp16 rounding (project {b} "
                  f"against the fp32 graph module): {_rel(chk['fp16_rounding'])}; {c} against {b}: project "
                  f"{_rel(apart['project'])}, plain {_rel(apart['plain'])}. FP8 GEMMs per forward: project "
                  f"{row['fp8_gemm_calls_per_forward']['project']:g}, plain {row['fp8_gemm_calls_per_forward']['plain']:g}. "
                  f"FP8 layers: project {row['fp8_layers'][c]['project']}, plain {row['fp8_layers'][c]['plain']}. "
                  f"Timing: {row['timing']['rounds']} rounds of {row['timing']['calls_per_round']} calls. "
                  f"Seconds: {', '.join(f'{k} {v}' for k, v in row['seconds'].items())}."]
    if "profile" in row:
        lines.append(profile_table(row))
    return "\n".join(lines) + "\n"


def profile_table(row: dict[str, Any], top: int = 12) -> str:
    prof = row["profile"]
    names = list(prof)
    groups = list(dict.fromkeys(g for p in prof.values() for g in p["groups_ms"]))
    lines = ["", f"Kernel time per call, ms (count per call), {prof[names[0]]['profiled']}:", "",
             "| group | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for g in groups:
        cells = [f"{p['groups_ms'].get(g, 0):.4f} ({p.get('groups_count', {}).get(g, 0):g})" for p in prof.values()]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append("| total | " + " | ".join(f"{p['total_ms']:.4f}" for p in prof.values()) + " |")
    for name, p in prof.items():
        lines += ["", f"Top kernels, {name}:", "", "| ms | count | group | kernel |", "|---|---|---|---|"]
        lines += [f"| {k['ms']:.4f} | {k.get('count', 0):g} | {k['group']} | `{k['name'][:90]}` |"
                  for k in p["top_kernels"][:top]]
    return "\n".join(lines)


def summary_table(rows: list[dict[str, Any]]) -> str:
    lines = ["## torch backend against plain torch", "",
             "| family | model | setting | project fp16 ms | plain fp16 ms | ratio | project FP8 ms | plain FP8 ms | "
             "ratio | x project | x plain | outputs |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['family']} | {r['model']} | {_where(r)} | {r['status']} |" + " |" * 8)
            continue
        b, c = r["baseline"], r["candidate"]
        lines.append(f"| {r['family']} | {r['model']} | {_where(r)} | {_ms(r['ms'][f'project {b}'])} | "
                     f"{_ms(r['ms'][f'plain {b}'])} | {r['ratio'][b]['x']:.3f} | {_ms(r['ms'][f'project {c}'])} | "
                     f"{_ms(r['ms'][f'plain {c}'])} | {r['ratio'][c]['x']:.3f} | {r['x']['project']['x']:.3f} | "
                     f"{r['x']['plain']['x']:.3f} | {'ok' if r['check']['ok'] else 'DIFFER'} |")
    return "\n".join(lines) + "\n"


def timed_studies(run: config.Run) -> list[config.Study]:
    """The run's studies."""
    return list(run.studies.values())


def uncovered(run: config.Run) -> dict[str, str]:
    """Registered families the benchmark cannot cover on this run, and why."""
    studied = {s.family for s in timed_studies(run)}
    return {f: ("no study in the run config, so no setting, recipe or calibration to build engines from"
                if f not in studied else "no plain implementation (quantstudy/plain/)")
            for f in families.names() if f not in studied or f not in plain.names()}


def summarize(outputs: list[Path], planned: list[tuple[config.Study, str, str]], run: config.Run) -> dict[str, Any]:
    """Print the summary of the rows of several outputs (a setting in two of them: the row of the run
    that started later), the planned settings that none of them has, and the registered families
    none can cover; return {"rows", "missing", "uncovered"}."""
    runs = sorted(((path, artifacts.read_json(path, "torch_vs_plain")) for path in outputs),
                  key=lambda path_out: path_out[1]["provenance"]["started"])
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    source: dict[tuple[str, str, str], tuple[Path, dict[str, Any]]] = {}  # each row's output, for its provenance
    for path, out in runs:
        for row in out["rows"]:
            key = (row["model"], row["setting"], row.get("graph", "main"))
            rows[key], source[key] = row, (path, out["provenance"])
    missing = [f"{m}/{st}" for _, m, st in planned if (m, st) not in {key[:2] for key in rows}]
    not_covered = uncovered(run)
    found = list(rows.values())
    over = over_margin(found)
    print(summary_table(found))
    print(f"From {', '.join(map(str, outputs))}. Timed settings of the config in none of them: "
          f"{', '.join(missing) or 'none'}.")
    # Which call (and so which engines: the commit they were made at, and which GPU) each row comes from:
    # a row's ratios compare engines timed in one call, on one card.
    print("\n| row | from | started | workflow commit | device |\n|---|---|---|---|---|")
    for key, (path, prov) in source.items():
        commit = prov["workflow_commit"]  # "<sha>-dirty": the working tree had changes
        short = commit[:12] + ("-dirty" if commit.endswith("-dirty") else "")
        device = artifacts.gpu_name(prov["hardware"]) or "CPU"
        print(f"| {key[0]}/{_where(rows[key])} | {path.parent} | {prov['started']} | {short} | {device} |")
    print(f"\nWithin {MARGIN - 1:.0%} of plain torch or faster (project / plain at most {MARGIN} for both engines, "
          f"outputs agreeing): {len(found) - len(over)} of {len(found)} rows. Not: {', '.join(over) or 'none'}.")
    for family, why in not_covered.items():
        print(f"\nNot covered: {family}, a registered family: {why}.")
    return {"rows": found, "missing": missing, "uncovered": not_covered, "over_margin": over}


def over_margin(rows: list[dict[str, Any]]) -> list[str]:
    """The rows that fail the issue's bar: failed, outputs differing, or an engine slower than plain by
    more than MARGIN."""
    return [f"{r['model']}/{_where(r)}" for r in rows
            if r["status"] != "ok" or not r["check"]["ok"] or max(v["x"] for v in r["ratio"].values()) > MARGIN]


# --- the run -------------------------------------------------------------------------------------

def plan(run: config.Run, family_names: list[str] | None, patterns: list[str] | None
         ) -> list[tuple[config.Study, str, str]]:
    """(study, model, setting) of every timed setting the filters keep: in the order of the patterns
    that match it (the most important first, where a budget may not reach the last), then as the run
    config declares them (its studies, their models, their settings)."""
    rows = [(s, m, st) for s in timed_studies(run) if family_names is None or s.family in family_names
            for m, st in s.model_settings(timed_only=True)]
    if patterns is None:
        return rows
    ranked = [(next((i for i, p in enumerate(patterns) if fnmatch.fnmatchcase(f"{m}/{st}", p)), None), (s, m, st))
              for s, m, st in rows]
    return [row for rank, row in sorted((r for r in ranked if r[0] is not None), key=lambda r: r[0])]


def torch_target(run: config.Run) -> config.Target:
    """The run's (first) torch target: where its engines are built, timed and compared."""
    target = next((t for t in run.targets.values() if t.backend == "torch"), None)
    if target is None:
        raise SystemExit(f"the run {run.name} has no torch target")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if not config.on_its_card(target, gpu):  # its builds would stop (steps.WrongCard): say so before them
        raise SystemExit(f"target {target.name} declares gpu {target.gpu}, but this host has {gpu or 'no GPU'}; on a "
                         "CPU use --tiny, on another card add its config layer (--config config/h200.yaml "
                         "config/realsize/calls/h100.yaml)")
    return target


def run_config(args: argparse.Namespace) -> list[Path]:
    """The run config and the layers over it (a default is the workdir's own)."""
    return args.config or [args.workdir / ("config/config.yaml" if args.tiny else "config/h200.yaml")]


def load_run(files: list[Path]) -> config.Run:
    """The run of config files layered as Snakemake layers its --configfile arguments."""
    from snakemake.utils import update_config

    doc: dict[str, Any] = {}
    for f in files:
        update_config(doc, yaml.safe_load(f.read_text()))
    return config.load_run(doc)


def write(out: Path | None, doc: dict[str, Any], started: str, params: dict[str, Any]) -> None:
    if out:
        artifacts.write_json(out, "torch_vs_plain", {**doc, "provenance": artifacts.provenance(
            "benchmarks/torch_vs_plain.py", {}, params, started)})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="config/config.yaml's tiny models (CPU checks)")
    parser.add_argument("--config", type=Path, nargs="+", help="run config, then any layers over it, as the workflow's "
                        "--configfile takes them (default: config/h200.yaml, --tiny config/config.yaml)")
    parser.add_argument("--families", nargs="+", help="families to run (default: every one with a plain model)")
    parser.add_argument("--settings", nargs="+", help="model/setting patterns, e.g. '*-base/w128' '*/b1'; the first "
                        "pattern's settings run first")
    parser.add_argument("--profile", action="store_true", help="kernel profiles of every engine")
    parser.add_argument("--profile-calls", type=int, default=5)
    parser.add_argument("--budget-s", type=float,
                        help="start no setting after this many seconds less the longest setting's time so far")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--calls", type=int, help="calls per round")
    parser.add_argument("--workdir", type=Path, default=ROOT,
                        help="the checkout the workflow runs in (its results/ holds the engines)")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="the workflow's --cores")
    parser.add_argument("--work", type=Path, help="this benchmark's own files (compile workers' logs; default: "
                                                  "results/torch-vs-plain of --workdir)")
    parser.add_argument("--out", type=Path, help="write the rows as a torch_vs_plain JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="the steps' own log lines")
    parser.add_argument("--compile-workers", action="store_true",
                        help="compile a setting's four engines at once, a process each, before opening them here "
                             "from inductor's caches (on a GPU node with the cores for it)")
    parser.add_argument("--open-only", metavar="ENGINE", help="a compile worker: open this engine ('plain fp16') "
                        "of the one setting, whose builds the workflow has made, and stop")
    parser.add_argument("--summary", nargs="+", type=Path, metavar="JSON",
                        help="run nothing: the summary of these outputs' rows (runs of several device calls), and "
                             "which timed settings of the config none of them has")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    started, t0 = artifacts.now(), time.perf_counter()
    # The workflow's paths (build.json, engines) are relative to its checkout: work from there.
    args.workdir = args.workdir.resolve()
    args.config = [p.resolve() for p in args.config] if args.config else None
    args.out = args.out.resolve() if args.out else None
    args.work = (args.work or args.workdir / "results" / "torch-vs-plain").resolve()
    steps.job_settings()  # as the workflow's jobs run (TF32 off: fp32 stays fp32)
    cfgs = run_config(args)
    run = load_run(cfgs)
    if args.summary:
        return summarize(args.summary, plan(run, args.families or list(plain.names()), args.settings), run)
    with contextlib.chdir(args.workdir):
        return _run(args, run, cfgs, started, t0)


def _run(args: argparse.Namespace, run: config.Run, cfgs: list[Path], started: str, t0: float) -> dict[str, Any]:
    """The planned settings, measured in the workdir: the workflow's builds, then a row per graph."""
    family_names = args.families or [f for f in plain.names() if any(s.family == f for s in timed_studies(run))]
    unknown = sorted(set(family_names) - set(plain.names()))
    if unknown:
        raise SystemExit(f"no plain implementation of {', '.join(unknown)}; there are {', '.join(plain.names())}")
    target = torch_target(run)
    todo = plan(run, family_names, args.settings)
    if not todo:
        raise SystemExit(f"no timed setting of {' + '.join(map(str, cfgs))} matches families {family_names} and settings {args.settings}")
    # Dynamo keeps compiled variants per code object; past the limit it would run a module eagerly,
    # unannounced. A setting compiles four modules (the caches are reset between settings).
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    params = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    doc: dict[str, Any] = {"run": run.name, "weights": run.weights, "config": [str(p) for p in cfgs],
                           "target": {"target": target.name, **{k: v for k, v in vars(target).items() if k != "name"}},
                           "rows": [], "not_run": []}
    if args.open_only:
        if len(todo) != 1:
            raise SystemExit(f"--open-only opens an engine of one setting; --settings match {len(todo)}")
        from torch._inductor import config as inductor_config

        # The parent times kernel configs again, alone on the GPU: not what workers timed beside each other.
        inductor_config.autotune_local_cache = False
        measure(*todo[0], target, args)
        return doc
    if args.budget_s is None or args.budget_s > 0:  # a spent budget starts nothing, the builds included
        workflow_builds(todo, target, cfgs, args.cores)
    _say(f"{len(todo)} settings on {target.name} ({target.device}, compile {target.compile}): "
         + ", ".join(f"{m}/{st}" for _, m, st in todo))
    longest = 0.0  # the longest setting so far: what the next one is expected to take
    for i, (study, model, setting) in enumerate(todo):
        elapsed = time.perf_counter() - t0
        if args.budget_s is not None and elapsed + longest > args.budget_s:
            doc["not_run"] = [{"model": m, "setting": st, "why": f"budget: {elapsed:.0f} s gone of {args.budget_s:g}, "
                                                                  f"the longest setting took {longest:.0f} s"}
                              for _, m, st in todo[i:]]
            _say(f"budget: stopping before {model}/{setting}")
            break
        row_started = time.perf_counter()
        try:
            rows = measure(study, model, setting, target, args)
        except Exception:
            rows = [{"study": study.name, "family": study.family, "model": model, "setting": setting,
                     "batch": study.setting(setting).batch, "shape": dict(study.setting(setting).shape),
                     "status": "failed", "error": traceback.format_exc()}]
            _say(f"{model}/{setting} failed:\n{rows[0]['error']}")
        _free(target.device)
        wall = round(time.perf_counter() - row_started, 2)
        longest = max(longest, wall)
        for row in rows:
            row["wall_s"] = wall  # the setting's, all its graphs
            doc["rows"].append(row)
            print(row_table(row), flush=True)
        write(args.out, doc, started, params)  # after every setting: a run cut short keeps what it measured
    doc["wall_s"] = round(time.perf_counter() - t0, 2)
    print(summary_table(doc["rows"]), flush=True)
    for r in doc["not_run"]:
        print(f"not run: {r['model']}/{r['setting']} ({r['why']})")
    write(args.out, doc, started, params)
    return doc


def cli() -> None:
    """The command: exit status 1 where a setting failed or its outputs differ."""
    result = main()
    sys.exit(0 if all(r["status"] == "ok" and r["check"]["ok"] for r in result["rows"]) else 1)


if __name__ == "__main__":
    cli()
