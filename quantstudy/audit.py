"""Audit a rendered study: every number back to its artifacts and pinned inputs.

The chain: the README is exactly what the templates render from tables.json; tables.json
names each JSON it read with its sha256; each of those names its own inputs the same way,
down to checkpoint.json, whose file hashes are checked against the snapshot on disk.

From a shell (each exits non-zero when it finds a problem):

    python -m quantstudy.audit check results/fnet                   # the README and its whole chain
    python -m quantstudy.audit chain results/fnet/README.md 1.08    # where a rendered number came from
    python -m quantstudy.audit chain results/fnet/cpu-torch/fnet-base/w512/fp8/timing.json
    python -m quantstudy.audit reproduce results/fnet              # rerun a seeded sample of its measurements

This module walks the chain and reports it (the audit rule's `audit`, and the command above); the
checks it makes of the chain's files are in quantstudy.audit_checks, and how a README number is
found among the cells of tables.json in quantstudy.audit_number.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from quantstudy import artifacts, paths
from quantstudy.artifacts import DamagedArtifact, now, provenance, read_json, sha256_file, sha256_path, write_json
from quantstudy.audit_checks import (arguments_problems, card_problems, one_engine_problems, rederived_problems,
                                     redone_problems, redrawn_problems, timing_problems)
from quantstudy.audit_number import find_number, shown_hits

log = logging.getLogger("quantstudy")


def walk(root: str | Path, recorded: str | None = None, reader: str | None = None) -> list[dict[str, Any]]:
    """Every artifact behind `root`, depth first down to the pinned checkpoints and data: a step per
    reference to a file, {depth, path, parent, role, problem}, and for a JSON (its first reference)
    {rule, started, finished, commit, software, hardware, pinned, doc}. A step's problem is what is
    wrong with the file as its reader recorded it: missing, changed since, damaged, or (a checkpoint)
    a snapshot file that differs from its recorded sha256. `recorded`: the root's sha256 as the file that
    read it (`reader`, e.g. tables.json) recorded it, compared like every other file's."""
    steps: list[dict[str, Any]] = []
    digests: dict[str, str] = {}  # one sha256 per file: a checkpoint is read by every job
    expanded: set[str] = set()

    def digest(p: str) -> str:
        if p not in digests:
            digests[p] = sha256_path(p)
        return digests[p]

    def visit(p: str, depth: int, recorded: str | None, parent: str | None, role: str | None) -> None:
        step: dict[str, Any] = {"depth": depth, "path": p, "parent": parent, "role": role}
        steps.append(step)
        if not Path(p).exists():
            step["problem"] = "is missing"
            return
        if recorded:
            step["sha256"] = {"recorded": recorded, "now": digest(p), "matches": digest(p) == recorded}
            if digest(p) != recorded:
                step["problem"] = "changed since the job that read it recorded its sha256"
        if not p.endswith(".json") or p in expanded:
            return
        expanded.add(p)
        try:
            doc = read_json(p)
        except DamagedArtifact as e:
            step["problem"] = e.problem
            return
        prov = doc.get("provenance", {})
        step.update(doc=doc, rule=prov.get("rule"), started=prov.get("started"), finished=prov.get("finished"),
                    commit=prov.get("workflow_commit"), software=prov.get("software", {}),
                    hardware=prov.get("hardware", {}))
        if doc.get("repo") and doc.get("revision"):
            step["pinned"] = f"{doc['repo']} at {doc['revision']}"
        if doc.get("schema") in ("checkpoint", "samples") and "snapshot" in doc:  # a pinned snapshot's files
            snapshot = Path(doc["snapshot"])
            for rel, want in doc["files"].items():
                if not (snapshot / rel).exists() or sha256_file(snapshot / rel) != want:
                    step["problem"] = f"has snapshot file {rel} missing or differing from its recorded sha256"
            # The HF cache names a snapshot by its commit: a pinned (full-hash) revision is that name.
            if len(doc["revision"]) == 40 and snapshot.name != doc["revision"]:
                step["problem"] = f"says revision {doc['revision']}, but its snapshot is commit {snapshot.name}"
        if doc.get("schema") == "build" and doc.get("status") == "ok":
            for g, e in doc["graphs"].items():
                visit(e["engine"], depth + 1, e["engine_sha256"], p, f"engine of graph {g}")
                if "compiled" in e:
                    visit(e["compiled"], depth + 1, e["compiled_sha256"], p, f"compiled program of graph {g}")
        for name, entry in prov.get("inputs", {}).items():
            visit(entry["path"], depth + 1, entry["sha256"], p, f"input {name}")

    visit(str(root), 0, recorded, reader, None)
    return steps


def problem_text(step: dict[str, Any]) -> str:
    """A broken step as one sentence that names the file, who read it and what is wrong."""
    if step["parent"] is None:
        return f"{step['path']}: {step['problem']}"
    return f"{step['parent']}: {step['role']} ({step['path']}) {step['problem']}"


