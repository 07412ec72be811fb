"""Committed evidence runs: their rendered README is what the templates make of their tables.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantstudy import artifacts, render

from helpers import ROOT

# Each tables.json inside an evidence folder results/<machine-backend>/ has its rendered README.md
# beside it (the workflow's own results/<study>/tables.json is one level up, and not evidence).
EVIDENCE = sorted(ROOT.glob("results/*/*/**/tables.json"))


@pytest.mark.parametrize("tables", EVIDENCE, ids=[str(p.relative_to(ROOT)) for p in EVIDENCE])
def test_evidence_readme_renders_from_its_tables(tables: Path):
    version = json.loads(tables.read_text())["schema_version"]
    if version != artifacts.SCHEMA_VERSION:  # its README was rendered by the code of its own schema
        pytest.skip(f"{tables.relative_to(ROOT)} is schema version {version}, the templates render "
                    f"version {artifacts.SCHEMA_VERSION}: rerun that evidence to re-render it")
    from quantstudy.devtools import malformed_tables

    rendered = render.render_section(artifacts.read_json(tables, "tables"), tables.parent / "README.md")
    assert rendered == (tables.parent / "README.md").read_text(), (
        f"re-render it: python -m quantstudy.render {tables.relative_to(ROOT)}")
    assert malformed_tables(rendered) == []


COMMITTED_READMES = sorted(p for p in ROOT.glob("results/**/*.md")) + sorted(ROOT.glob("docs/*.md")) + [
    ROOT / "README.md", ROOT / "tests" / "README.md"]


@pytest.mark.parametrize("readme", COMMITTED_READMES, ids=[str(p.relative_to(ROOT)) for p in COMMITTED_READMES])
def test_every_relative_link_of_a_committed_readme_resolves(readme: Path):
    """A reader who clicks a link in the repository finds its file: the evidence READMEs (rendered
    and written), the docs and the top-level READMEs."""
    from quantstudy.devtools import dead_links

    assert dead_links(readme) == []


def test_there_is_evidence():
    assert EVIDENCE, "no committed evidence run under results/"


BUILD_ONCE = ROOT / "results" / "h200-build-once" / "xcit"
# The same study after the autotune fix (4ec7401), on an H100: its jobs record what an opening redid. The
# second ran with the target declaring that card (config/realsize/calls/h100.yaml).
BUILD_ONCE_AFTER_FIX = [ROOT / "results" / "h200-build-once" / run for run in ("xcit-h100", "xcit-h100-declared")]


@pytest.mark.parametrize("run", [BUILD_ONCE, *BUILD_ONCE_AFTER_FIX], ids=lambda p: p.name)
def test_the_build_once_run_opened_every_engine_from_its_build_and_measured_one_program(run: Path):
    """results/h200-build-once/: every torch measurement job logged opening each engine from its
    build's compiled program with no graph compiled, in at most 15 s an engine; each variant's timing
    and evaluation named the same compiled program, the one its build.json records."""
    import re

    logs = sorted((run / "logs").rglob("*.log"))
    measured = [p for p in logs if p.stem in ("time", "profile", "evaluate")]
    assert len(measured) == 20
    for log in measured:
        opens = re.findall(r"opened \S+ at .* in ([0-9.]+) s from compiled.bin \((?:artifacts: [^;]*; )?FX graph cache: "
                           r"(\d+) hits, 0 misses[;)]",
                           log.read_text())
        # A baseline's time job opened its one engine twice (since once): the second reused the first's code.
        assert opens and all(float(s) <= 15 for s, _ in opens) and int(opens[0][1]) >= 1, log
    timings = sorted((run / "results").rglob("timing.json"))
    assert len(timings) == 8
    for timing in timings:
        build = json.loads((timing.parent / "build.json").read_text())
        recorded = {g: e["compiled_sha256"] for g, e in build["graphs"].items()}
        assert json.loads(timing.read_text())["compiled_sha256"] == recorded
        if (timing.parent / "quality.json").exists():
            assert json.loads((timing.parent / "quality.json").read_text())["compiled_sha256"] == recorded


@pytest.mark.parametrize("run", BUILD_ONCE_AFTER_FIX, ids=lambda p: p.name)
def test_the_build_once_run_after_the_fix_redid_nothing_opening_its_engines(run: Path):
    """Every time, profile and evaluate job of a run after the autotune fix records what its openings
    redid (`open_redone`), and none compiled or autotuned anything again."""
    from quantstudy import audit_checks

    jobs = {p: json.loads(p.read_text()) for name in ("timing.json", "kernels.json", "quality.json")
            for p in (run / "results").rglob(name)}
    assert len(jobs) == 20
    assert all("open_redone" in doc for doc in jobs.values())
    assert [problem for p, doc in jobs.items() for problem in audit_checks.redone_problems(str(p), doc)] == []


def _gpu_cost():
    """benchmarks/gpu_cost.py as a module (benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_cost", ROOT / "benchmarks" / "gpu_cost.py")
    gpu_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_cost)
    return gpu_cost


