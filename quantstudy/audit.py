"""Audit a rendered study: every number back to its artifacts and pinned inputs.

The chain: the README is exactly what the templates render from tables.json; tables.json
names each JSON it read with its sha256; each of those names its own inputs the same way,
down to checkpoint.json, whose file hashes are checked against the snapshot on disk.

From a shell (each exits non-zero when it finds a problem):

    python -m quantstudy.audit check results/fnet                   # the README and its whole chain
    python -m quantstudy.audit chain results/fnet/README.md 1.08    # where a rendered number came from
    python -m quantstudy.audit chain results/fnet/cpu-torch/fnet-base/w512/fp8/timing.json
    python -m quantstudy.audit reproduce results/fnet              # rerun a seeded sample of its measurements
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from quantstudy import artifacts, paths
from quantstudy.artifacts import DIGEST, DamagedArtifact, now, provenance, read_json, sha256_file, sha256_path, write_json

log = logging.getLogger("quantstudy")


# TEST01's probe: the timing job's and the evaluation job's answers on the seeded example inputs
# agree to this share of the probe's largest magnitude (one engine, one machine kind: equal in
# practice; the margin covers a GEMM algorithm chosen differently on another GPU of the model).
PROBE_TOLERANCE = 1e-3


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


def probes_differ(a: dict[str, Any], b: dict[str, Any], tolerance: float = PROBE_TOLERANCE) -> str | None:
    """Where two jobs' probes (steps._probe) of one engine disagree, or None."""
    for g in sorted(set(a) | set(b)):
        for name in sorted(set(a.get(g, {})) | set(b.get(g, {}))):
            x, y = a.get(g, {}).get(name), b.get(g, {}).get(name)
            if x is None or y is None:
                return f"output {name} of graph {g} is in one probe only"
            if x["shape"] != y["shape"] or x["nonfinite"] != y["nonfinite"]:
                return f"output {name} of graph {g}: shape or non-finite count differs"
            scale = max((abs(v) for v in x["values"] + y["values"] if v is not None), default=0.0)
            for u, v in zip(x["values"], y["values"]):
                if (u is None) != (v is None) or (u is not None and abs(u - v) > tolerance * scale):
                    return (f"output {name} of graph {g}: {u!r} against {v!r}, beyond {tolerance:g} of the "
                            f"probe's largest value {scale:.4g}")
    return None


def one_engine_problems(build: str, timings: list[tuple[str, dict]], evaluations: list[tuple[str, dict]]) -> list[str]:
    """TEST01 for one build: every timing job (path, doc) and every evaluation job measured its engine
    file and compiled program, and the jobs of one setting got the same probe from it. A probe runs its
    job's setting's inputs, so jobs of two settings one engine serves (`engine:`) are not compared so."""
    problems = []
    for (timing, t), (quality, q) in ((t, q) for t in timings for q in evaluations):
        if t["engine_sha256"] != q["engine_sha256"]:
            problems.append(f"{timing} and {quality} measured different engines of {build}")
        elif t.get("compiled_sha256") != q.get("compiled_sha256"):
            problems.append(f"{timing} and {quality} opened different compiled programs of {build}")
        elif t["setting"] == q["setting"] and "probe" in t and "probe" in q and (
                why := probes_differ(t["probe"], q["probe"])):
            problems.append(f"{timing} and {quality} got different answers from the engine of {build}: {why}")
    return problems


def timing_problems(path: str, doc: dict[str, Any]) -> list[str]:
    """A timing file's ms and x made again from its round samples (timing.summarize, timing.speedup):
    every recorded value that is not what its own samples give."""
    from quantstudy import timing

    problems = []
    for g, graph in (doc.get("graphs") or {}).items():
        base, var = graph["baseline_ms"]["samples_ms"], graph["variant_ms"]["samples_ms"]
        again = {"variant_ms": timing.summarize(var), "baseline_ms": timing.summarize(base), **timing.speedup(base, var)}
        for key, value in again.items():
            recorded = graph.get(key)
            if isinstance(value, dict) and isinstance(recorded, dict):  # a summary; calls_per_round is no sample's
                recorded = {k: recorded.get(k) for k in value}
            if recorded != value:
                problems.append(f"{path}: graph {g}'s {key} is {graph.get(key)!r}, but its round samples give {value!r}")
    return problems


