"""The audit's checks of the files of a study's chain, each a list of problems as sentences: one
engine timed and evaluated (TEST01's probes), the derived numbers made again from their files (x and
ms from the round samples, tables.json by aggregate, a sample list drawn again), the jobs' engines
opened without redoing their build's work, on the card their target declares, and tables.json's
arguments against the config's. quantstudy.audit walks the chain and calls them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantstudy import artifacts
from quantstudy.artifacts import DIGEST

# TEST01's probe: the timing job's and the evaluation job's answers on the seeded example inputs
# agree to this share of the probe's largest magnitude (one engine, one machine kind: equal in
# practice; the margin covers a GEMM algorithm chosen differently on another GPU of the model).
PROBE_TOLERANCE = 1e-3


def probes_differ(a: dict[str, Any], b: dict[str, Any], tolerance: float = PROBE_TOLERANCE) -> str | None:
    """Where two jobs' probes (steps_measure._probe) of one engine disagree, or None."""
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
            f"build's compiled program lacks what this job ran; rerun it: {artifacts.rerun_command(build)}"
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
                f"{artifacts.rerun_command(path)}"]
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
                f"{artifacts.rerun_command(tables_json)}"]
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

