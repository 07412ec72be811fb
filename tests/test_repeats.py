"""Timing repeats: a variant timed in N separate jobs, x across them in tables.json and the README.

The config option and its errors, the aggregate of a small case worked out by hand, and the
rendering with and without a measured spread across jobs (on a committed evidence run's tables).
"""

from __future__ import annotations

import copy
import statistics

import pytest
import yaml

from quantstudy import aggregate_rows, artifacts, config as qc, render, render_formats

from helpers import ROOT, TEST_CONFIG, study_doc

EVIDENCE = ROOT / "results/h200-torch-issue9/results/deberta_v2/tables.json"


@pytest.mark.parametrize("repeats", [0, -2, "two", 2.5, True])
def test_study_repeats_must_be_a_whole_number_of_jobs(tmp_path, repeats):
    doc = study_doc()
    doc["timing"]["repeats"] = repeats
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(qc.ConfigError, match=r"timing\.repeats: .* is not a number of timing jobs: repeats is how "
                                             r"many separate timing jobs each timed variant gets"):
        qc.load_study(tmp_path / "study.yaml", against_code=False)


def test_the_run_sets_repeats_for_every_study_and_one_job_is_the_default():
    run_doc = yaml.safe_load(TEST_CONFIG.read_text())
    assert qc.load_run(run_doc, against_code=False).studies["fnet"].repeats == 1
    run = qc.load_run({**run_doc, "timing_repeats": 3}, against_code=False)
    assert run.studies["fnet"].repeats == 3 and run.studies["fnet"].document["timing"]["repeats"] == 3
    for bad in (0, "2"):  # `--config timing_repeats=0`; a string is what a quoted YAML value gives
        with pytest.raises(qc.ConfigError, match=r"workflow config: timing_repeats: .* is not a number of timing jobs"):
            qc.load_run({**run_doc, "timing_repeats": bad}, against_code=False)


def _job(repeat: int, x: float, variant_ms: float, baseline_ms: float, x_min: float, x_max: float,
         status: str = "ok") -> dict:
    path = "results/s/cpu-torch/m/w8/fp8/" + ("timing.json" if repeat == 1 else f"timing-r{repeat}.json")
    ident = {"target": "cpu-torch", "model": "m", "setting": "w8", "variant": "fp8", "status": status, "source": path}
    if status != "ok":
        return ident | {"error": "RuntimeError: out of memory"}
    return ident | {"graph": "main", "repeat": repeat, "baseline": "fp16", "variant_ms": variant_ms,
                    "variant_spread": 0.01, "baseline_ms": baseline_ms, "x": x, "x_min": x_min, "x_max": x_max}


def test_across_repeats_by_hand():
    """Three jobs of one variant, in the order the files come: x 1.05, 1.00, 1.02 (repeats 3, 1, 2)."""
    jobs = [_job(3, 1.05, 0.95, 1.00, 1.01, 1.09), _job(1, 1.00, 1.00, 1.00, 0.97, 1.03),
            _job(2, 1.02, 0.98, 1.00, 0.99, 1.04)]
    [row] = aggregate_rows.across_repeats(jobs)
    assert row["repeats"] == 3 and "repeat" not in row
    assert row["x_by_repeat"] == [1.00, 1.02, 1.05]  # in repeat order
    assert row["x"] == 1.02  # the median job's x
    assert row["variant_ms"] == 0.98 and row["baseline_ms"] == 1.00  # medians of the jobs' medians
    assert (row["x_min"], row["x_max"]) == (0.97, 1.09)  # the widest round range
    assert (row["x_jobs_min"], row["x_jobs_max"]) == (1.00, 1.05)
    assert row["x_jobs_spread"] == pytest.approx(0.05 / 1.02)
    assert row["source"].endswith("/timing.json") and len(row["timing_sources"]) == 3
    # Two jobs: the median is their mean.
    [two] = aggregate_rows.across_repeats(jobs[1:])
    assert two["x"] == pytest.approx(1.01) and two["x_jobs_spread"] == pytest.approx(0.02 / 1.01)


def test_one_job_measures_no_spread_and_a_failed_job_is_the_row():
    [one] = aggregate_rows.across_repeats([_job(1, 1.00, 1.0, 1.0, 0.9, 1.1)])
    assert one["repeats"] == 1 and one["x"] == 1.00
    assert one["x_jobs_min"] is one["x_jobs_max"] is one["x_jobs_spread"] is None
    rows = aggregate_rows.across_repeats([_job(1, 1.00, 1.0, 1.0, 0.9, 1.1), _job(2, 0, 0, 0, 0, 0, status="failed")])
    assert [(r["status"], r["source"]) for r in rows] == [("failed", "results/s/cpu-torch/m/w8/fp8/timing-r2.json")]