def redone_problems(path: str, doc: dict[str, Any]) -> list[str]:
    """A measurement job that, opening an engine, redid work its build should have done (`open_redone`:
    compiled or autotuned again): what it measured may not be the program the build made."""
    redone = doc.get("open_redone") or {}
    if doc.get("schema") == "timing":  # {variant: {graph: {kind: s}}}: the baseline's engine and the variant's
        redone = {f"{v} {g}": kinds for v, graphs in redone.items() for g, kinds in graphs.items()}
    build = doc.get("provenance", {}).get("inputs", {}).get("build", {}).get("path", "<its build.json>")
    return [f"{path}: opening the {name} engine redid work its build should have done ({kind} {s:g} s): the "
            f"build's compiled program lacks what this job ran; rerun it: snakemake --forcerun build {build}"
            for name, kinds in sorted(redone.items()) for kind, s in kinds.items() if s > 0]


def card_problems(path: str, doc: dict[str, Any]) -> list[str]:
    """A job of a GPU target that ran on another card than the one its target declares (`gpu:`): the
    README says its numbers are that card's."""
    from quantstudy.config import Target, on_its_card

    prov = doc.get("provenance") or {}
    target = (prov.get("params") or {}).get("target")
    if not isinstance(target, dict):
        return []
    # rule params (the name under `target`), or a Target's fields (torch_vs_plain)
    fields = {"name": target.get("target") or target.get("name"), "backend": target.get("backend", ""),
              "device": target.get("device", "cpu"), "gpu": target.get("gpu", "cpu")}
    ran_on = artifacts.gpu_name(prov.get("hardware", {}))
    if on_its_card(Target(**fields), ran_on):
        return []
    return [f"{path}: ran on {ran_on or 'no GPU'}, but its target {fields['name']} declares gpu {fields['gpu']}: its "
            f"numbers are not that card's; rerun it on an {fields['gpu']}, or declare the card it ran on in the run config"]


def redrawn_problems(path: str, doc: dict[str, Any], family: str) -> list[str]:
    """A sample list drawn again (steps.draw_samples) from the files of the snapshot it records, at the
    pinned revision: where an id or a sample's content differs from the list, or none."""
    from quantstudy import steps

    if "snapshot" not in doc:
        return [f"{path} does not record the snapshot it was drawn from (an older fetch_dataset): rerun it: "
                f"snakemake --forcerun fetch_dataset {path}"]
    params = doc["provenance"]["params"]
    drawn = steps.draw_samples(params["samples"], params["dataset"], family, doc["snapshot"],
                               doc["provenance"]["inputs"]["checkpoint"]["path"])
    recorded, again = [(s["id"], s["sha256"]) for s in doc["samples"]], [(s["id"], s["sha256"]) for s in drawn]
    differ = [i for i in range(max(len(recorded), len(again)))
              if i >= len(recorded) or i >= len(again) or recorded[i] != again[i]]
    if not differ:
        return []
    i = differ[0]
    mine = "no sample" if i >= len(recorded) else f"{recorded[i][0]!r} (sha256 {recorded[i][1][:12]})"
    theirs = "no sample" if i >= len(again) else f"{again[i][0]!r} (sha256 {again[i][1][:12]})"
    return [f"{path}: sample {i} is {mine}, but drawing the set again from {doc['repo']} at {doc['revision']} gives "
            f"{theirs} ({len(differ)} of {len(recorded)} samples differ)"]


def rederived_problems(tables_json: str | Path, doc: dict[str, Any]) -> list[str]:
    """tables.json (`doc`, as read) made again from the files and arguments its provenance names
    (aggregate.tables): every table cell, decision and range that is not what those files give, by
    its place in the file."""
    from quantstudy import aggregate

    if not isinstance(doc["provenance"]["params"].get("study"), dict):
        return [f"{tables_json} does not record the arguments it was made with (an older aggregate): rerun it: "
                f"snakemake --forcerun aggregate {tables_json}"]
    again = artifacts.plain(aggregate.tables(aggregate.inputs_of(doc), **doc["provenance"]["params"]))
    recorded = {k: v for k, v in doc.items() if k not in ("schema", "schema_version", DIGEST, "provenance")}
    a, b = artifacts.leaves(recorded), artifacts.leaves(again)
    return [f"{tables_json}: {key} is {a.get(key)!r}, but its input files give {b.get(key)!r}"
            for key in sorted(set(a) | set(b), key=str) if a.get(key) != b.get(key)]


