"""The audit's comparisons on small cases whose answers are known by hand."""

from __future__ import annotations

import copy

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


def _timing(x, lo, hi, ms=(2.0, 1.9, 2.1), base=(2.2, 2.1, 2.3)):
    """A timing.json's compared values: x and its range, the variant's and the baseline's (median, min, max) ms."""
    summary = lambda m: {"median_ms": m[0], "min_ms": m[1], "max_ms": m[2]}  # noqa: E731
    return {"engine_sha256": {"main": "e"}, "graphs": {"main": {"x": x, "x_min": lo, "x_max": hi,
                                                                "variant_ms": summary(ms), "baseline_ms": summary(base)}}}


TOLERANCE = {"x": 0.05, "ms": 0.10}


def test_timing_x_is_compared_within_the_reexecuted_jobs_range_or_the_study_share():
    """Never within the record's own range: a forger who widens it gains nothing."""
    assert compare_timing(_timing(1.10, 1.08, 1.12), _timing(1.14, 1.13, 1.15), TOLERANCE) == []  # 0.04 <= 0.057
    [d] = compare_timing(_timing(1.10, 0.50, 2.00), _timing(1.20, 1.19, 1.21), TOLERANCE)  # 0.10 > 0.06
    assert d["key"] == "graphs.main.x" and abs(d["tolerance"] - 0.06) < 1e-12
    # the re-executed job's own range, where wider than the study's share: 0.10 <= 0.20
    assert compare_timing(_timing(1.10, 1.09, 1.11), _timing(1.20, 1.10, 1.30), TOLERANCE) == []
    assert compare_timing(_timing(1.1, 1.1, 1.1), {**_timing(1.1, 1.1, 1.1), "engine_sha256": {"main": "f"}},
                          TOLERANCE)[0]["key"] == "engine_sha256"


def test_timing_ms_are_compared_as_well_as_x():
    """Both medians halved: x stands, the ms do not (allowed: the variant's range 0.2, wider than 10% of
    2.0; 10% of the baseline's 2.2, wider than its range 0.2)."""
    diffs = compare_timing(_timing(1.1, 1.0, 1.2, ms=(1.0, 0.99, 1.01), base=(1.1, 1.09, 1.11)),
                           _timing(1.1, 1.0, 1.2), TOLERANCE)
    assert [(d["key"], d["recorded"], d["reproduced"]) for d in diffs] == [
        ("graphs.main.variant_ms.median_ms", 1.0, 2.0), ("graphs.main.baseline_ms.median_ms", 1.1, 2.2)]
    assert abs(diffs[0]["tolerance"] - 0.2) < 1e-12 and abs(diffs[1]["tolerance"] - 0.22) < 1e-12


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