def _with_repeats(tables: dict, factors: dict[tuple, float]) -> dict:
    """The evidence run's speed rows as if each variant had a second timing job whose x is the
    first's times `factors[(model, setting)]` (1.0 where not given), through aggregate."""
    t = copy.deepcopy(tables)
    jobs = []
    for row in t["speed"]:
        first = {**row, "repeat": 1}
        second = {**row, "repeat": 2, "source": row["source"].replace("timing.json", "timing-r2.json")}
        if row["status"] == "ok":
            second["x"] = row["x"] * factors.get((row["model"], row["setting"]), 1.0)
        jobs += [first, second]
    t["speed"] = aggregate_rows.across_repeats(jobs)
    t["spec"]["timing"]["repeats"] = 2
    return t


def test_render_shows_the_spread_across_jobs_only_where_it_was_measured():
    tables = artifacts.read_json(EVIDENCE, "tables")
    cand = tables["spec"]["candidate"]
    one_job = render.render_section(tables)
    assert "The spread of x across timing jobs was not measured: each variant was timed in one job" in one_job
    assert "x across jobs" not in one_job and "noise" not in one_job

    # x 1.0608 / 1.0252 / 0.9992 / 1.0076 in the evidence (w128, w256, w512, b32-w256); w512's second job at
    # 1.02x its first, w128's at 1.001x. By hand: a second job at f x the first spreads (f - 1) / ((1 + f) / 2)
    # of the jobs' median: 0.02 / 1.01 = 1.98%, 0.001 / 1.0005 = 0.10%; 0.00% where f is 1.
    t = _with_repeats(tables, {("deberta-v3-base", "w512"): 1.02, ("deberta-v3-base", "w128"): 1.001})
    section = render.render_section(t)
    assert "spread of x across timing jobs was not measured" not in section
    assert "| x (round range) | x across jobs (spread) |" in section
    across_jobs = {line.split(" | ")[0]: line.removesuffix(" |").rsplit(" | ", 1)[1]  # a speed row's last cell
                   for line in section.splitlines() if line.startswith("| deberta-v3-base, ") and "/timing.json" in line}
    assert across_jobs == {"| deberta-v3-base, `w128`": "1.06 to 1.06 (0.10%)",
                           "| deberta-v3-base, `w256`": "1.03 to 1.03 (0.00%)",
                           "| deberta-v3-base, `w512`": "1.00 to 1.02 (1.98%)",
                           "| deberta-v3-base, `b32-w256`": "1.01 to 1.01 (0.00%)"}
    assert f"Across timing jobs, {cand}'s x moved by 0.00% to 1.98%." in section
    # Within noise: |x - 1| <= the range of x across jobs, which only w512 meets (x about 1.009, range 0.02).
    assert f"Within that noise these rows do not tell {cand} from its baseline: deberta-v3-base, `w512` on `h200-torch`." in section
    w512 = next(r for r in t["speed"] if r["variant"] == cand and r["setting"] == "w512")
    assert statistics.median(w512["x_by_repeat"]) == w512["x"]

    # No row within its noise: the sentence says so instead.
    apart = render.render_section(_with_repeats(tables, {("deberta-v3-base", "w512"): 1.0}))
    assert "Within that noise" not in apart and "On every row x differs from 1 by more than that." in apart


# --- evaluation repeats: one engine evaluated in N separate jobs --------------------------------

def _evaluation(repeat: int, ap: float | None, nonfinite: int = 0, status: str = "ok") -> dict:
    path = "results/s/cpu-torch/m/w8/fp8/" + ("quality.json" if repeat == 1 else f"quality-r{repeat}.json")
    ident = {"target": "cpu-torch", "model": "m", "setting": "w8", "variant": "fp8", "status": status, "source": path}
    if status != "ok":
        return ident | {"error": "RuntimeError: out of memory"}
    return ident | {"evaluation_repeat": repeat, "heldout.ap": ap, "heldout.evaluator": "faster_coco_eval",
                    "nonfinite": nonfinite}


