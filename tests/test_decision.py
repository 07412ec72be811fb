"""The decision rule is data: each condition reduces a column of the candidate's rows and compares.

Known cases built by hand: threshold boundaries, a missing batch-1 row, a failed candidate
measurement (which must give do-not-ship), a NaN row, and the direction of x.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from quantstudy import timing
from quantstudy import decision

SPEED = {"name": "speedup at batch 1", "table": "speed", "column": "x", "rows": {"batch": 1}, "reduce": "min",
         "compare": ">=", "threshold": 1.15}
TOP1 = {"name": "top-1", "table": "quality", "column": "mlm.top1_agreement", "reduce": "min", "compare": ">=",
        "threshold": 0.99}
NONFINITE = {"name": "non-finite", "table": "quality", "column": "nonfinite", "reduce": "sum", "compare": "==",
             "threshold": 0}


BASELINES = {"w512": "fp16"}  # every row below is of setting w512


def decide(st: dict, tables: dict) -> dict:
    return decision.decide(st, tables, BASELINES)


def study(*conditions) -> dict:
    return {"candidate": "fp8", "decision": {"conditions": list(conditions)}}


def speed(*rows) -> pd.DataFrame:
    return pd.DataFrame([{"variant": v, "batch": b, "x": x, "status": s, "source": f"{v}-{b}-{i}/timing.json"}
                         for i, (v, b, x, s) in enumerate(rows)])


def quality(*rows) -> pd.DataFrame:
    return pd.DataFrame([{"variant": v, "setting": "w512", "mlm.top1_agreement": t, "nonfinite": n, "status": s,
                          "source": f"{v}-{i}/quality.json"} for i, (v, t, n, s) in enumerate(rows)])


GOOD_Q = quality(("fp8", 0.995, 0, "ok"), ("fp16", 0.999, 0, "ok"))


@pytest.mark.parametrize("x,ship", [(1.15, True), (1.1499, False), (1.3, True)])
def test_speedup_threshold_boundary(x, ship):
    d = decide(study(SPEED), {"speed": speed(("fp8", 1, x, "ok"), ("fp8", 1, 2.0, "ok")), "quality": GOOD_Q})
    assert d["ship"] is ship
    assert d["conditions"][0]["observed"] == {"min": x, "max": 2.0, "n": 2}


@pytest.mark.parametrize("top1,ship", [(0.99, True), (0.9899, False)])
def test_quality_threshold_boundary(top1, ship):
    q = quality(("fp8", top1, 0, "ok"), ("fp8", 0.999, 0, "ok"))
    assert decide(study(TOP1), {"speed": speed(), "quality": q})["ship"] is ship


def test_only_the_candidates_rows_count():
    """A slow baseline row does not fail the candidate, and the candidate's own slow row does."""
    s = speed(("fp16", 1, 0.5, "ok"), ("fp8", 1, 1.2, "ok"))
    assert decide(study(SPEED), {"speed": s, "quality": GOOD_Q})["ship"]
    s = speed(("fp8", 1, 1.2, "ok"), ("fp8", 1, 1.0, "ok"))
    assert not decide(study(SPEED), {"speed": s, "quality": GOOD_Q})["ship"]


def test_a_missing_batch1_row_is_not_met():
    d = decide(study(SPEED), {"speed": speed(("fp8", 8, 1.5, "ok")), "quality": GOOD_Q})
    assert not d["ship"]
    assert d["conditions"][0]["observed"] is None and d["conditions"][0]["note"] == "no rows"


def test_a_failed_candidate_measurement_gives_do_not_ship():
    s = speed(("fp8", 1, 1.5, "ok"), ("fp8", 1, None, "failed"))
    d = decide(study(SPEED), {"speed": s, "quality": GOOD_Q})
    assert d["conditions"][0]["pass"]  # the measured row alone meets the threshold...
    assert not d["ship"]  # ...but a failed measurement of the candidate is a condition of its own
    assert d["conditions"][-1]["name"] == "every measurement of the candidate succeeded"
    assert "fp8-1-1/timing.json" in d["conditions"][-1]["note"]