def check_chain(tables_json: str | Path) -> dict[str, Any]:
    """The whole chain behind tables.json (walk): every missing, changed or damaged file, and TEST01:
    the engine that was timed is the one that was evaluated, and it gave both jobs of a setting the same probe."""
    steps = walk(tables_json)
    problems = [problem_text(s) for s in steps if s.get("problem")]
    # The root of the chain: every checkpoint and sample list was fetched at the revision the study pins.
    tables = steps[0].get("doc") or read_json(tables_json, "tables")  # the walk read it first
    spec = tables["spec"]
    pins = {m["checkpoint"]["repo"]: m["checkpoint"]["revision"] for m in spec["models"].values()}
    pins |= {d["repo"]: d["revision"] for d in spec["datasets"].values()}
    for s in steps:
        doc = s.get("doc") or {}
        if doc.get("schema") in ("checkpoint", "samples") and pins.get(doc["repo"], doc["revision"]) != doc["revision"]:
            problems.append(f"{s['path']}: fetched {doc['repo']} at {doc['revision']}, but the study pins "
                            f"{pins[doc['repo']]}")
    # build.json -> {rule: [(artifact, its doc)]}: a variant timed in several jobs (repeats) has several timings
    measured: dict[str, dict[str, list[tuple[str, dict]]]] = {}
    for s in steps:
        doc = s.get("doc") or {}
        if doc.get("engine_sha256") and "build" in doc.get("provenance", {}).get("inputs", {}):
            measured.setdefault(doc["provenance"]["inputs"]["build"]["path"], {}).setdefault(
                doc["provenance"]["rule"], []).append((s["path"], doc))
    for build, jobs in measured.items():
        problems += one_engine_problems(build, jobs.get("time", []), jobs.get("evaluate", []))
    # Derived numbers, made again: x and ms from the round samples, the tables from their files, the
    # sample lists from their datasets. The walk keeps each JSON's doc on its first step only.
    read = [(s["path"], s["doc"]) for s in steps if s.get("doc")]
    for path, doc in read:
        if doc.get("schema") == "timing":
            problems += timing_problems(path, doc)
        problems += redone_problems(path, doc) + card_problems(path, doc)
    if not problems:  # aggregate reads every input: with one damaged, the chain's problems say which
        problems += rederived_problems(tables_json, tables)
    for path, doc in read:
        if doc.get("schema") == "samples":
            problems += redrawn_problems(path, doc, tables["family"])
    return {"files_checked": len({s["path"] for s in steps}), "problems": problems}


def findings(tables_json: str | Path, readme: str | Path, arguments: dict[str, Any],
             where: str = "the run config") -> tuple[bool, dict[str, Any]]:
    """Whether the README is what the templates render from tables.json, and the chain's report
    (check_chain) with that, the arguments tables.json was made with against the config's
    (`arguments`, from `where`), and every input aggregate could not read, among its problems."""
    from quantstudy import render

    tables = read_json(tables_json, "tables")
    readme_matches = render.render_section(tables, readme) == Path(readme).read_text()
    chain = check_chain(tables_json)
    chain["problems"] = arguments_problems(tables_json, tables, arguments, where) + chain["problems"]
    if not readme_matches:
        chain["problems"].insert(0, f"{readme} is not what the templates render from {tables_json}")
    chain["problems"] += [f"an input could not be read: {d['error']}" for d in tables.get("damaged", [])]
    return readme_matches, chain


def audit(tables_json: str, readme: str, arguments: dict[str, Any], out: str) -> None:
    started = now()
    readme_matches, chain = findings(tables_json, readme, arguments)
    for p in chain["problems"]:
        log.warning(p)
    log.info("audited %d files: %d problems", chain["files_checked"], len(chain["problems"]))
    write_json(out, "audit", {"ok": not chain["problems"], "readme_matches_tables": readme_matches, **chain,
                              "provenance": provenance("audit", {"tables": tables_json, "readme": readme}, {}, started)})
    if chain["problems"]:  # the run fails; the problems are in the log (Snakemake removes a failed job's output)
        raise AuditFailed(f"the audit of {readme} found {len(chain['problems'])} problems; the first: "
                          f"{chain['problems'][0]}")


class AuditFailed(RuntimeError):
    """A rendered README that cannot be traced to intact artifacts."""