def test_across_evaluations_by_hand():
    """Three jobs of one engine, in the order the files come (repeats 3, 1, 2), AP 0.461, 0.464, 0.4625:
    the row holds the first job's values (0.464) and AP's range 0.461 to 0.464 across the jobs; a text
    column gets no range; a metric one job left empty (None) gets none either."""
    rows = aggregate_rows.across_evaluations([_evaluation(3, 0.461), _evaluation(1, 0.464, nonfinite=2),
                                              _evaluation(2, 0.4625)])
    [row] = rows
    assert row["heldout.ap"] == 0.464 and row["nonfinite"] == 2 and "evaluation_repeat" not in row
    assert (row["heldout.ap.jobs_min"], row["heldout.ap.jobs_max"]) == (0.461, 0.464)
    assert (row["nonfinite.jobs_min"], row["nonfinite.jobs_max"]) == (0, 2)
    assert row["evaluations"] == 3 and row["quality_sources"][0].endswith("/quality.json")
    assert "heldout.evaluator.jobs_min" not in row
    [row] = aggregate_rows.across_evaluations([_evaluation(1, 0.464), _evaluation(2, None)])
    assert "heldout.ap.jobs_min" not in row


def test_one_evaluation_job_measures_no_spread_and_a_failed_job_is_the_row():
    [row] = aggregate_rows.across_evaluations([_evaluation(1, 0.464)])
    assert row["evaluations"] == 1 and "heldout.ap.jobs_min" not in row
    rows = aggregate_rows.across_evaluations([_evaluation(1, 0.464), _evaluation(2, None, status="failed")])
    assert [r["status"] for r in rows] == ["failed"] and rows[0]["source"].endswith("quality-r2.json")


def test_evaluation_repeats_plan_one_evaluate_job_each(tmp_path):
    """`evaluation: {repeats: 2}` on the workflow tests' study: every engine it evaluates gets
    quality.json and quality-r2.json, and aggregate reads both; one job is the default."""

    assert qc.load_run(yaml.safe_load(TEST_CONFIG.read_text()), against_code=False).studies["fnet"].evaluation_repeats == 1
    proc = _dry_run_with_evaluation(tmp_path, "{repeats: 2}")
    planned = set(__import__("re").findall(r"output: (results/fnet/\S+/quality(?:-r\d+)?\.json)", proc.stdout))
    firsts = {p for p in planned if p.endswith("/quality.json")}
    assert firsts and {p.replace("/quality.json", "/quality-r2.json") for p in firsts} == planned - firsts


def test_reproduce_samples_every_evaluation_job_of_an_engine(tmp_path):
    """reproduce's candidates: a quality row of two evaluation jobs offers both files, as a speed row
    of two timing jobs offers both."""
    from quantstudy import reproduce

    doc = artifacts.read_json(EVIDENCE, "tables")
    doc.pop("content_sha256", None)
    row = next(r for r in doc["quality"] if r["status"] == "ok")
    second = row["source"].replace("/quality.json", "/quality-r2.json")
    row["quality_sources"] = [row["source"], second]
    artifacts.write_json(tmp_path / "tables.json", "tables", doc)
    found = reproduce.candidates(tmp_path)["evaluate"]
    assert row["source"] in found and second in found


# --- evaluation on separate builds: `evaluation: {repeats: N, rebuild: true}` ------------------------

def test_evaluation_job_two_opens_its_own_build_where_rebuild_is_on():
    """Deformable DETR's study config rebuilds (TensorRT tactics): job 1 opens the timed build, job 2
    rebuild-r2/build.json of the engine's setting (800x1067 runs on 800x800's dynamic engine); off, or for
    the embedded default's CPU run, every job opens the timed build."""
    h200 = qc.load_run(yaml.safe_load((ROOT / "config/h200.yaml").read_text()), against_code=False).studies
    s = h200["deformable_detr"]
    assert (s.evaluation_repeats, s.evaluation_rebuild) == (2, True)
    assert s.document["evaluation"] == {"repeats": 2, "rebuild": True}
    key = ("h200-torch", "deformable-detr", "800x1067", "fp8")
    assert s.engine_setting("800x1067") == "800x800"
    first = "results/deformable_detr/h200-torch/deformable-detr/800x800/fp8/build.json"
    assert s.evaluated_build_json(*key, 1) == s.build_json(*key) == first
    assert s.evaluated_build_json(*key, 2) == "results/deformable_detr/h200-torch/deformable-detr/800x800/fp8/rebuild-r2/build.json"
    assert s.evaluated_build_json(*key, 3).endswith("/800x800/fp8/rebuild-r3/build.json")
    tiny = qc.load_run(yaml.safe_load((ROOT / "config/config.yaml").read_text()), against_code=False).studies
    assert (tiny["deformable_detr"].evaluation_repeats, tiny["deformable_detr"].evaluation_rebuild) == (2, False)
    assert tiny["deformable_detr"].evaluated_build_json(*key, 2) == first
    # A study without `rebuild` records the evaluation it always did: tables.json's spec stays the same.
    assert tiny["deformable_detr"].document["evaluation"] == {"repeats": 2}
    assert h200["gpt_neo"].evaluation_repeats == 2 and h200["gpt_neo"].evaluation_rebuild
    assert tiny["gpt_neo"].evaluation_repeats == 1 and not tiny["gpt_neo"].evaluation_rebuild


