"""The one comparison (quantstudy/compare.py) on distributions whose answers are known by hand."""

from __future__ import annotations

import pytest

from quantstudy.compare import Estimate, compare, exact, median_of, noise_between_jobs, speedup_of, wilson

from helpers import scaled

# Five rounds of a steady engine: 1 ms within +-1%.
STEADY = [0.99, 1.0, 1.01, 1.0, 0.995]


def test_equal_samples_do_not_differ():
    change = compare(median_of(STEADY), median_of(list(STEADY)), min_effect=0.05)
    assert change.estimate == 1.0 and not change.significant and not change.counts
    assert change.direction == "same" and change.low < 1 < change.high


def test_a_shift_beyond_the_minimum_effect_on_steady_rounds_counts():
    """20% slower, rounds within 1%: the interval is about [1.18, 1.22], well clear of 1 and of 1.05."""
    change = compare(median_of(STEADY), median_of(scaled(STEADY, 1.2)), min_effect=0.05)
    assert change.estimate == pytest.approx(1.2)
    assert change.significant and change.beyond_min_effect and change.counts and change.direction == "higher"
    assert 1.15 < change.low < 1.2 < change.high < 1.25
    faster = compare(median_of(STEADY), median_of(scaled(STEADY, 1 / 1.2)), min_effect=0.05)
    assert faster.counts and faster.direction == "lower"


def test_a_significant_shift_smaller_than_the_minimum_effect_does_not_count():
    """3% slower on rounds within 1%: real (the interval leaves out 1) and too small to matter (< 5%)."""
    change = compare(median_of(STEADY), median_of(scaled(STEADY, 1.03)), min_effect=0.05)
    assert change.significant and not change.beyond_min_effect and not change.counts
    assert change.direction == "same"


def test_a_shift_inside_the_rounds_spread_is_not_significant():
    """20% slower, but each job's rounds spread from 0.5 to 2 ms: the interval takes in 1."""
    wide = [0.5, 0.8, 1.0, 1.4, 2.0]
    change = compare(median_of(wide), median_of(scaled(wide, 1.2)), min_effect=0.05)
    assert change.beyond_min_effect and not change.significant and not change.counts


def test_the_spread_between_jobs_widens_the_interval():
    """20% slower on steady rounds counts; not where one job's value moves by 10% (sd) between jobs:
    z(99%) 2.576 x 0.10 x sqrt(2) = 0.364 in log, wider than log 1.2 = 0.182."""
    a, b = median_of(STEADY), median_of(scaled(STEADY, 1.2))
    assert compare(a, b, 0.05).counts
    noisy = compare(a, b, 0.05, between_jobs=0.10)
    assert not noisy.significant and not noisy.counts and noisy.low < 1
    # the same spread over 8 jobs a side: sqrt(1/8 + 1/8) = 0.5 of it, 0.129 < 0.182
    many = compare(Estimate(a.value, a.replicates, 5, jobs=8), Estimate(b.value, b.replicates, 5, jobs=8), 0.05, 0.10)
    assert many.counts


def test_exact_values_differ_by_the_minimum_effect_alone():
    """No samples (a deterministic metric): any difference is significant; a relative share decides."""
    assert not compare(exact(0.75), exact(0.75), 0.0, kind="difference").counts
    assert compare(exact(0.75), exact(0.75 * (1 + 1e-6)), 0.0, kind="difference").counts
    assert not compare(exact(0.75), exact(0.75 * (1 + 1e-6)), 1e-5, kind="difference").counts
    # relative to the larger magnitude, not absolute: 1e-4 apart near 100 is within 1e-5 of 100 (1e-3) ...
    assert not compare(exact(100.0), exact(100.0001), 1e-5, kind="difference").counts
    # ... and near 0.001 it is not (1e-5 x 0.0011 = 1.1e-8)
    assert compare(exact(0.001), exact(0.0011), 1e-5, kind="difference").counts


def test_x_is_resampled_by_paired_rounds():
    """A round measures the variant and its baseline side by side; resampling keeps them together, so a
    machine that slows both alike moves x by nothing. Rounds 1, 2, 4 ms for the baseline and 0.5, 1, 2 ms
    for the variant: every resample's x is 2 exactly."""
    x = speedup_of([1.0, 2.0, 4.0], [0.5, 1.0, 2.0])
    assert x.value == 2.0 and x.interval() == (2.0, 2.0)


def test_the_bootstrap_interval_of_a_median_by_hand():
    """Two rounds, 1 and 3 ms: a resample's median is 1 (1/4), 2 (1/2) or 3 (1/4). The 99% interval is
    [1, 3]; a 40% interval (the 30th to the 70th percentile) is [2, 2]."""
    m = median_of([1.0, 3.0])
    assert m.value == 2.0 and set(m.replicates) == {1.0, 2.0, 3.0}
    assert m.interval(0.99) == (1.0, 3.0) and m.interval(0.40) == (2.0, 2.0)
    share = m.replicates.count(2.0) / len(m.replicates)
    assert 0.45 < share < 0.55


