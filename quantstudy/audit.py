"""Audit a rendered study: every number back to its artifacts and pinned inputs.

The chain: the README is exactly what the templates render from tables.json; tables.json
names each JSON it read with its sha256; each of those names its own inputs the same way,
down to checkpoint.json, whose file hashes are checked against the snapshot on disk.

From a shell (each exits non-zero when it finds a problem):

    python -m quantstudy.audit check results/fnet                   # the README and its whole chain
    python -m quantstudy.audit chain results/fnet/README.md 1.08    # where a rendered number came from
    python -m quantstudy.audit chain results/fnet/cpu-torch/fnet-base/w512/fp8/timing.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from quantstudy.artifacts import DamagedArtifact, now, provenance, read_json, sha256_file, sha256_path, write_json

log = logging.getLogger("quantstudy")


def check_chain(tables_json: str | Path) -> dict[str, Any]:
    """Follow provenance inputs from tables.json; report every missing or changed file."""
    problems: list[str] = []
    seen: set[str] = set()
    measured: dict[str, dict[str, tuple[str, dict]]] = {}  # build.json -> {rule: (artifact, engine digests)}
    todo = [str(tables_json)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if not path.endswith(".json"):
            continue
        try:
            doc = read_json(path)
        except DamagedArtifact as e:
            problems.append(str(e))
            continue
        for name, entry in doc.get("provenance", {}).get("inputs", {}).items():
            p = Path(entry["path"])
            if not p.exists():
                problems.append(f"{path}: input {name} ({p}) is missing")
            elif sha256_path(p) != entry["sha256"]:
                problems.append(f"{path}: input {name} ({p}) changed since it was read")
            else:
                todo.append(str(p))
        if doc.get("schema") == "build" and doc.get("status") == "ok":
            for g, e in doc["graphs"].items():
                if not Path(e["engine"]).exists() or sha256_file(e["engine"]) != e["engine_sha256"]:
                    problems.append(f"{path}: engine {e['engine']} (graph {g}) is missing or not the file it built")
        if doc.get("engine_sha256") and "build" in doc.get("provenance", {}).get("inputs", {}):
            build = doc["provenance"]["inputs"]["build"]["path"]
            measured.setdefault(build, {})[doc["provenance"]["rule"]] = (path, doc["engine_sha256"])
        if doc.get("schema") == "checkpoint":
            snapshot = Path(doc["snapshot"])
            for rel, digest in doc["files"].items():
                f = snapshot / rel
                if not f.exists() or sha256_file(f) != digest:
                    problems.append(f"{path}: checkpoint file {rel} is missing or differs from its recorded sha256")
    # TEST01: the engine that was timed is the engine that was evaluated.
    for build, jobs in measured.items():
        if "time" in jobs and "evaluate" in jobs and jobs["time"][1] != jobs["evaluate"][1]:
            problems.append(f"{jobs['time'][0]} and {jobs['evaluate'][0]} measured different engines of {build}")
    return {"files_checked": len(seen), "problems": problems}


def findings(tables_json: str | Path, readme: str | Path) -> tuple[bool, dict[str, Any]]:
    """Whether the README is what the templates render from tables.json, and the chain's report
    (check_chain) with that, and every input aggregate could not read, among its problems."""
    from quantstudy import render

    tables = read_json(tables_json, "tables")
    readme_matches = render.render_section(tables) == Path(readme).read_text()
    chain = check_chain(tables_json)
    if not readme_matches:
        chain["problems"].insert(0, f"{readme} is not what the templates render from {tables_json}")
    chain["problems"] += [f"an input could not be read: {d['error']}" for d in tables.get("damaged", [])]
    return readme_matches, chain


def audit(tables_json: str, readme: str, out: str) -> None:
    started = now()
    readme_matches, chain = findings(tables_json, readme)
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


# --- one number's chain ---------------------------------------------------------------------

TABLES = ("speed", "quality", "builds", "records", "kernels", "references", "calibration", "samples")


def find_number(tables: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """The table cells of tables.json that the README shows as `text`, in any of the number formats
    the templates use: {table, row label, column, value, source}."""
    from quantstudy import render

    formats = (render.ms, render.times, render.pct, render.sci, render.num, render.count,
               lambda v: render.num(v, 2), lambda v: render.num(v, 5), lambda v: f"{v:.1f}")
    want = text.strip().rstrip("x%").replace(",", "") if not text.strip().endswith("%") else text.strip()
    hits = []
    for table in TABLES:
        for row in tables.get(table) or []:
            for column, value in row.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                shown = set()
                for f in formats:
                    try:
                        shown.add(f(value).replace(",", ""))
                    except (TypeError, ValueError):
                        pass
                if want in shown:
                    label = ", ".join(str(row[k]) for k in ("target", "model", "setting", "variant", "graph") if row.get(k))
                    hits.append({"table": table, "row": label, "column": column, "value": value,
                                 "source": row.get("source")})
    return hits


def chain(path: str | Path) -> list[dict[str, Any]]:
    """Every artifact behind `path`, depth first from it down to the pinned checkpoint and data:
    {depth, path, rule, ok, problem, started, finished, software, hardware, commit, pinned}."""
    steps, seen = [], set()

    def visit(p: str, depth: int, recorded: str | None) -> None:
        step: dict[str, Any] = {"depth": depth, "path": p}
        steps.append(step)
        if not Path(p).exists():
            step["problem"] = "missing"
            return
        if recorded and sha256_path(p) != recorded:
            step["problem"] = "changed since the job that read it recorded its sha256"
        if not p.endswith(".json") or p in seen:
            return
        seen.add(p)
        try:
            doc = read_json(p)
        except DamagedArtifact as e:
            step["problem"] = e.problem
            return
        prov = doc.get("provenance", {})
        step.update(rule=prov.get("rule"), started=prov.get("started"), finished=prov.get("finished"),
                    commit=prov.get("workflow_commit"), software=prov.get("software", {}),
                    hardware=prov.get("hardware", {}))
        if doc.get("repo") and doc.get("revision"):
            step["pinned"] = f"{doc['repo']} at {doc['revision']}"
        if doc.get("schema") == "build" and doc.get("status") == "ok":
            for e in doc["graphs"].values():
                visit(e["engine"], depth + 1, e["engine_sha256"])
        for entry in prov.get("inputs", {}).values():
            visit(entry["path"], depth + 1, entry["sha256"])

    visit(str(path), 0, None)
    return steps


def _describe(step: dict[str, Any]) -> str:
    pad = "  " * step["depth"]
    line = f"{pad}{step['path']}"
    if step.get("rule"):
        hw = step["hardware"]
        gpu = hw.get("gpu_system", {}).get("name") or hw.get("gpu") or f"CPU ({hw.get('cpus')} cores, {hw.get('host')})"
        soft = ", ".join(f"{k} {v}" for k, v in step["software"].items() if k in ("torch", "transformers", "onnxruntime",
                                                                                  "tensorrt", "nvidia-modelopt"))
        line += (f"\n{pad}  rule {step['rule']}, {step['started']} to {step['finished']}, commit {step['commit']}"
                 f"\n{pad}  on {gpu}; {soft}")
    if step.get("pinned"):
        line += f"\n{pad}  pinned: {step['pinned']}"
    if step.get("problem"):
        line += f"\n{pad}  BROKEN: {step['problem']}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantstudy.audit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="a study's README and everything behind it")
    check.add_argument("study_dir", help="results/<study>")
    one = sub.add_parser("chain", help="the chain of one number (a README and the number as shown) or one JSON")
    one.add_argument("source", help="results/<study>/README.md, or any artifact JSON")
    one.add_argument("number", nargs="?", help="the number as the README shows it (with the README)")
    args = parser.parse_args(argv)
    if args.command == "check":
        study = Path(args.study_dir)
        problems = findings(study / "tables.json", study / "README.md")[1]["problems"]
        print("\n".join(problems) if problems else f"{study}: the README and every file behind it check out")
        return 1 if problems else 0
    if args.number is None:
        steps = chain(args.source)
    else:
        tables_json = Path(args.source).parent / "tables.json"
        if args.number not in Path(args.source).read_text():
            print(f"{args.source} does not show {args.number!r}", file=sys.stderr)
            return 1
        hits = find_number(read_json(tables_json, "tables"), args.number)
        if not hits:
            print(f"{args.number!r} is in {args.source} but in no table of {tables_json}: it is computed by the "
                  "template from several rows (a range or a ratio); look it up by one of those rows' JSON", file=sys.stderr)
            return 1
        steps = []
        for h in hits:
            print(f"{h['table']} table, row {h['row']}, column {h['column']} = {h['value']!r}, from {h['source']}")
        for source in dict.fromkeys(h["source"] for h in hits if h["source"]):
            steps += chain(source)
    print("\n".join(_describe(s) for s in steps))
    broken = [s for s in steps if s.get("problem")]
    if broken:
        print(f"first broken link: {broken[0]['path']}: {broken[0]['problem']}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