@pytest.mark.parametrize("rebuild", [1, "yes"])
def test_rebuild_must_be_true_or_false(tmp_path, rebuild):
    doc = study_doc()
    doc["evaluation"] = {"repeats": 2, "rebuild": rebuild}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(qc.ConfigError, match=r"evaluation\.rebuild"):
        qc.load_study(tmp_path / "study.yaml", against_code=False)


def test_rebuild_plans_one_build_per_evaluated_engine_and_only_evaluation_opens_it(tmp_path):
    """`evaluation: {repeats: 2, rebuild: true}` on the workflow tests' study: one rebuild job per engine it
    evaluates, each writing rebuild-r2/; every quality-r2.json job reads its engine's rebuild (and the rebuild
    of the engine it is compared against, quality_against), quality.json jobs, timings and profiles never do."""
    import re

    from quantstudy.devtools import planned_jobs

    proc = _dry_run_with_evaluation(tmp_path, "{repeats: 2, rebuild: true}")
    blocks = [b for b in re.split(r"\n(?=(?:local)?rule \w+:)", proc.stdout) if re.match(r"(?:local)?rule \w+:", b.strip())]
    inputs = {}  # (rule, output) -> inputs
    for b in blocks:
        rule = re.match(r"(?:local)?rule (\w+):", b.strip()).group(1)
        out = re.search(r"output: (\S+?),?\s", b)
        inputs[(rule, out.group(1) if out else "")] = re.search(r"input: (.*)", b).group(1).split(", ") if "input:" in b else []
    jobs = planned_jobs(proc.stdout)
    evaluated = {(w["target"], w["variant"]) for rule, w in jobs if rule == "evaluate"}
    rebuilt = [(w["target"], w["variant"], w["repeat"]) for rule, w in jobs if rule == "rebuild"]
    assert sorted(rebuilt) == sorted((t, v, "-r2") for t, v in evaluated) and len(rebuilt) == 9
    against = "results/fnet/{}/fnet-base/w512/fp16-hs/rebuild-r2/build.json"
    for (rule, out), ins in inputs.items():
        if rule == "evaluate" and out.endswith("/quality-r2.json"):
            own = out.replace("/quality-r2.json", "/rebuild-r2/build.json")
            assert own in ins and out.replace("/quality-r2.json", "/build.json") not in ins, (out, ins)
            target = out.split("/")[2]
            assert "/fp16-hs/" in out or against.format(target) in ins, (out, ins)
        elif rule == "rebuild":
            assert out.endswith("/rebuild-r2/build.json")
        else:
            assert not [i for i in ins if "/rebuild-" in i], (rule, out, ins)
    assert sum(1 for rule, out in inputs if rule == "evaluate" and out.endswith("/quality-r2.json")) == len(evaluated)