def test_a_damaged_candidate_file_gives_do_not_ship():
    """A candidate's file aggregate could not read is a row of status "damaged" (aggregate_rows.rows_of): no
    more a success than a failed one, whatever the readable rows meet."""
    q = quality(("fp8", 0.995, 0, "ok"), ("fp8", None, None, "damaged"), ("fp16", 0.999, 0, "ok"))
    d = decide(study(TOP1), {"speed": speed(), "quality": q})
    assert d["conditions"][0]["pass"] and not d["ship"]
    assert d["conditions"][-1]["name"] == "every measurement of the candidate succeeded"
    assert d["conditions"][-1]["note"] == "failed: fp8-1/quality.json"


def test_a_nan_row_fails_the_condition():
    q = quality(("fp8", math.nan, 0, "ok"), ("fp8", 0.999, 0, "ok"))
    d = decide(study(TOP1), {"speed": speed(), "quality": q})
    assert not d["ship"] and d["conditions"][0]["note"] == "1 of 2 rows not measured"


def test_sum_of_nonfinite_outputs():
    q = quality(("fp8", 0.999, 0, "ok"), ("fp8", 0.999, 3, "ok"), ("fp16", 0.999, 7, "ok"))
    d = decide(study(NONFINITE), {"speed": speed(), "quality": q})
    assert d["conditions"][0]["observed"] == 3 and not d["ship"]


def test_direction_of_x():
    """x = baseline time / variant time: a faster variant has x > 1."""
    faster = timing.speedup(baseline=[2.0, 2.0, 2.0], variant=[1.0, 1.0, 1.0])
    assert faster["x"] == 2.0 and faster["x_min"] == faster["x_max"] == 2.0
    slower = timing.speedup(baseline=[1.0, 1.0, 1.0], variant=[1.25, 1.25, 1.25])
    assert slower["x"] == 0.8
    d = decide(study(SPEED), {"speed": speed(("fp8", 1, slower["x"], "ok")), "quality": GOOD_Q})
    assert not d["ship"]


def test_x_is_the_ratio_of_the_medians_and_its_range_that_of_the_paired_rounds():
    """Rounds that differ, with one stalled baseline round (9.0): medians 2.2 / 1.1 give x 2.0 (the
    means, 4.4 / 1.1, would give 4.0; the rounds' own ratios have median 2.2). The paired rounds' x
    are 2.0 / 1.1, 2.2 / 1.0 and 9.0 / 1.2: from 1.818 to 7.5."""
    got = timing.speedup(baseline=[2.0, 2.2, 9.0], variant=[1.1, 1.0, 1.2])
    assert got["x"] == pytest.approx(2.0)
    assert got["x_min"] == pytest.approx(2.0 / 1.1) and got["x_max"] == pytest.approx(7.5)


KL_VS_FP16 = {"name": "KL at most 10 x fp16's", "table": "quality", "column": "wikitext.kl", "relative_to": "fp16",
              "reduce": "max", "compare": "<=", "threshold": 10}


def kl(*rows) -> pd.DataFrame:
    return pd.DataFrame([{"variant": v, "target": "t", "model": m, "setting": "s", "wikitext.kl": k, "status": "ok",
                          "source": f"{v}-{m}/quality.json"} for v, m, k in rows])


@pytest.mark.parametrize("fp8_kl,ship", [(0.02, True), (0.0200001, False)])
def test_a_relative_condition_compares_with_the_other_variants_value_on_the_same_row(fp8_kl, ship):
    """fp8's KL over fp16's on the same model: 0.02 / 0.002 = 10 meets "at most 10 x"; a hair more does
    not. The other model's fp16 KL (ten times smaller) must not be the one divided by."""
    q = kl(("fp16", "a", 0.002), ("fp8", "a", fp8_kl), ("fp16", "b", 0.0002), ("fp8", "b", 0.001))
    d = decide(study(KL_VS_FP16), {"speed": speed(), "quality": q})
    assert d["ship"] is ship
    assert d["conditions"][0]["observed"]["max"] == pytest.approx(fp8_kl / 0.002)
    assert d["conditions"][0]["relative_to"] == "fp16"


def test_a_relative_condition_without_the_other_variants_row_is_not_met():
    q = kl(("fp16", "a", 0.002), ("fp8", "a", 0.003), ("fp8", "b", 0.001))
    c = decide(study(KL_VS_FP16), {"speed": speed(), "quality": q})["conditions"][0]
    assert not c["pass"] and c["note"] == "1 of 2 rows not measured"