def arguments_problems(tables_json: str | Path, doc: dict[str, Any], arguments: dict[str, Any],
                       where: str) -> list[str]:
    """The arguments tables.json records it was made with (the study, its baselines, the run, its
    targets) against those the config gives (`arguments`: Run.aggregate_arguments, from `where`). A
    threshold edited in the record, with the decision made again from it, agrees with itself; not with
    the config files."""
    recorded = artifacts.leaves(doc["provenance"]["params"])
    expected = artifacts.leaves(artifacts.plain(arguments))
    return [f"{tables_json}: made with {key} = {recorded.get(key, 'nothing')!r}, but {where} gives "
            f"{expected.get(key, 'nothing')!r} (rerun the study, or the file was edited)"
            for key in sorted(set(recorded) | set(expected), key=str) if recorded.get(key) != expected.get(key)]


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


# --- one number's chain ---------------------------------------------------------------------

TABLES = ("speed", "quality", "builds", "records", "kernels", "references", "calibration", "samples", "published")


def find_number(tables: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """The table cells of tables.json that the README shows as `text`, in any of the number formats
    the templates use: {table, row label, column, value, source}. A row's `sources` name the file of
    a column that is not the row's (a published number: its config/published file)."""
    from quantstudy import render

    # render.like prints a published number's neighbours in its notation: fixed or e, any precision.
    formats = (render.ms, render.times, render.pct, render.sci, render.num, render.count,
               *(lambda v, d=d: f"{v:.{d}f}" for d in range(7)), *(lambda v, d=d: f"{v:.{d}e}" for d in range(4)),
               *(lambda v, d=d: f"{100 * v:.{d}f}%" for d in range(3)))  # render.pct_of: a sample's precision
    text = text.strip().lstrip("+")  # a difference is shown signed
    want = text.rstrip("x%").replace(",", "") if not text.endswith("%") else text
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
                    label = row_label(row)
                    if row.get("published_source"):
                        label += " (published as {row} / {column})".format(**row["published_source"])
                    how, others = arithmetic(tables[table], row, column)
                    hits.append({"table": table, "row": label, "column": column, "value": value,
                                 "source": (row.get("sources") or {}).get(column, row.get("source")),
                                 "also_from": others, "where": (table, tables[table].index(row), column),
                                 "arithmetic": how})
    for i, c in enumerate((tables.get("decision") or {}).get("conditions", [])):
        observed = c.get("observed")
        for end, value in (observed.items() if isinstance(observed, dict) else [("value", observed)]):
            if end == "n" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if want in {f(value).replace(",", "") for f in formats if _formats(f, value)}:
                how, sources = _observed_arithmetic(tables, c, end, value)
                hits.append({"table": "decision", "row": f"condition {c['name']!r}", "column": f"observed {end}",
                             "value": value, "source": None, "sources_of": sources,
                             "where": ("decision", "conditions", i, "observed", end), "arithmetic": how})
    return hits


def _formats(f, value) -> bool:
    try:
        f(value)
        return True
    except (TypeError, ValueError):
        return False


def row_label(row: dict[str, Any]) -> str:
    """A row as the README's tables name it: target | model, `setting` | `variant` (and its graph)."""
    head = " | ".join(x for x in (row.get("target"), ", ".join(
        [row["model"]] * bool(row.get("model")) + [f"`{row['setting']}`"] * bool(row.get("setting")))) if x)
    graph = row.get("graph") if row.get("graph") not in (None, "", "main") else None
    return head + (f" | `{row['variant']}`" if row.get("variant") else "") + (f" | {graph}" if graph else "")


# Columns aggregate derives from two others of the same row: x is the baseline's time over the variant's.
DERIVED = {"x": ("baseline_ms", "variant_ms")}


def arithmetic(rows: list[dict[str, Any]], row: dict[str, Any], column: str) -> tuple[str | None, list[str]]:
    """How a derived cell is made, with the values it is made of, and the other files they come from: x
    from its row's times (`x = baseline_ms / variant_ms = 2.767 / 5.682 = 0.487`); a ratio to another
    variant (`wikitext.kl_mean / fp16`, aggregate.with_ratio) from that variant's row on the same key. A
    measured cell: (None, [])."""
    from quantstudy import render

    if column in DERIVED and all(row.get(c) is not None for c in DERIVED[column]):
        a, b = DERIVED[column]
        return f"{column} = {a} / {b} = {render.ms(row[a])} / {render.ms(row[b])} = {row[a] / row[b]:.3f}", []
    base, _, other = column.partition(" / ")
    theirs = next((r for r in rows if other and r.get("variant") == other and r.get("status", "ok") == "ok"
                   and all(r.get(k) == row.get(k) for k in ("target", "model", "setting", "graph"))), None)
    if theirs is None or row.get(base) is None or not theirs.get(base):
        return None, []
    return (f"{column} = {render.sci(row[base])} / {other}'s {render.sci(theirs[base])} ({theirs['source']}) = "
            f"{row[base] / theirs[base]:.4g}", [theirs["source"]])


def _observed_arithmetic(tables: dict[str, Any], c: dict[str, Any], end: str, value: float) -> tuple[str, list[str]]:
    """Where a decision's observed value comes from: the rows of its table whose value of its column it
    is (the min or max over the condition's rows), each with its file; a column relative to another
    variant (`kl / fp16`) with its division."""
    from quantstudy import render

    declared = {d["name"]: d for d in (tables.get("spec") or {}).get("decision", {}).get("conditions", [])}
    c = {**declared.get(c["name"], {}), **c}  # a tables.json before decide() copied its table
    column, rows = c["column"], tables.get(c.get("table") or "", [])
    over = {k: v for k, v in (c.get("rows") or {}).items()}
    candidate = (tables.get("decision") or {}).get("candidate") or (tables.get("spec") or {}).get("candidate")
    mine = [r for r in rows if r.get("variant") == candidate and r.get("status", "ok") == "ok"
            and all(r.get(k) == v for k, v in over.items())]
    found, sources = [], []
    for r in mine:
        if " / " in column:
            base_col, other = column.split(" / ", 1)
            theirs = next((o for o in rows if o.get("variant") == other and o.get("status", "ok") == "ok"
                           and all(o.get(k) == r.get(k) for k in ("target", "model", "setting", "graph"))), None)
            if theirs is None or not theirs.get(base_col) or r.get(base_col) is None:
                continue
            got = r[base_col] / theirs[base_col]
            how = (f"{base_col} {render.sci(r[base_col])} ({r['source']}) / {other}'s {render.sci(theirs[base_col])} "
                   f"({theirs['source']}) = {got:.4g}")
            pair = [r["source"], theirs["source"]]
        elif isinstance(r.get(column), (int, float)):
            got, how, pair = r[column], f"{column} = {r[column]!r} ({r['source']})", [r["source"]]
        else:
            continue
        if abs(got - value) <= 1e-9 * max(1.0, abs(value)):
            found.append(f"{row_label(r)}: {how}")
            sources += pair
    reduce = {"min": "smallest", "max": "largest"}.get(end, end)
    return (f"the {reduce} of `{column}` over the condition's {len(mine)} rows of the {c.get('table')} table"
            + (": " + "; ".join(found) if found else ""), sources)


def shown_hits(tables: dict[str, Any], readme: str | Path, text: str, hits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hits the README shows: a cell is shown as `text` where changing its value, and only it, changes
    how many times the page (rendered from tables.json as the README was) prints `text`. A cell that
    merely formats to the same digits (a round range the page never prints) is not."""
    import copy
    import re

    from quantstudy import render

    pattern = re.compile(r"(?<![\d.])" + re.escape(text.strip().lstrip("+")) + r"(?![\d])")
    before = len(pattern.findall(render.render_section(tables, readme)))

    def changes_the_page(group: list[dict[str, Any]]) -> bool:
        changed = copy.deepcopy(tables)
        for h in group:
            *path, last = h["where"]
            holder = changed
            for key in path:
                holder = holder[key]
            value = holder[last]
            holder[last] = value + 7 if isinstance(value, int) else value * 1.37 + 0.0137
        try:
            return len(pattern.findall(render.render_section(changed, readme))) < before
        except Exception:  # noqa: BLE001 - a cell the page cannot render without is one it uses
            return True

    shown = [h for h in hits if changes_the_page([h])]
    # Cells printed together as one number (a range whose two ends are equal): each alone changes nothing.
    # Of such a group, those the page needs: without changing one of them, the rest no longer change it.
    for value in dict.fromkeys(h["value"] for h in hits):
        group = [h for h in hits if h["value"] == value and h not in shown]
        if len(group) > 1 and not any(h["value"] == value for h in shown) and changes_the_page(group):
            needed = [h for h in group if not changes_the_page([g for g in group if g is not h])]
            shown += needed or group
    return [h for h in hits if h in shown]


def _describe(step: dict[str, Any]) -> str:
    pad = "  " * step["depth"]
    line = f"{pad}{step['path']}"
    if step.get("rule"):
        hw = step["hardware"]
        gpu = artifacts.gpu_name(hw) or f"CPU ({hw.get('cpus')} cores, {hw.get('host')})"
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