def test_a_rebuild_records_its_own_rule_and_its_rerun_hint_reruns_it_alone(tmp_path, monkeypatch, capsys):
    """Rule rebuild runs the build script (`use rule build as rebuild`): its build.json and measurements record,
    ok or failed, say rule rebuild, the first build's say build, and `audit chain` shows that. The audit's hint
    for it (`rerun_command`: the file forced, not `--forcerun build`, which names no rebuild) plans that one job."""
    from quantstudy import audit, paths
    from quantstudy.artifacts import rerun_command
    from quantstudy.devtools import copy_checkout, planned_jobs, snakemake

    repo = copy_checkout(ROOT, tmp_path / "repo")
    config = _config_with_evaluation(tmp_path, "{repeats: 2, rebuild: true}")
    key = {"study": "fnet", "target": "cpu-torch", "model": "fnet-base", "setting": "w512"}
    first = paths.BUILD.format(**key, variant="fp16")
    rebuilt = {v: paths.REBUILD.format(**key, variant=v, repeat="-r2") for v in ("fp16", "fp8-broken")}
    proc = snakemake(repo, first, *rebuilt.values(), "--configfile", config)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def rules(build_json: str) -> tuple[str, str, str]:
        build = artifacts.read_json(repo / build_json, "build")
        record = artifacts.read_json(repo / paths.beside(build_json, paths.MEASUREMENTS), "measurements")
        return build["status"], build["provenance"]["rule"], record["provenance"]["rule"]

    assert rules(first) == ("ok", "build", "build")
    assert rules(rebuilt["fp16"]) == ("ok", "rebuild", "rebuild")
    assert rules(rebuilt["fp8-broken"]) == ("failed", "rebuild", "rebuild")  # a failure is recorded by its rule too
    monkeypatch.chdir(repo)
    assert audit.main(["chain", rebuilt["fp16"]]) == 0
    assert f"{rebuilt['fp16']}\n  rule rebuild, " in capsys.readouterr().out

    hint = rerun_command(rebuilt["fp16"])
    assert hint == f"snakemake --force {rebuilt['fp16']}"
    proc = snakemake(repo, *hint.split()[1:], "-n", "--configfile", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(rule, w["variant"], w["repeat"]) for rule, w in planned_jobs(proc.stdout)] == [("rebuild", "fp16", "-r2")]


def test_across_evaluations_lists_the_builds_only_where_the_jobs_opened_separate_ones():
    first, second = _evaluation(1, 0.464), _evaluation(2, 0.4625)
    build = "results/s/cpu-torch/m/w8/fp8/build.json"
    same = aggregate_rows.across_evaluations([first | {"evaluation_build": build}, second | {"evaluation_build": build}])
    assert "quality_builds" not in same[0] and "evaluation_build" not in same[0]
    rebuilt = build.replace("/build.json", "/rebuild-r2/build.json")
    [row] = aggregate_rows.across_evaluations([second | {"evaluation_build": rebuilt}, first | {"evaluation_build": build}])
    assert row["quality_builds"] == [build, rebuilt] and "evaluation_build" not in row
    assert (row["heldout.ap.jobs_min"], row["heldout.ap.jobs_max"]) == (0.4625, 0.464)
    failed = aggregate_rows.across_evaluations([first | {"evaluation_build": build},
                                                _evaluation(2, None, status="failed") | {"evaluation_build": None}])
    assert [set(r) & {"quality_builds", "evaluation_build"} for r in failed] == [set()]


DETR_EVIDENCE = ROOT / "results/h200-deformable-detr/deformable_detr/results/deformable_detr/tables.json"
GPT_NEO_EVIDENCE = ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json"


def _rebuilt(tables: dict, column: str, spread: float) -> dict:
    """The evidence's tables as two builds per engine would make them: each ok row's second job on its own
    build, `column` lower by `spread` there."""
    t = copy.deepcopy(tables)
    for r in t["quality"]:
        if r["status"] == "ok" and r.get(column) is not None:
            first = r["source"].replace("/quality.json", "/build.json")
            r |= {"evaluations": 2, "quality_sources": [r["source"], r["source"].replace(".json", "-r2.json")],
                  "quality_builds": [first, first.replace("/build.json", "/rebuild-r2/build.json")],
                  f"{column}.jobs_min": r[column] - spread, f"{column}.jobs_max": r[column]}
    return t