def _describe(step: dict[str, Any]) -> str:
    pad = "  " * step["depth"]
    line = f"{pad}{step['path']}"
    if step.get("rule"):
        hw = step["hardware"]
        cpu = (hw.get("cpu_model"), hw.get("cpu_isa"), f"{hw.get('cpus')} cores", f"{hw.get('host')}")
        gpu = artifacts.gpu_name(hw) or f"CPU ({', '.join(v for v in cpu if v)})"
        soft = ", ".join(f"{k} {v}" for k, v in step["software"].items() if k in ("torch", "transformers", "onnxruntime",
                                                                                  "tensorrt", "nvidia-modelopt"))
        line += (f"\n{pad}  rule {step['rule']}, {step['started']} to {step['finished']}, commit {step['commit']}"
                 f"\n{pad}  on {gpu}; {soft}")
    sha = step.get("sha256")
    if sha and sha["matches"]:
        line += f"\n{pad}  sha256 {sha['now'][:12]}: matches what {step['parent']} recorded"
    elif sha:
        line += f"\n{pad}  sha256 {sha['now'][:12]}: DIFFERS from what {step['parent']} recorded ({sha['recorded'][:12]})"
    elif step["depth"] == 0:
        line += "\n  (the file asked about: no file read here records its sha256)"
    elif step.get("problem") == "is missing":
        line += f"\n{pad}  missing: its sha256 cannot be compared with what {step['parent']} recorded"
    if step.get("pinned"):
        line += f"\n{pad}  pinned: {step['pinned']}"
    if step.get("problem"):
        line += f"\n{pad}  BROKEN: {problem_text(step)}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantstudy.audit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="a study's README and everything behind it")
    check.add_argument("study_dir", help="results/<study>")
    check.add_argument("--configfile", default="config/config.yaml", help="the run config the study ran with")
    one = sub.add_parser("chain", help="the chain of one number (a README and the number as shown) or one JSON")
    one.add_argument("source", help="results/<study>/README.md, or any artifact JSON")
    one.add_argument("number", nargs="?", help="the number as the README shows it (with the README)")
    again = sub.add_parser("reproduce", help="re-execute a seeded sample of a study's measurement jobs and compare")
    again.add_argument("study_dir", help="results/<study>")
    again.add_argument("--configfile", default="config/config.yaml", help="the run config the study ran with")
    again.add_argument("--evaluate", type=int, default=3, help="evaluate jobs in the sample")
    again.add_argument("--time", type=int, default=1, help="time jobs in the sample")
    again.add_argument("--seed", type=int, default=0)
    again.add_argument("--jobs", nargs="+", help="these measurement JSONs instead of a sample")
    again.add_argument("--scratch", help="where to re-execute (default: a new temporary directory)")
    again.add_argument("--out", help="the report (default: <scratch>/reproduce.json)")
    args = parser.parse_args(argv)
    if args.command == "reproduce":
        from quantstudy import reproduce

        jobs = args.jobs or reproduce.choose(Path(args.study_dir), args.evaluate, args.time, args.seed)
        report = reproduce.reproduce(args.study_dir, args.configfile, jobs, args.scratch, out=args.out)
        print(reproduce.summary(report))
        return 0 if report["ok"] else 1
    if args.command == "check":
        from quantstudy import config

        study = Path(args.study_dir)
        try:
            run = config.run_of_study(args.configfile, study.name)
        except config.ConfigError as e:
            print(e, file=sys.stderr)
            return 1
        problems = findings(paths.in_folder(study, paths.TABLES), paths.in_folder(study, paths.README), run.aggregate_arguments(study.name),
                            args.configfile)[1]["problems"]
        print("\n".join(problems) if problems else f"{study}: the README and every file behind it check out")
        return 1 if problems else 0
    if args.number is None:
        steps = walk(args.source)
    else:
        tables_json = paths.beside(args.source, paths.TABLES)
        if args.number not in Path(args.source).read_text():
            print(f"{args.source} does not show {args.number!r}", file=sys.stderr)
            return 1
        tables = read_json(tables_json, "tables")
        matching = find_number(tables, args.number)
        hits = shown_hits(tables, args.source, args.number, matching)
        if not hits:
            print(f"{args.number!r} is in {args.source}, but no cell of {tables_json} that the page shows is "
                  f"{args.number!r}" + (f" ({len(matching)} cells format so, none of them shown there)" if matching else "")
                  + ": the template computed it from several cells; look it up by one of those rows' JSON", file=sys.stderr)
            return 1
        steps = []
        for h in hits:
            print(f"{h['table']} table, row {h['row']}, column {h['column']} = {h['value']!r}, from "
                  f"{h['source'] or tables_json}")
            if h["arithmetic"]:
                print(f"  {h['arithmetic']}")
        if len(matching) > len(hits):
            print(f"({len(matching) - len(hits)} other cells of {tables_json} format as {args.number!r}; the page shows "
                  "none of them)")
        read_by_tables = {e["path"]: e["sha256"] for e in tables["provenance"]["inputs"].values()}
        for source in dict.fromkeys(s for h in hits for s in ([h["source"], *h.get("also_from", [])] if h["source"]
                                                              else h.get("sources_of", []))):
            steps += walk(source, read_by_tables.get(source), str(tables_json) if source in read_by_tables else None)
    print("\n".join(_describe(s) for s in steps))
    broken = [s for s in steps if s.get("problem")]
    if broken:
        print(f"first broken link: {problem_text(broken[0])}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