def test_gpu_cost_sums_each_rules_benchmark_seconds():
    """benchmarks/gpu_cost.py over the committed run: its per-rule job-seconds are the sums of the
    TSVs' first column, and each job's opening seconds the sum of its log's `opened` lines."""
    import re

    gpu_cost = _gpu_cost()
    found = gpu_cost.jobs(BUILD_ONCE, "timm_xcit")
    times = sorted((BUILD_ONCE / "benchmarks").rglob("time.tsv"))
    assert sum(j["seconds"] for j in found if j["rule"] == "time") == pytest.approx(
        sum(float(p.read_text().splitlines()[1].split("\t")[0]) for p in times))
    job = next(j for j in found if j["key"].endswith("xcit-tiny/b1/fp8/time"))
    assert job["opens"] == 2 and job["open_seconds"] == pytest.approx(11.2, abs=0.06)
    assert re.search(r"^time\s+8\s+142\.9\s+78\.7\s+64\.2\s+10\.1$", gpu_cost.report(found), re.M)


def test_gpu_cost_counts_the_rebuild_jobs_as_gpu_jobs():
    """A rebuild (`evaluation.rebuild`) compiles an engine on the GPU as `build` does: its rule gets a row,
    its seconds the sum of its TSVs (DETR's GPU rebuild-spread run: two rebuild-r2 jobs)."""
    import re

    gpu_cost = _gpu_cost()
    run = ROOT / "results/h200-detr-rebuild/deformable_detr"
    found = gpu_cost.jobs(run, "deformable_detr")
    tsvs = sorted((run / "benchmarks").rglob("rebuild-r2.tsv"))
    seconds = sum(float(p.read_text().splitlines()[1].split("\t")[0]) for p in tsvs)
    assert len(tsvs) == 2 and re.search(rf"^rebuild\s+2\s+{seconds:.1f}\s", gpu_cost.report(found), re.M)


def test_gpu_cost_splits_each_rules_openings_into_their_parts(tmp_path):
    """The parts of each opening (TorchBackend.open's log line) summed per rule, with the largest of one
    opening; a job whose log gives no parts (a run from before them) adds none. The largest opening of
    a rule is one opening's (12.4 s), not a job's mean (10.75 s)."""
    gpu_cost = _gpu_cost()
    line = ("INFO quantstudy: opened results/s/t/m/b1/{v}/engine at x [1, 8] in {total} s from compiled.bin "
            "(FX graph cache: 3 hits, 0 misses; weights 0.50 s, artifacts 0.25 s, trace {trace} s, compiler 4.00 s, "
            "calls 0.10 s, capture 1.50 s, waiting 0.00 s; of which compiling 0.00 s, autotuning {tuned} s)\n")
    before_parts = "INFO quantstudy: opened e at x [1] in 5.0 s from compiled.bin (FX graph cache: 3 hits, 0 misses)\n"
    for job, text in {"a/time": line.format(v="fp8", total=9.1, trace=2.75, tuned=0.0)
                      + line.format(v="fp16", total=12.4, trace=6.0, tuned=0.35),
                      "b/time": before_parts}.items():
        (tmp_path / "benchmarks" / job).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "benchmarks" / f"{job}.tsv").write_text("s\th:m:s\n30.0\t0:00:30\n")
        (tmp_path / "logs" / job).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "logs" / f"{job}.log").write_text(text)
    report = gpu_cost.report(gpu_cost.jobs(tmp_path))
    by_part = report.partition("by part")[2].splitlines()
    assert by_part[1].split() == ["rule", "opens", "weights", "artifacts", "trace", "compiler", "calls", "capture",
                                  "waiting", "compiling", "(redone)", "autotuning", "(redone)"]
    assert next(r for r in by_part if r.startswith("time")).split() == [
        "time", "2", "1.0", "[0.5]", "0.5", "[0.2]", "8.8", "[6.0]", "8.0", "[4.0]", "0.2", "[0.1]", "3.0", "[1.5]",
        "0.0", "[0.0]", "0.0", "[0.0]", "0.3", "[0.3]"]
    assert "time 2 60.0 26.5 33.5 12.4".split() == next(r for r in report.splitlines() if r.startswith("time")).split()


def test_gpu_cost_sums_each_rules_waits_for_the_gpu_alone(tmp_path):
    """The waits of measurements' turns (timing.gpu_turn's log lines) per rule: count, sum, longest; none
    printed for a run whose logs have no such line."""
    gpu_cost = _gpu_cost()
    waited = "INFO quantstudy: GPU turn alone after waiting {} s for other GPU work to end\n"
    for job, text in {"a/gemm": waited.format("98.20") + waited.format("0.01") + waited.format("2.40"),
                      "b/time": waited.format("0.30"), "c/time": "INFO quantstudy: something else\n"}.items():
        (tmp_path / "benchmarks" / job).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "benchmarks" / f"{job}.tsv").write_text("s\th:m:s\n120.0\t0:02:00\n")
        (tmp_path / "logs" / job).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "logs" / f"{job}.log").write_text(text)
    waits = gpu_cost.report(gpu_cost.jobs(tmp_path)).partition("waiting for the GPU alone")[2].split("\n\n")[0]
    assert [r.split() for r in waits.splitlines()[1:]] == [["rule", "turns", "seconds", "longest"],
                                                           ["time", "1", "0.3", "0.3"], ["gemm", "3", "100.6", "98.2"]]
    (tmp_path / "logs" / "a" / "gemm.log").write_text("")
    (tmp_path / "logs" / "b" / "time.log").write_text("")
    assert "waiting for the GPU alone" not in gpu_cost.report(gpu_cost.jobs(tmp_path))