def test_a_quality_condition_is_also_applied_to_the_baseline():
    """A bar the baseline misses as well is recorded as such: FNet's top-1 agreement >= 0.99 fails
    fp8 at 0.9889 while fp16 scores 0.9889 on the same rows; a speed condition has no baseline (x is
    measured against it)."""
    q = quality(("fp8", 0.9889, 0, "ok"), ("fp8", 0.9968, 0, "ok"), ("fp16", 0.9889, 0, "ok"),
                ("fp16", 0.995, 0, "ok"), ("fp32", 1.0, 0, "ok"))
    top1, fast = decide(study(TOP1, SPEED), {"speed": speed(("fp8", 1, 1.2, "ok")), "quality": q})["conditions"]
    assert not top1["pass"] and top1["n"] == 2
    assert top1["baseline"] == {"variants": ["fp16"], "observed": {"min": 0.9889, "max": 0.995, "n": 2}, "n": 2,
                                "pass": False}
    assert fast["baseline"] is None and fast["n"] == 1
    good = quality(("fp8", 0.99, 0, "ok"), ("fp16", 0.999, 0, "ok"))
    assert decide(study(TOP1), {"speed": speed(), "quality": good})["conditions"][0]["baseline"]["pass"]


AP_DROP_VS_FP16 = {"name": "AP drop against the fp16 engine", "table": "quality", "column": "heldout_vs_fp16.ap_drop",
                   "reduce": "max", "compare": "<=", "threshold": 0.001}


def ap_drop(*rows) -> pd.DataFrame:
    return pd.DataFrame([{"variant": v, "setting": "w512", "heldout_vs_fp16.ap_drop": d, "nonfinite": 0, "status": s,
                          "source": f"{v}-{i}/quality.json"} for i, (v, d, s) in enumerate(rows)])


def test_a_column_measured_against_the_baseline_is_not_applied_to_the_baseline_itself():
    """fp16 is not measured against its own engine (`quality_against: [fp16]`): its rows have no
    AP drop against fp16, which is not "not measured, misses the bar as well". A column it does
    have (non-finite outputs) is still applied to it, and so is the drop where fp16 is not the
    engine measured against."""
    q = ap_drop(("fp8", 0.0004, "ok"), ("fp16", math.nan, "ok"), ("fp32", 0.0, "ok"))
    drop, nonfinite = decide(study(AP_DROP_VS_FP16, NONFINITE) | {"quality_against": ["fp16"]},
                             {"speed": speed(), "quality": q})["conditions"]
    assert drop["pass"] and drop["baseline"] is None
    assert nonfinite["baseline"] == {"variants": ["fp16"], "observed": 0, "n": 1, "pass": True}
    unrelated = decide(study(AP_DROP_VS_FP16) | {"quality_against": ["fp32"]}, {"speed": speed(), "quality": q})
    assert unrelated["conditions"][0]["baseline"] == {"variants": ["fp16"], "observed": None, "n": 0, "pass": False}


# --- each condition's uncertainty: met, not met, or within the noise of this run

def rates(*rows) -> pd.DataFrame:
    """Candidate rows of a rate over n samples: (agreement, n)."""
    return pd.DataFrame([{"variant": "fp8", "setting": "w512", "heldout.top1_agreement": p, "heldout.rows": n,
                          "nonfinite": 0, "status": "ok", "source": f"fp8-{i}/quality.json"}
                         for i, (p, n) in enumerate(rows)])


RATE = {"name": "top-1 over held-out", "table": "quality", "column": "heldout.top1_agreement", "n": "heldout.rows",
        "reduce": "min", "compare": ">=", "threshold": 0.95}


def test_a_rate_whose_wilson_interval_straddles_the_threshold_is_within_the_noise():
    """15 of 16 (93.75%) against 95%: Wilson 95% by hand [0.7167, 0.9889] takes in 0.95. The measured value
    misses the bar (do not ship, as before), but the run cannot tell; 500 of 500 next to it is met."""
    d = decide(study(RATE), {"speed": speed(), "quality": rates((15 / 16, 16), (1.0, 500))})
    [c] = d["conditions"]
    assert c["pass"] is False and c["resolved"] == "within the noise" and d["within_noise"] == [RATE["name"]]
    assert c["interval"]["min"] == pytest.approx(0.7167, abs=1e-4) and c["interval"]["max"] == 1.0
    assert c["interval_kind"] == "Wilson" and c["to_resolve"].endswith("samples a row")
    # the count it names resolves the rate measured, one fewer does not
    from quantstudy.compare import wilson
    needed = int(c["to_resolve"].split()[0])
    assert wilson(round(needed * 15 / 16), needed)[1] < 0.95 <= wilson(round((needed - 1) * 15 / 16), needed - 1)[1]