def test_the_readme_says_the_spread_is_across_builds_where_each_job_had_its_own():
    from quantstudy.devtools import malformed_tables

    tables = artifacts.read_json(DETR_EVIDENCE, "tables")
    one_engine = render.render_section(tables)
    assert "| AP across jobs |" in one_engine and "(2 jobs)" in one_engine
    assert "build to build" not in one_engine and "across builds" not in one_engine
    rebuilt = render.render_section(_rebuilt(tables, "heldout.ap", 0.002))
    assert "| AP across builds |" in rebuilt and "(2 builds)" in rebuilt and "(2 jobs)" not in rebuilt
    assert "COCO AP across separate builds of each engine" in rebuilt and "within the build-to-build noise" in rebuilt
    assert "spread (max - min) is 0.0020 to 0.0020" in rebuilt
    assert "- Quality across builds: 6 engines were each built and evaluated 2 times" in rebuilt
    assert "not the re-evaluation of one engine" in rebuilt and malformed_tables(rebuilt) == []

    tables = artifacts.read_json(GPT_NEO_EVIDENCE, "tables")
    assert "KL across" not in render.render_section(tables)
    rebuilt = render.render_section(_rebuilt(tables, "wikitext.kl_mean", 0.0))
    assert "| KL | KL across builds | KL / fp16's |" in rebuilt and "(build to build)" in rebuilt
    fp8 = next(r for r in tables["quality"] if r["variant"] == "fp8" and r["status"] == "ok")
    kl = render_formats.sci(fp8["wikitext.kl_mean"])
    assert f"| {kl} | {kl} to {kl} (2 builds) |" in rebuilt
    assert malformed_tables(rebuilt) == []


def test_a_numbers_chain_across_builds_walks_every_jobs_file_and_names_its_build():
    """`audit chain` on a range across evaluation jobs: its arithmetic says which jobs and builds, and the
    chain walks the other jobs' files too (quality-r2.json, and through it rebuild-r2/build.json)."""
    from quantstudy import audit_number

    t = _rebuilt(artifacts.read_json(DETR_EVIDENCE, "tables"), "heldout.ap", 0.002)
    row = next(r for r in t["quality"] if r.get("quality_builds"))
    how, others = audit_number.arithmetic(t["quality"], row, "heldout.ap.jobs_min")
    assert others == [row["source"].replace("/quality.json", "/quality-r2.json")]
    assert how.startswith("heldout.ap.jobs_min = the least heldout.ap of 2 evaluation jobs, each on its own build (")
    assert row["quality_builds"][1] in how and how.endswith("build to build")
    del row["quality_builds"]
    how, _ = audit_number.arithmetic(t["quality"], row, "heldout.ap.jobs_max")
    assert how.endswith("2 evaluation jobs, of one engine")
    assert audit_number.arithmetic(t["quality"], row, "heldout.ap") == (None, [])


def _config_with_evaluation(tmp_path, evaluation: str) -> str:
    """The workflow tests' run config with `evaluation: <evaluation>` layered over its study, written in
    `tmp_path`: its path."""
    run = yaml.safe_load(TEST_CONFIG.read_text())
    extra = tmp_path / "evaluation.yaml"
    extra.write_text(f"evaluation: {evaluation}\n")
    fnet = run["studies"]["fnet"]
    run["studies"]["fnet"] = {**fnet, "overrides": [*fnet["overrides"], str(extra)]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run))
    return str(tmp_path / "config.yaml")


def _dry_run_with_evaluation(tmp_path, evaluation: str):
    """A dry run (--forceall) of the workflow tests' study up to its tables, with `evaluation: <evaluation>` layered
    over it; asserts it resolves and returns the finished process."""
    import subprocess
    import sys

    config = _config_with_evaluation(tmp_path, evaluation)
    # The target before --configfile, which takes every word after it as a file.
    proc = subprocess.run([sys.executable, "-m", "snakemake", "results/fnet/tables.json", "-n", "--forceall", "--cores", "1",
                           "--nolock", "--configfile", config], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_detr_readme_gives_the_agreement_spread_and_says_when_ap_cannot_show_build_noise():
    # Random-init weights detect nothing: AP is 0 on every build, so only the agreement metrics can move.
    tables = artifacts.read_json(DETR_EVIDENCE, "tables")
    rebuilt = _rebuilt(_rebuilt(tables, "heldout.ap", 0.0), "heldout.logit_correlation", 2e-6)
    text = render.render_section(rebuilt)
    assert "- Agreement with PyTorch fp32 across the same builds (spread, max - min, over 4 engines):" in text
    assert "logit correlation 2.0e-06," in text
    assert "Every build's AP here is 0 (weights that detect nothing" in text

    for r in rebuilt["quality"]:
        if r.get("heldout.ap.jobs_max") is not None:
            r["heldout.ap.jobs_max"] = r["heldout.ap"] = 0.46
    assert "Every build's AP here is 0" not in render.render_section(rebuilt)
    for r in rebuilt["quality"]:
        for k in [k for k in r if k.startswith(("heldout.logit_correlation.jobs", "heldout.precision.jobs"))]:
            r[k] = None
    assert "Agreement with PyTorch fp32" not in render.render_section(rebuilt)