def test_the_wilson_interval_by_hand():
    """8 of 10 at 95% (z = 1.95996): centre (0.8 + z^2/20) / (1 + z^2/10) = 0.71674, half-width
    z / (1 + z^2/10) x sqrt(0.016 + z^2/400) = 0.22658; and 10 of 10 reaches 1 exactly."""
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4) and high == pytest.approx(0.94332, abs=1e-4)
    low, high = wilson(10, 10)
    assert high == 1.0 and low == pytest.approx(0.72246, abs=1e-4)  # 1 / (1 + z^2/10)
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_the_noise_between_jobs_pools_groups_on_logs():
    """Two groups of jobs, e^0.1 and e^-0.1 times their geometric mean: each log deviation 0.1, one
    degree of freedom per group, so the pooled sd is sqrt(4 x 0.01 / 2) = 0.1414, at any scale."""
    import math

    groups = [[math.exp(0.1), math.exp(-0.1)], [5 * math.exp(0.1), 5 * math.exp(-0.1)], [7.0]]
    sd, dof = noise_between_jobs(groups)
    assert dof == 2 and sd == pytest.approx(math.sqrt(0.02))
    assert noise_between_jobs([[1.0], [2.0]]) == (0.0, 0)


def test_detectable_is_the_larger_of_the_minimum_effect_and_the_intervals_width():
    steady = compare(median_of(STEADY), median_of(STEADY), 0.05)
    assert steady.detectable() == pytest.approx(1.05)
    noisy = compare(median_of(STEADY), median_of(STEADY), 0.05, between_jobs=0.10)
    # the whole width: exp(2 x 2.576 x 0.1 x sqrt 2) = 2.07 (the rounds' share, within 1%, is small beside it)
    assert noisy.detectable() == pytest.approx(2.07, abs=0.03)


class SleepingRunner:
    """A runner whose call sleeps `ms`: the timing harness's contract (replay, synchronize) and nothing else."""

    def __init__(self, ms: float):
        self.ms, self.calls = ms, 0

    def replay(self):
        import time

        time.sleep(self.ms / 1e3)
        self.calls += 1

    def synchronize(self):
        pass


def test_rounds_shorter_than_the_minimum_make_more_calls():
    """A 1 ms call and a 2 ms one with rounds of at least 10 ms: every round makes the calls that fill 10 ms
    for the faster (about 10, fewer if a sleep overshoots), the same count for both, and records it."""
    from quantstudy.timing import time_interleaved

    fast, slow = SleepingRunner(1.0), SleepingRunner(2.0)
    result = time_interleaved({"fast": fast, "slow": slow}, warmup=1, rounds=3, calls=1, min_round_ms=10.0)
    calls = result["fast"]["calls_per_round"]
    assert 4 <= calls <= 10 and result["slow"]["calls_per_round"] == calls
    assert all(ms * calls >= 4.0 for ms in result["fast"]["samples_ms"])  # each round several ms, not one call
    assert fast.calls == 1 + 1 + calls + 3 * calls  # warm-up, the one call that calibrates, a round's worth, rounds
    plain = time_interleaved({"fast": SleepingRunner(1.0)}, warmup=1, rounds=3, calls=1)
    assert plain["fast"]["calls_per_round"] == 1


def test_a_mean_resamples_whole_clusters():
    """Tokens 1, 1, 1 of text A and 4 of text B. Drawing texts, a replicate is A+A (mean 1), A+B (7/4) or
    B+B (4): the 95% interval is [1, 4]. Drawing the four tokens one by one, three or more 4s out of four
    draws has chance 4 (1/4)^3 (3/4) + (1/4)^4 = 0.051 > 0.025, four 4s 0.004: the upper end is 13/4."""
    from quantstudy.compare import mean_interval

    assert mean_interval([1, 1, 1, 4], [0, 0, 0, 1]) == (1.0, 4.0)
    low, high = mean_interval([1, 1, 1, 4])
    assert low == 1.0 and high == 3.25


def test_a_means_interval_on_a_normal_sample_is_about_1_96_standard_errors():
    """2000 draws of N(0, 1): the 95% interval of their mean is their mean +- 1.96 / sqrt(2000) = 0.0438."""
    import numpy as np

    from quantstudy.compare import mean_interval

    values = np.random.default_rng(1).standard_normal(2000)
    low, high = mean_interval(values.tolist())
    assert (high - low) / 2 == pytest.approx(1.96 / 2000 ** 0.5, rel=0.1)
    assert low < values.mean() < high
    assert mean_interval([5.0]) == (5.0, 5.0)  # one unit: exact


def test_units_to_resolve_shrinks_the_half_width_as_one_over_sqrt_n():
    """0.008 in [0.006, 0.010] over 100 texts against at most 0.0095: the half-width toward the threshold,
    0.002, must fall below the gap, 0.0015: 100 x (0.002 / 0.0015)^2 = 177.8, so 178 texts."""
    from quantstudy.compare import units_to_resolve

    assert units_to_resolve(0.008, (0.006, 0.010), 100, 0.0095) == 178
    assert units_to_resolve(1.0, (0.5, 1.25), 100, 0.75) == 400  # toward the low end: (0.5 / 0.25)^2 = 4
    assert units_to_resolve(1.0, (0.9, 1.25), 100, 0.75) == 100  # resolved already
    assert units_to_resolve(0.0095, (0.009, 0.010), 100, 0.0095) is None