def test_a_rate_clear_of_the_threshold_is_met_or_not_met():
    assert decide(study(RATE), {"speed": speed(), "quality": rates((1.0, 500))})["conditions"][0]["resolved"] == "met"
    low = decide(study(RATE), {"speed": speed(), "quality": rates((0.5, 500), (1.0, 500))})
    assert low["conditions"][0]["resolved"] == "not met" and low["within_noise"] == []


def x_rows(*rows) -> pd.DataFrame:
    """Candidate speed rows at batch 1 with x's interval: (x, low, high), the rounds' interval the same."""
    return pd.DataFrame([{"variant": "fp8", "batch": 1, "x": x, "x_low": lo, "x_high": hi, "x_rounds_low": x * 0.99,
                          "x_rounds_high": x * 1.01, "status": "ok", "source": f"fp8-{i}/timing.json"}
                         for i, (x, lo, hi) in enumerate(rows)])


def test_an_x_whose_interval_straddles_the_threshold_is_within_the_noise_and_says_how_many_jobs_would_do():
    """x 1.20 in [1.10, 1.31] against 1.15: within the noise. Rounds within 1% (log 0.01005), a job's x moving
    by 3% (sd) between jobs: jobs needed = (1.96 x 0.03)^2 / (log(1.2/1.15)^2 - 0.01005^2) = 0.003457 /
    (0.0018115 - 0.000101) = 2.02, so 3."""
    noise = {"x": 0.03, "ms": 0.03}
    d = decision.decide(study(SPEED), {"speed": x_rows((1.2, 1.10, 1.31)), "quality": GOOD_Q}, BASELINES, noise)
    c = d["conditions"][0]
    assert c["pass"] is True and c["resolved"] == "within the noise" and c["to_resolve"] == "3 timing jobs a row"
    clear = decision.decide(study(SPEED), {"speed": x_rows((1.2, 1.16, 1.25)), "quality": GOOD_Q}, BASELINES, noise)
    assert clear["conditions"][0]["resolved"] == "met" and clear["within_noise"] == []


def test_sums_of_counts_and_columns_without_intervals_are_judged_on_their_values():
    d = decide(study(NONFINITE, TOP1), {"speed": speed(), "quality": GOOD_Q})
    assert [(c["resolved"], c["interval"]) for c in d["conditions"]] == [("met", None), ("met", None)]


def boot(value: float, low: float, high: float, n: int = 100, unit: str = "texts") -> dict:
    return {"low": low, "high": high, "n": n, "unit": unit, "method": "bootstrap", "level": 0.95}


FEATURES = {"name": "feature error", "table": "quality", "column": "features.mean", "reduce": "max", "compare": "<=",
            "threshold": 0.0095}


def features(*rows) -> pd.DataFrame:
    """Candidate rows of a mean with its bootstrap interval: (value, low, high)."""
    return pd.DataFrame([{"variant": "fp8", "setting": "w512", "features.mean": v, "nonfinite": 0, "status": "ok",
                          "source": f"fp8-{i}/quality.json", "intervals": {"features.mean": boot(v, lo, hi)}}
                         for i, (v, lo, hi) in enumerate(rows)])


def test_a_mean_whose_bootstrap_interval_straddles_the_threshold_is_within_the_noise():
    """0.008 in [0.006, 0.010] over 100 texts against at most 0.0095: met on its value, within the noise;
    100 x (0.002 / 0.0015)^2 = 177.8 texts would resolve it. In [0.007, 0.009] it is met."""
    c = decide(study(FEATURES), {"speed": speed(), "quality": features((0.008, 0.006, 0.010))})["conditions"][0]
    assert c["pass"] is True and c["resolved"] == "within the noise"
    assert c["interval_kind"] == "bootstrap over 100 texts" and c["to_resolve"] == "178 texts a row"
    assert (c["interval"]["min"], c["interval"]["max"]) == (0.006, 0.010)
    clear = decide(study(FEATURES), {"speed": speed(), "quality": features((0.008, 0.007, 0.009))})["conditions"][0]
    assert clear["resolved"] == "met"


