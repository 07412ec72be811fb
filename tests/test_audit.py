"""The audit's comparisons on small cases whose answers are known by hand."""

from __future__ import annotations

import copy
from pathlib import Path

from quantstudy import audit
from quantstudy.audit import one_engine_problems, probes_differ
from quantstudy.reproduce import compare_quality, compare_timing


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


def _timing(x, variant, baseline, engine="e"):
    """A timing.json's compared values: x, and each graph's round samples with their median."""
    summary = lambda samples: {"median_ms": sorted(samples)[len(samples) // 2], "samples_ms": samples}  # noqa: E731
    return {"engine_sha256": {"main": engine},
            "graphs": {"main": {"x": x, "variant_ms": summary(variant), "baseline_ms": summary(baseline)}}}


TOLERANCE = {"x": 0.05, "ms": 0.10}
STEADY = [1.0] * 5  # a variant's rounds, all alike: x is the baseline's round over 1.0


def test_timing_x_is_compared_within_the_reexecuted_jobs_middle_spread_or_the_study_share():
    """Never within the record's own spread: a forger who widens it gains nothing."""
    rerun = _timing(1.14, STEADY, [1.13, 1.14, 1.14, 1.14, 1.15])
    assert compare_timing(_timing(1.10, STEADY, [0.5, 1.0, 1.1, 1.5, 2.0]), rerun, TOLERANCE) == []  # 0.04 <= 0.057
    [d] = compare_timing(_timing(1.10, STEADY, [0.5, 1.0, 1.1, 1.5, 2.0]), _timing(1.20, STEADY, [1.2] * 5), TOLERANCE)
    assert d["key"] == "graphs.main.x" and abs(d["tolerance"] - 0.06) < 1e-12  # 0.10 > 5% of 1.20
    # the re-executed job's middle spread, where wider than the study's share: rounds' x 1.1 to 1.3, 0.10 <= 0.20
    wide = [1.0, 1.1, 1.2, 1.3, 1.4]
    assert compare_timing(_timing(1.10, STEADY, wide), _timing(1.20, STEADY, wide), TOLERANCE) == []
    # ... of the rounds' x, baseline over variant: 2.0 to 4.0 here, so 1.5 from 3.0 is within (their inverses
    # spread 0.25 to 0.5, which would not allow it)
    steps = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert compare_timing(_timing(1.5, STEADY, steps), _timing(3.0, STEADY, steps), TOLERANCE) == []
    assert compare_timing(_timing(1.1, STEADY, wide), _timing(1.1, STEADY, wide, engine="f"),
                          TOLERANCE)[0]["key"] == "engine_sha256"


def test_one_stalled_round_does_not_widen_the_tolerance():
    """A re-executed job with one round far slower than the rest (a busy machine): its median stands, and
    so does the tolerance around it. Rounds' x 1.19 to 3.0, middle 1.2 to 1.2: x 1.5 recorded is 0.3 from
    1.2, beyond 5% (0.06); a variant recorded at 0.25 ms against 1.0 is beyond 10% (0.1)."""
    rerun = _timing(1.2, STEADY, [1.19, 1.2, 1.2, 1.2, 3.0])
    [d] = compare_timing(_timing(1.5, STEADY, [1.19, 1.2, 1.2, 1.2, 3.0]), rerun, TOLERANCE)
    assert (d["key"], d["recorded"], d["reproduced"]) == ("graphs.main.x", 1.5, 1.2)
    assert abs(d["tolerance"] - 0.06) < 1e-12
    rerun = _timing(1.2, [1.0, 1.0, 1.0, 1.0, 5.0], [1.2] * 5)
    forged = _timing(1.2, [0.25] * 5, [1.2] * 5)
    diffs = compare_timing(forged, rerun, TOLERANCE)
    assert [(d["key"], d["recorded"], d["reproduced"]) for d in diffs] == [("graphs.main.variant_ms.median_ms", 0.25, 1.0)]
    assert abs(diffs[0]["tolerance"] - 0.1) < 1e-12


def test_timing_ms_are_compared_as_well_as_x():
    """Both medians halved: x stands, the ms do not (allowed: 10% of the variant's 2.0, wider than its
    middle spread 0.1; the baseline's middle spread 0.3, wider than 10% of its 2.2)."""
    variant, baseline = [1.9, 1.95, 2.0, 2.05, 2.1], [1.9, 2.05, 2.2, 2.35, 2.5]
    halved = lambda samples: [t / 2 for t in samples]  # noqa: E731
    diffs = compare_timing(_timing(1.1, halved(variant), halved(baseline)), _timing(1.1, variant, baseline), TOLERANCE)
    assert [(d["key"], d["recorded"], d["reproduced"]) for d in diffs] == [
        ("graphs.main.variant_ms.median_ms", 1.0, 2.0), ("graphs.main.baseline_ms.median_ms", 1.1, 2.2)]
    assert abs(diffs[0]["tolerance"] - 0.2) < 1e-12 and abs(diffs[1]["tolerance"] - 0.3) < 1e-12


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
    """XCiT's top-1 agreement on 16 images is printed 94% (render.pct_of), not 93.75%: the chain finds
    its row either way."""
    from quantstudy import audit, render

    tables = {"quality": [{"target": "t", "model": "m", "setting": "s", "variant": "fp8",
                           "heldout.top1_agreement": 15 / 16, "source": "q.json"}]}
    shown = render.pct_of(15 / 16, 16)
    assert shown == "94%"
    hits = audit.find_number(tables, shown)
    assert [(h["column"], h["source"]) for h in hits] == [("heldout.top1_agreement", "q.json")]


def test_an_opening_that_redid_its_builds_work_is_a_problem():
    """A job whose opening compiled or autotuned again (Runner.open_redone) is named with the engine,
    the work and the build to rerun; nothing redone, or a backend that opens no compiled program, is not."""
    build = {"provenance": {"inputs": {"build": {"path": "r/fp8/build.json"}}}}
    timing = {"schema": "timing", **build, "open_redone": {
        "fp16": {"main": {"compiling": 0.0, "autotuning": 0.0}}, "fp8": {"main": {"compiling": 0.0, "autotuning": 1.5}}}}
    assert audit.redone_problems("r/fp8/timing.json", timing) == [
        "r/fp8/timing.json: opening the fp8 main engine redid work its build should have done (autotuning 1.5 s): "
        "the build's compiled program lacks what this job ran; rerun it: snakemake --forcerun build r/fp8/build.json"]
    quality = {"schema": "quality", **build, "open_redone": {"decode": {"compiling": 2.0, "autotuning": 0.0}}}
    [problem] = audit.redone_problems("q.json", quality)
    assert problem.startswith("q.json: opening the decode engine redid work its build should have done (compiling 2 s)")
    for clean in ({"schema": "quality", "open_redone": {"main": {"compiling": 0.0, "autotuning": 0.0}}},
                  {"schema": "quality", "open_redone": {}}, {"schema": "quality"}):
        assert audit.redone_problems("q.json", clean) == []


def test_an_opening_that_redid_work_for_under_a_second_is_a_problem_too():
    """Any redone work means the build's program lacks what the job ran, however quick: 0.2 s of autotuning."""
    timing = {"schema": "timing", "open_redone": {"fp8": {"main": {"compiling": 0.0, "autotuning": 0.2}}}}
    [problem] = audit.redone_problems("t.json", timing)
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
    assert audit.timing_problems("t.json", {"graphs": {"main": graph}}) == []
    [problem] = audit.timing_problems("t.json", {"graphs": {"main": {**graph, "x": 2.5}}})
    assert problem == f"t.json: graph main's x is 2.5, but its round samples give {2.2 / 1.1!r}"
    [problem] = audit.timing_problems("t.json", {"graphs": {"main": {**graph, "x_max": 9.0}}})
    assert problem.startswith("t.json: graph main's x_max is 9.0, but its round samples give 7.5")


def test_a_sample_list_whose_content_differs_from_its_datasets_is_a_problem(tiny_inputs):
    """The tiny study's calibration list drawn again from its snapshot: as recorded, no problem; with one
    sample's sha256 not its content's (its id unchanged), a problem naming that sample."""
    from quantstudy import artifacts

    path = str(tiny_inputs["calibration"])
    doc = artifacts.read_json(path, "samples")
    assert audit.redrawn_problems(path, doc, "fnet") == []
    edited = copy.deepcopy(doc)
    first = edited["samples"][1]
    first["sha256"] = "0" * 64
    [problem] = audit.redrawn_problems(path, edited, "fnet")
    assert problem.startswith(f"{path}: sample 1 is {first['id']!r} (sha256 000000000000), but drawing the set "
                              f"again from {doc['repo']} at {doc['revision']} gives {first['id']!r} (sha256 ")
    assert problem.endswith("(1 of %d samples differ)" % len(doc["samples"]))


def test_a_checkpoint_whose_snapshot_is_another_commits_is_a_problem(tiny_inputs, tmp_path):
    """The tiny checkpoint.json, as fetched: no problem. The same files in a snapshot folder named for
    another commit (what a cache holds for another revision), recorded with the pinned revision: a problem."""
    import shutil

    from quantstudy import artifacts

    from conftest import rewritten

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

    from conftest import ROOT

    job = "results/timm_xcit/h200-torch/xcit-tiny/b1/fp8/timing.json"
    on_h200 = json.loads((ROOT / "results/h200-build-once/xcit" / job).read_text())
    on_h100 = json.loads((ROOT / "results/h200-build-once/xcit-h100" / job).read_text())
    assert audit.card_problems(job, on_h200) == []
    assert audit.card_problems(job, on_h100) == [
        f"{job}: ran on NVIDIA H100 80GB HBM3, but its target h200-torch declares gpu h200: its numbers are not "
        "that card's; rerun it on an h200, or declare the card it ran on in the run config"]
    # A CPU target's job, and a job of no target (a reference), name no card.
    on_cpu = copy.deepcopy(on_h100)
    on_cpu["provenance"]["params"]["target"]["device"] = "cpu"
    assert audit.card_problems(job, on_cpu) == []
    reference = copy.deepcopy(on_h100)
    del reference["provenance"]["params"]["target"]
    assert audit.card_problems(job, reference) == []


def test_the_audit_of_a_study_run_on_another_card_names_every_job_of_it(monkeypatch):
    """check_chain over the committed H100 run's files (engines and weights are not committed, so those
    are missing too): each of its 40 GPU jobs (8 builds with their 8 records, 8 time, 8 profile,
    4 evaluate, 4 gemm) is a problem; the H200 run's, none, and none in the H100 run whose target
    declared that card."""
    from conftest import ROOT

    found = {}
    for run in ("xcit", "xcit-h100", "xcit-h100-declared"):
        monkeypatch.chdir(ROOT / "results/h200-build-once" / run)
        problems = audit.check_chain("results/timm_xcit/tables.json")["problems"]
        found[run] = sorted(p.split(": ")[0] for p in problems if "but its target h200-torch declares gpu " in p)
    assert found["xcit"] == [] and found["xcit-h100-declared"] == []
    assert len(found["xcit-h100"]) == 40
    assert {p.rsplit("/", 1)[1] for p in found["xcit-h100"]} == {
        "build.json", "measurements.json", "timing.json", "kernels.json", "quality.json", "gemm.json"}
