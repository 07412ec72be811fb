"""The torch backend's engines against plain torch implementations of the same math, in one process
(its command: benchmarks/torch_vs_plain.py, or `python -m quantstudy.torch_vs_plain`).

For each timed model and setting of a run config, the project's baseline and candidate engines are
the workflow's: `workflow_builds` runs `snakemake --configfile RUN.yaml <their build.json>` in the
checkout (local hub, checkpoints, samples, calibration and builds, cached as in any run), and
`measure` opens each build as a measurement job does (steps_engines.open_engines: the backend contract, from
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

This module is the command: the plan, the run over its settings, and the summary of several runs.
One setting (builds, engines, the output checks, timing, profiles) is quantstudy.torch_vs_plain_measure;
the markdown tables and the margin are quantstudy.torch_vs_plain_report.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

import torch

from quantstudy import artifacts, config, families, plain, steps
from quantstudy.torch_vs_plain_measure import free, measure, run_config, say, workflow_builds
from quantstudy.torch_vs_plain_report import MARGIN, over_margin, row_table, setting_and_graph, summary_table

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("torch_vs_plain")


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
        print(f"| {key[0]}/{setting_and_graph(rows[key])} | {path.parent} | {prov['started']} | {short} | {device} |")
    print(f"\nWithin {MARGIN - 1:.0%} of plain torch or faster (project / plain at most {MARGIN} for both engines, "
          f"outputs agreeing): {len(found) - len(over)} of {len(found)} rows. Not: {', '.join(over) or 'none'}.")
    for family, why in not_covered.items():
        print(f"\nNot covered: {family}, a registered family: {why}.")
    return {"rows": found, "missing": missing, "uncovered": not_covered, "over_margin": over}


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
    say(f"{len(todo)} settings on {target.name} ({target.device}, compile {target.compile}): "
         + ", ".join(f"{m}/{st}" for _, m, st in todo))
    longest = 0.0  # the longest setting so far: what the next one is expected to take
    for i, (study, model, setting) in enumerate(todo):
        elapsed = time.perf_counter() - t0
        if args.budget_s is not None and elapsed + longest > args.budget_s:
            doc["not_run"] = [{"model": m, "setting": st, "why": f"budget: {elapsed:.0f} s gone of {args.budget_s:g}, "
                                                                  f"the longest setting took {longest:.0f} s"}
                              for _, m, st in todo[i:]]
            say(f"budget: stopping before {model}/{setting}")
            break
        row_started = time.perf_counter()
        try:
            rows = measure(study, model, setting, target, args)
        except Exception:
            rows = [{"study": study.name, "family": study.family, "model": model, "setting": setting,
                     "batch": study.setting(setting).batch, "shape": dict(study.setting(setting).shape),
                     "status": "failed", "error": traceback.format_exc()}]
            say(f"{model}/{setting} failed:\n{rows[0]['error']}")
        free(target.device)
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