def test_a_relative_condition_combines_both_engines_intervals_in_log_space():
    """fp8's KL 0.02 in [0.018, 0.022] over fp16's 0.002 in [0.0019, 0.0021]: 10 x. Its interval by hand, the two
    log half-widths in quadrature: below sqrt(log(0.02/0.018)^2 + log(0.0021/0.002)^2) = 0.11611, above
    sqrt(log(0.022/0.02)^2 + log(0.002/0.0019)^2) = 0.10824: [8.9038, 11.1431]. "At most 10.5" is within
    its noise; "at most 12" is met."""
    q = kl(("fp16", "a", 0.002), ("fp8", "a", 0.02))
    q["intervals"] = [{"wikitext.kl": boot(0.002, 0.0019, 0.0021)}, {"wikitext.kl": boot(0.02, 0.018, 0.022)}]
    c = decide(study({**KL_VS_FP16, "threshold": 10.5}), {"speed": speed(), "quality": q})["conditions"][0]
    assert c["resolved"] == "within the noise" and c["pass"] is True
    assert c["interval"]["min"] == pytest.approx(8.9038, abs=1e-4) and c["interval"]["max"] == pytest.approx(11.1431, abs=1e-4)
    clear = decide(study({**KL_VS_FP16, "threshold": 12}), {"speed": speed(), "quality": q})["conditions"][0]
    assert clear["resolved"] == "met"


def revisit_study(*entries) -> dict:
    """fp8 with the max calibration; two variants with their own method, and one NVFP4 variant."""
    return {**study(TOP1), "revisit": list(entries), "variants": {
        "fp16": {"precision": "float16"}, "fp8": {"precision": "float16", "transforms": [{"fp8": {}}]},
        "fp8-mse": {"precision": "float16", "transforms": [{"fp8": {}}], "calibration": {"method": "mse"}},
        "fp8-entropy": {"precision": "float16", "transforms": [{"fp8": {}}], "calibration": {"method": "entropy"}},
        "nvfp4": {"precision": "float16", "transforms": [{"microscaling": {"format": "nvfp4"}}]}}}


CALIBRATED = {"when": "a calibration method keeps top-1 near fp16", "condition": "top-1", "variants": ["calibration_methods"]}


@pytest.mark.parametrize("mse_top1, verdict", [(0.995, "met"), (0.98, "not met")])
def test_a_revisit_check_applies_its_condition_to_each_variant_it_names(mse_top1, verdict):
    """The candidate (fp8) misses the bar; the check passes only where a calibration variant meets it. fp8-entropy
    failed to build: its failure is shown, and it meets nothing."""
    q = quality(("fp8", 0.95, 0, "ok"), ("fp16", 0.999, 0, "ok"), ("fp8-mse", mse_top1, 0, "ok"),
                ("fp8-entropy", None, None, "failed"))
    [check] = decision.revisit(revisit_study(CALIBRATED), {"speed": speed(), "quality": q}, BASELINES)
    assert check["verdict"] == verdict
    by_variant = {v["variant"]: v for v in check["variants"]}
    assert list(by_variant) == ["fp8-mse", "fp8-entropy"]  # the selector's variants; not fp8, not nvfp4
    assert by_variant["fp8-mse"]["condition"]["observed"] == {"min": mse_top1, "max": mse_top1, "n": 1}
    assert not by_variant["fp8-entropy"]["met"] and "fp8-entropy-3/quality.json" in by_variant["fp8-entropy"]["failed"]


def test_a_revisit_check_is_not_measurable_where_none_of_its_variants_ran():
    q = quality(("fp8", 0.999, 0, "ok"), ("fp16", 0.999, 0, "ok"))
    gone = {"when": "FP8 convolutions", "not_measurable": "no backend here quantizes a convolution"}
    checks = decision.revisit(revisit_study(CALIBRATED, gone), {"speed": speed(), "quality": q}, BASELINES)
    assert [(c["verdict"], c["reason"]) for c in checks] == [
        ("not measurable in this run", "none of calibration_methods ran in this run"),
        ("not measurable in this run", "no backend here quantizes a convolution")]
