"""The audit's comparisons on small cases whose answers are known by hand."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from quantstudy import artifacts, audit, audit_checks, audit_number
from quantstudy.audit_checks import one_engine_problems, probes_differ
from quantstudy.reproduce import compare_quality, compare_timing
from quantstudy.timing import timing_noise

from helpers import ROOT, scaled


def _probe(values):
    return {"main": {"last_hidden_state": {"shape": [1, 4], "nonfinite": 0, "l2": 1.0, "values": values}}}


def test_probes_agree_within_the_declared_share_of_their_largest_value():
    a = _probe([1.0, -2.0, 0.5, None])
    assert probes_differ(a, copy.deepcopy(a)) is None
    assert probes_differ(a, _probe([1.0, -2.0, 0.5 + 1e-4, None]), tolerance=1e-3) is None   # 1e-4 <= 2e-3
    assert "0.5 against 0.503" in probes_differ(a, _probe([1.0, -2.0, 0.503, None]), tolerance=1e-3)
    # 0.0015 apart: beyond 1e-3 itself, within 1e-3 of the largest value, 2.0 (a limit not scaled would fail it)
    assert probes_differ(a, _probe([1.0, -2.0, 0.5015, None]), tolerance=1e-3) is None
    # 0.0025 apart: beyond 1e-3 of the largest value 2.0, within 1e-3 of a probe whose largest is 3.0
    assert probes_differ(a, _probe([1.0, -2.0, 0.5025, None]), tolerance=1e-3) is not None
    assert probes_differ(_probe([1.0, -2.0, 0.5, 3.0]), _probe([1.0, -2.0, 0.5025, 3.0]), tolerance=1e-3) is None
    assert "shape or non-finite count" in probes_differ(a, {"main": {"last_hidden_state": {
        **a["main"]["last_hidden_state"], "nonfinite": 1}}})
    assert "in one probe only" in probes_differ(a, {"main": {}})


def test_quality_is_compared_number_by_number_and_provenance_is_not():
    recorded = {"status": "ok", "blocks": {"mlm": {"top1": 0.75, "rows": [1, 2]}}, "provenance": {"started": "a"},
                "content_sha256": "x"}
    same = copy.deepcopy(recorded) | {"provenance": {"started": "b"}, "content_sha256": "y"}
    assert compare_quality(recorded, same, 0.0) == []
    moved = copy.deepcopy(recorded)
    moved["blocks"]["mlm"]["rows"][1] = 3
    assert compare_quality(recorded, moved, 0.0) == [
        {"key": "blocks.mlm.rows.1", "recorded": 2, "reproduced": 3, "tolerance": 0.0}]
    close = copy.deepcopy(recorded)
    close["blocks"]["mlm"]["top1"] = 0.75 * (1 + 1e-6)
    assert compare_quality(recorded, close, 0.0) != [] and compare_quality(recorded, close, 1e-5) == []
    # relative to the value, not absolute: 1e-4 apart is within 1e-5 of 100, not of 0.001
    big = {"blocks": {"ppl": 100.0, "kl": 0.001}}
    moved = {"blocks": {"ppl": 100.0001, "kl": 0.0011}}
    assert [d["key"] for d in compare_quality(big, moved, 1e-5)] == ["blocks.kl"]


def test_a_cpu_quality_number_is_compared_bit_for_bit_and_a_gpus_within_1e_5():
    from quantstudy.reproduce import quality_tolerance

    job = lambda device: {"provenance": {"params": {"target": {"device": device}}}}  # noqa: E731
    assert quality_tolerance(job("cpu")) == 0.0 and quality_tolerance(job("cuda")) == 1e-5


def test_a_reproduce_that_reexecuted_nothing_fails(tmp_path):
    """Every job skipped (here: a damaged record, refused on read) leaves nothing compared: not ok."""
    from quantstudy import reproduce

    study = tmp_path / "results/fnet"
    study.mkdir(parents=True)
    (study / "quality.json").write_text("not JSON")
    report = reproduce.reproduce(study, "config/config.yaml", [str(study / "quality.json")], tmp_path / "scratch")
    assert report["jobs"] == [] and len(report["skipped"]) == 1 and report["ok"] is False
    assert "nothing was re-executed" in reproduce.summary(report)


def _timing(variant, baseline, engine="e", x=None):
    """A timing.json's compared values: each graph's round samples with their median, and x (of the
    medians unless given: a forger's own)."""
    import statistics

    summary = lambda samples: {"median_ms": statistics.median(samples), "samples_ms": samples}  # noqa: E731
    x = statistics.median(baseline) / statistics.median(variant) if x is None else x
    return {"engine_sha256": {"main": engine},
            "graphs": {"main": {"x": x, "variant_ms": summary(variant), "baseline_ms": summary(baseline)}}}


MIN_EFFECT = {"x": 0.05, "ms": 0.10}
QUIET = {"x": 0.02, "ms": 0.03}  # a quiet machine's spread between jobs (sd of log)
# Nine rounds of an engine at 1 ms, within +-1%, and its baseline's at 1.2 ms: x 1.2.
VARIANT = [0.99, 1.0, 1.01, 1.0, 0.995, 1.005, 1.0, 0.99, 1.01]
BASELINE = [1.2 * t for t in [1.0, 1.01, 0.99, 1.0, 1.0, 0.995, 1.005, 1.01, 0.99]]


def test_an_honest_reexecution_agrees_with_its_record():
    """Another job of the same engines: every round 2% slower and x 1% lower, within the noise."""
    recorded = _timing(VARIANT, BASELINE)
    rerun = _timing(scaled(VARIANT, 1.02 * 1.01), scaled(BASELINE, 1.02))
    assert compare_timing(recorded, rerun, MIN_EFFECT, QUIET) == []


def test_a_self_consistent_forgery_beyond_the_noise_is_caught():
    """The variant's rounds all 1.5 times faster, x and medians made to agree with them: x 1.8 recorded,
    1.2 re-executed, 0.667 of the record, far outside its interval (about 0.62 to 0.72 and 1 / 1.05)."""
    forged = _timing(scaled(VARIANT, 1 / 1.5), BASELINE)
    diffs = compare_timing(forged, _timing(VARIANT, BASELINE), MIN_EFFECT, QUIET)
    assert [d["key"] for d in diffs] == ["graphs.main.x", "graphs.main.variant_ms.median_ms"]
    x = diffs[0]["change"]
    assert diffs[0]["recorded"] == pytest.approx(1.8) and diffs[0]["reproduced"] == pytest.approx(1.2)
    assert x["estimate"] == pytest.approx(1 / 1.5) and x["high"] < 1 / 1.05 and x["counts"]


def test_a_forgery_inside_the_spread_between_jobs_is_not_claimed():
    """x 10% better recorded: beyond the minimum effect, but where one job's x moves by 4% (sd) between
    jobs, two jobs are told apart only beyond exp(2.576 x 0.04 x sqrt 2) = 1.157; at 2%, beyond 1.076."""
    forged = _timing(scaled(VARIANT, 1 / 1.1), BASELINE)
    assert compare_timing(forged, _timing(VARIANT, BASELINE), MIN_EFFECT, {"x": 0.04, "ms": 0.04}) == []
    assert compare_timing(forged, _timing(VARIANT, BASELINE), MIN_EFFECT, QUIET) != []


def test_the_records_own_rounds_decide_nothing():
    """A forger who widens the recorded rounds (same medians) gains nothing: the re-executed job's rounds
    are the noise of both."""
    wide = [0.5, 0.6, 0.62, 0.64, 0.667, 0.7, 0.8, 1.0, 1.2]  # median 0.667: x 1.8
    forged = _timing(wide, [1.2] * 9)
    diffs = compare_timing(forged, _timing(VARIANT, BASELINE), MIN_EFFECT, QUIET)
    assert diffs and diffs[0]["key"] == "graphs.main.x"


def test_one_stalled_round_does_not_widen_the_interval():
    """A re-executed job with one round far slower than the rest (a busy machine): its median stands, and
    so does its interval (a resample's median is the stalled round with a chance of 0.15%, under the 0.5%
    either side of a 99% interval). x forged 1.25 times is caught."""
    stalled = _timing(VARIANT, BASELINE[:8] + [3.6])
    forged = _timing(scaled(VARIANT, 1 / 1.25), BASELINE)
    assert [d["key"] for d in compare_timing(forged, stalled, MIN_EFFECT, QUIET)][0] == "graphs.main.x"


def test_timing_ms_are_compared_as_well_as_x():
    """Both medians halved: x stands, the ms do not."""
    diffs = compare_timing(_timing(scaled(VARIANT, 0.5), scaled(BASELINE, 0.5)), _timing(VARIANT, BASELINE),
                           MIN_EFFECT, QUIET)
    assert [(d["key"], round(d["recorded"], 3), round(d["reproduced"], 3)) for d in diffs] == [
        ("graphs.main.variant_ms.median_ms", 0.5, 1.0), ("graphs.main.baseline_ms.median_ms", 0.6, 1.2)]


def test_another_engine_is_a_difference_whatever_its_times():
    diffs = compare_timing(_timing(VARIANT, BASELINE), _timing(VARIANT, BASELINE, engine="f"), MIN_EFFECT, QUIET)
    assert [d["key"] for d in diffs] == ["engine_sha256"]


def test_the_studys_noise_between_jobs_is_pooled_from_its_timings():
    """One baseline timed beside two variants at 1.0 and e^0.2 ms (log sd 0.1414), another beside one
    variant only (no spread to see); no repeats, so x takes the ms spread. With repeats of one variant at
    x e^0.1 and e^-0.1, x has its own: 0.1414."""
    def job(variant, baseline_ms, x=1.0, setting="s"):
        return {"status": "ok", "target": "t", "model": "m", "setting": setting, "variant": variant,
                "baseline": "fp16", "graphs": {"main": {"x": x, "baseline_ms": {"median_ms": baseline_ms}}}}
    docs = [job("fp8", 1.0), job("fp8-b", math.exp(0.2)), job("fp8", 5.0, setting="other")]
    noise = timing_noise(docs)
    assert noise["ms"] == pytest.approx(math.sqrt(0.02)) and noise["ms_dof"] == 1
    assert noise["x"] == noise["ms"] and noise["x_from"] == "the baselines' ms"
    repeated = timing_noise(docs + [job("fp8", 1.0, x=math.exp(0.1)), job("fp8", 1.0, x=math.exp(-0.1), setting="z"),
                                    job("fp8", 1.0, x=math.exp(-0.1))])
    assert repeated["x_from"] == "repeats" and repeated["x_dof"] == 2
    # fp8 at s: x 1.0 (first job), e^0.1 and e^-0.1: logs 0, 0.1, -0.1, sd 0.1
    assert repeated["x"] == pytest.approx(0.1)


def test_probes_are_compared_between_the_jobs_of_one_setting():
    """One engine serving two sizes (`engine:`): its 96x128 evaluation probed other inputs than its 96x96
    timing, so their probes differ and no problem is raised; the 96x96 evaluation's differing probe is one.
    A different engine file is a problem at any setting."""
    job = lambda setting, value, sha="e1": {"setting": setting, "engine_sha256": {"main": sha},  # noqa: E731
                                            "probe": _probe([value, 1.0])}
    timed = [("square/timing.json", job("96x96", 0.5))]
    assert one_engine_problems("build.json", timed, [("wide/quality.json", job("96x128", -0.3))]) == []
    [problem] = one_engine_problems("build.json", timed, [("square/quality.json", job("96x96", -0.3))])
    assert problem.startswith("square/timing.json and square/quality.json got different answers")
    [problem] = one_engine_problems("build.json", timed, [("wide/quality.json", job("96x128", 0.5, sha="e2"))])
    assert "measured different engines of build.json" in problem


def test_a_number_shown_with_its_samples_precision_is_found_in_the_tables():
    """XCiT's top-1 agreement on 16 images is printed 94% (render_formats.pct_of), not 93.75%: the chain finds
    its row either way."""
    from quantstudy import audit_number, render_formats

    tables = {"quality": [{"target": "t", "model": "m", "setting": "s", "variant": "fp8",
                           "heldout.top1_agreement": 15 / 16, "source": "q.json"}]}
    shown = render_formats.pct_of(15 / 16, 16)
    assert shown == "94%"
    hits = audit_number.find_number(tables, shown)
    assert [(h["column"], h["source"]) for h in hits] == [("heldout.top1_agreement", "q.json")]


def test_the_rerun_hint_of_an_evaluation_jobs_rebuild_forces_that_file_not_rule_build():
    """Evaluation job 2 of `evaluation.rebuild` opens rebuild-r2/build.json, made by rule rebuild: the hint
    forces that file; `--forcerun build` would rerun every first build and not this one."""
    rebuild = "r/800x800/fp8/rebuild-r2/build.json"
    quality = {"schema": "quality", "provenance": {"inputs": {"build": {"path": rebuild}}},
               "open_redone": {"main": {"compiling": 1.0}}}
    [problem] = audit_checks.redone_problems("r/800x1067/fp8/quality-r2.json", quality)
    assert problem.endswith(f"rerun it: snakemake --force {rebuild}") and "--forcerun" not in problem
    # The other hints the audit gives name the file too.
    [samples] = audit_checks.redrawn_problems("r/data/heldout.json", {"provenance": {}}, "fnet")
    assert samples.endswith("rerun it: snakemake --force r/data/heldout.json")
    [tables] = audit_checks.rederived_problems("r/tables.json", {"provenance": {"params": {}}})
    assert tables.endswith("rerun it: snakemake --force r/tables.json")


def test_an_opening_that_redid_its_builds_work_is_a_problem():
    """A job whose opening compiled or autotuned again (Runner.open_redone) is named with the engine,
    the work and the build to rerun; nothing redone, or a backend that opens no compiled program, is not."""
    build = {"provenance": {"inputs": {"build": {"path": "r/fp8/build.json"}}}}
    timing = {"schema": "timing", **build, "open_redone": {
        "fp16": {"main": {"compiling": 0.0, "autotuning": 0.0}}, "fp8": {"main": {"compiling": 0.0, "autotuning": 1.5}}}}
    assert audit_checks.redone_problems("r/fp8/timing.json", timing) == [
        "r/fp8/timing.json: opening the fp8 main engine redid work its build should have done (autotuning 1.5 s): "
        "the build's compiled program lacks what this job ran; rerun it: snakemake --force r/fp8/build.json"]
    quality = {"schema": "quality", **build, "open_redone": {"decode": {"compiling": 2.0, "autotuning": 0.0}}}
    [problem] = audit_checks.redone_problems("q.json", quality)
    assert problem.startswith("q.json: opening the decode engine redid work its build should have done (compiling 2 s)")
    for clean in ({"schema": "quality", "open_redone": {"main": {"compiling": 0.0, "autotuning": 0.0}}},
                  {"schema": "quality", "open_redone": {}}, {"schema": "quality"}):
        assert audit_checks.redone_problems("q.json", clean) == []


def test_an_opening_that_redid_work_for_under_a_second_is_a_problem_too():
    """Any redone work means the build's program lacks what the job ran, however quick: 0.2 s of autotuning."""
    timing = {"schema": "timing", "open_redone": {"fp8": {"main": {"compiling": 0.0, "autotuning": 0.2}}}}
    [problem] = audit_checks.redone_problems("t.json", timing)
    assert problem.startswith("t.json: opening the fp8 main engine redid work its build should have done (autotuning 0.2 s)")


def _summary(samples):
    """A timing.json's ms block as the time step records it (timing.summarize), written out by hand."""
    median = sorted(samples)[len(samples) // 2]
    return {"median_ms": median, "min_ms": min(samples), "max_ms": max(samples),
            "spread": (max(samples) - min(samples)) / median, "samples_ms": samples}


def test_the_audit_makes_x_again_from_the_round_samples():
    """Three paired rounds, baseline 2.0 / 2.2 / 9.0 ms and variant 1.1 / 1.0 / 1.2 ms: x is 2.2 / 1.1 (the
    medians), its range 2.0 / 1.1 to 9.0 / 1.2 (the rounds). A record saying so has no problem; one whose
    x, or the top of its range, was edited has one, naming it, while its ms still agree with the samples."""
    base, var = [2.0, 2.2, 9.0], [1.1, 1.0, 1.2]
    graph = {"baseline_ms": _summary(base), "variant_ms": _summary(var), "x": 2.2 / 1.1, "x_min": 2.0 / 1.1,
             "x_max": 9.0 / 1.2}
    assert audit_checks.timing_problems("t.json", {"graphs": {"main": graph}}) == []
    [problem] = audit_checks.timing_problems("t.json", {"graphs": {"main": {**graph, "x": 2.5}}})
    assert problem == f"t.json: graph main's x is 2.5, but its round samples give {2.2 / 1.1!r}"
    [problem] = audit_checks.timing_problems("t.json", {"graphs": {"main": {**graph, "x_max": 9.0}}})
    assert problem.startswith("t.json: graph main's x_max is 9.0, but its round samples give 7.5")


def test_a_sample_list_whose_content_differs_from_its_datasets_is_a_problem(tiny_inputs):
    """The tiny study's calibration list drawn again from its snapshot: as recorded, no problem; with one
    sample's sha256 not its content's (its id unchanged), a problem naming that sample."""
    from quantstudy import artifacts

    path = str(tiny_inputs["calibration"])
    doc = artifacts.read_json(path, "samples")
    assert audit_checks.redrawn_problems(path, doc, "fnet") == []
    edited = copy.deepcopy(doc)
    first = edited["samples"][1]
    first["sha256"] = "0" * 64
    [problem] = audit_checks.redrawn_problems(path, edited, "fnet")
    assert problem.startswith(f"{path}: sample 1 is {first['id']!r} (sha256 000000000000), but drawing the set "
                              f"again from {doc['repo']} at {doc['revision']} gives {first['id']!r} (sha256 ")
    assert problem.endswith("(1 of %d samples differ)" % len(doc["samples"]))


def test_a_checkpoint_whose_snapshot_is_another_commits_is_a_problem(tiny_inputs, tmp_path):
    """The tiny checkpoint.json, as fetched: no problem. The same files in a snapshot folder named for
    another commit (what a cache holds for another revision), recorded with the pinned revision: a problem."""
    import shutil

    from quantstudy import artifacts

    from helpers import rewritten

    doc = artifacts.read_json(tiny_inputs["checkpoint"], "checkpoint")
    assert len(doc["revision"]) == 40 and Path(doc["snapshot"]).name == doc["revision"]
    assert [s.get("problem") for s in audit.walk(tiny_inputs["checkpoint"])] == [None]
    other = "f" * 40
    shutil.copytree(doc["snapshot"], tmp_path / "snapshots" / other)
    moved = rewritten(doc, tmp_path / "checkpoint.json",
                      lambda body: body.update(snapshot=str(tmp_path / "snapshots" / other)))
    [step] = audit.walk(moved)
    assert step["problem"] == f"says revision {doc['revision']}, but its snapshot is commit {other}"


def test_a_job_on_another_card_than_its_targets_is_a_problem():
    """The committed XCiT runs: on 2026-12-04 its timing jobs ran on the H200 the target declares; on
    2026-12-05 the same config's jobs ran on an H100, which the README still called an h200."""
    import json


    job = "results/timm_xcit/h200-torch/xcit-tiny/b1/fp8/timing.json"
    on_h200 = json.loads((ROOT / "results/h200-build-once/xcit" / job).read_text())
    on_h100 = json.loads((ROOT / "results/h200-build-once/xcit-h100" / job).read_text())
    assert audit_checks.card_problems(job, on_h200) == []
    assert audit_checks.card_problems(job, on_h100) == [
        f"{job}: ran on NVIDIA H100 80GB HBM3, but its target h200-torch declares gpu h200: its numbers are not "
        "that card's; rerun it on an h200, or declare the card it ran on in the run config"]
    # A CPU target's job, and a job of no target (a reference), name no card.
    on_cpu = copy.deepcopy(on_h100)
    on_cpu["provenance"]["params"]["target"]["device"] = "cpu"
    assert audit_checks.card_problems(job, on_cpu) == []
    reference = copy.deepcopy(on_h100)
    del reference["provenance"]["params"]["target"]
    assert audit_checks.card_problems(job, reference) == []


def test_the_audit_of_a_study_run_on_another_card_names_every_job_of_it(monkeypatch):
    """check_chain over the committed H100 run's files (engines and weights are not committed, so those
    are missing too): each of its 40 GPU jobs (8 builds with their 8 records, 8 time, 8 profile,
    4 evaluate, 4 gemm) is a problem; the H200 run's, none, and none in the H100 run whose target
    declared that card."""
    from helpers import ROOT

    found = {}
    for run in ("xcit", "xcit-h100", "xcit-h100-declared"):
        monkeypatch.chdir(ROOT / "results/h200-build-once" / run)
        problems = audit.check_chain("results/timm_xcit/tables.json")["problems"]
        found[run] = sorted(p.split(": ")[0] for p in problems if "but its target h200-torch declares gpu " in p)
    assert found["xcit"] == [] and found["xcit-h100-declared"] == []
    assert len(found["xcit-h100"]) == 40
    assert {p.rsplit("/", 1)[1] for p in found["xcit-h100"]} == {
        "build.json", "measurements.json", "timing.json", "kernels.json", "quality.json", "gemm.json"}


def test_a_numbers_chain_names_the_cells_the_page_shows_by_label_with_arithmetic_and_each_files_hash(
        monkeypatch, capsys):
    """Issue 41, item 13, on the committed XCiT H200 run: `audit chain README 0.96` lists the cells the page
    shows as 0.96 (x, its range over rounds, the verdict's smallest x), each row named as the README's
    tables name it; x with its arithmetic from the row's own times; every file with whether its sha256
    still matches what its reader recorded. A cell that formats as 0.96 but that the page never shows is
    not among them."""
    import copy
    import hashlib

    from helpers import ROOT

    monkeypatch.chdir(ROOT / "results/h200-build-once/xcit")
    tables = artifacts.read_json("results/timm_xcit/tables.json", "tables")
    row = next(r for r in tables["speed"] if (r["model"], r["setting"], r["variant"]) == ("xcit-nano", "b1", "fp8"))
    assert f"{row['x']:.2f}" == "0.96"

    unshown = copy.deepcopy(tables)
    next(r for r in unshown["speed"] if r["source"] == row["source"])["x_unshown"] = row["x"]
    hits = audit_number.find_number(unshown, "0.96")
    assert "x_unshown" in [h["column"] for h in hits]
    shown = audit_number.shown_hits(unshown, "results/timm_xcit/README.md", "0.96", hits)
    assert {(h["table"], h["column"]) for h in shown} == {("speed", "x"), ("speed", "x_min"), ("speed", "x_max"),
                                                         ("decision", "observed min")}

    audit.main(["chain", "results/timm_xcit/README.md", "0.96"])
    out = capsys.readouterr().out
    assert f"speed table, row h200-torch | xcit-nano, `b1` | `fp8`, column x = {row['x']!r}, from {row['source']}" in out
    b, v = row["baseline_ms"], row["variant_ms"]
    assert f"  x = baseline_ms / variant_ms = {b:.3f} / {v:.3f} = {b / v:.3f}\n" in out
    assert "the smallest of `x` over the condition's 2 rows of the speed table: h200-torch | xcit-nano, `b1` | `fp8`: x = " in out
    lines = out.splitlines()

    def block(path: str, depth: int) -> list[str]:  # a file's lines in the chain: its own, up to the next file's
        at = lines.index("  " * depth + path)
        end = next((i for i in range(at + 1, len(lines)) if not lines[i].startswith("  " * (depth + 1))
                    or lines[i].endswith(".json")), len(lines))
        return lines[at + 1:end]

    digest = hashlib.sha256(Path(row["source"]).read_bytes()).hexdigest()
    assert f"  sha256 {digest[:12]}: matches what results/timm_xcit/tables.json recorded" in block(row["source"], 0)
    checkpoint = "results/timm_xcit/xcit-nano/checkpoint.json"
    digest = hashlib.sha256(Path(checkpoint).read_bytes()).hexdigest()
    assert f"    sha256 {digest[:12]}: matches what {row['source']} recorded" in block(checkpoint, 1)


def test_a_verdicts_number_is_traced_to_the_rows_and_the_division_it_comes_from(monkeypatch, capsys):
    """The GPT-Neo verdict's "62.0 times" (KL over the fp16 engine's) was "computed by the template": the
    chain names the condition, the candidate's and the fp16 engine's rows with their KL and files, and the
    division; then those files' chains."""
    from helpers import ROOT

    monkeypatch.chdir(ROOT / "results/h200-gpt-neo/gpt_neo")
    tables = artifacts.read_json("results/gpt_neo/tables.json", "tables")
    fp8, fp16 = (next(r for r in tables["quality"] if r["variant"] == v) for v in ("fp8", "fp16"))
    ratio = fp8["wikitext.kl_mean"] / fp16["wikitext.kl_mean"]
    assert f"{ratio:.1f}" == "62.0"
    audit.main(["chain", "results/gpt_neo/README.md", "62.0"])
    out = capsys.readouterr().out
    assert "decision table, row condition 'next-token KL against PyTorch bf16 (every row)', column observed min" in out
    assert (f"h200-torch | gpt-neo-125m, `p256-c256` | `fp8`: wikitext.kl_mean 0.0019 ({fp8['source']}) / fp16's "
            f"3.1e-05 ({fp16['source']}) = {ratio:.4g}") in out
    lines = out.splitlines()
    for source in (fp8["source"], fp16["source"]):
        at = lines.index(source)
        assert any(line.startswith("  sha256 ") and line.endswith(": matches what results/gpt_neo/tables.json recorded")
                   for line in lines[at + 1:at + 5])


def test_gpt_neos_kl_ratio_on_the_page_is_a_cell_of_tables_json():
    """The GPT-Neo page's "times the fp16 engine's" ratios are each quality row's own column
    (decision.with_ratio), not a division in the template: the chain finds the cell the page shows."""
    import json

    import pandas as pd

    from quantstudy import decision

    from helpers import ROOT

    tables = json.loads((ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json").read_text())
    tables["quality"] = artifacts.plain(
        decision.with_ratio(pd.DataFrame(tables["quality"]), "wikitext.kl_mean", "fp16").to_dict("records"))
    fp8 = next(r for r in tables["quality"] if r["variant"] == "fp8")
    shown = f"{fp8['wikitext.kl_mean / fp16']:.1f}"
    hits = audit_number.shown_hits(tables, None, shown, audit_number.find_number(tables, shown))
    assert ("quality", "wikitext.kl_mean / fp16", fp8["source"]) in {(h["table"], h["column"], h["source"]) for h in hits}
    # Its arithmetic names the fp16 row it is divided by, whose file the chain walks too.
    from quantstudy import render_formats

    fp16 = next(r for r in tables["quality"] if r["variant"] == "fp16")
    [cell] = [h for h in hits if h["table"] == "quality"]
    assert cell["arithmetic"] == (f"wikitext.kl_mean / fp16 = {render_formats.sci(fp8['wikitext.kl_mean'])} / fp16's "
                                  f"{render_formats.sci(fp16['wikitext.kl_mean'])} ({fp16['source']}) = "
                                  f"{fp8['wikitext.kl_mean'] / fp16['wikitext.kl_mean']:.4g}")
    assert cell["also_from"] == [fp16["source"]]


def test_a_count_a_decision_observed_is_traced_not_a_crash():
    """A condition that sums (quality-bar failures: 18 in the FNet repeats evidence) records its observed
    value as a number, not {value, n}: `audit chain README 18` finds it and tells whether the page shows it."""
    tables = artifacts.read_json(ROOT / "results/h200-torch-repeats/results/fnet/tables.json", "tables")
    hits = audit_number.find_number(tables, "18")
    decision = [h for h in hits if h["table"] == "decision"]
    assert [h["where"] for h in decision] == [("decision", "conditions", 2, "observed")]
    shown = audit_number.shown_hits(tables, ROOT / "results/h200-torch-repeats/results/fnet/README.md", "18", hits)
    assert [(h["table"], h["column"]) for h in shown] == [("decision", "observed value")]
