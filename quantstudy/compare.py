"""One comparison of two measurements, with a noise model: what a verdict, `audit reproduce` and
`quantstudy diff` all decide with.

As asv and pyperf decide, a change between two measurements counts only when it is both
- significant: its interval (at LEVEL) leaves out "no change". The interval is a seeded bootstrap
  of each value's statistic over the samples it was computed from (a timing's rounds), widened by
  the spread between jobs where the values come from separate jobs: two jobs of one engine differ by
  more than their rounds say (another process, another memory layout, the machine's state); and
- larger than a minimum effect: the estimate itself lies beyond it.

A value with no samples (a deterministic metric re-executed on a CPU) is exact: any difference is
significant, and the minimum effect alone decides.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import numpy as np

LEVEL = 0.99  # of every interval: a 1% chance that an honest re-execution is called different
RESAMPLES = 2000
SEED = 0  # bootstrap draws are seeded: the same samples give the same interval on every machine


@dataclass(frozen=True)
class Estimate:
    """A measured value; `replicates`: bootstrap replicates of it (none: exact); `n`: the samples it is
    computed from; `jobs`: how many separate jobs it summarizes."""
    value: float
    replicates: tuple[float, ...] = field(default=(), repr=False)
    n: int = 1
    jobs: int = 1

    def at(self, value: float) -> "Estimate":
        """The same relative noise around another value: a recorded value judged by a re-executed job's
        noise, so that a record's own rounds, which a forger could widen, decide nothing."""
        scale = value / self.value if self.value else 1.0
        return Estimate(value, tuple(r * scale for r in self.replicates), self.n, self.jobs)

    def interval(self, level: float = LEVEL) -> tuple[float, float]:
        """The percentile interval of its replicates (the value itself when exact)."""
        return _percentiles(self.replicates, level) if self.replicates else (self.value, self.value)


def exact(value: float) -> Estimate:
    return Estimate(float(value))


def _bootstrap(columns: Sequence[Sequence[float]], statistic, seed: int) -> tuple[float, ...]:
    """Replicates of `statistic(*columns)`, resampling the rows of the paired columns (a round of a
    timing measures the variant and its baseline side by side: they are resampled together)."""
    rows = len(columns[0])
    if rows < 2:
        return ()
    rng = random.Random(seed)
    draws = []
    for _ in range(RESAMPLES):
        picks = [rng.randrange(rows) for _ in range(rows)]
        draws.append(statistic(*([c[i] for i in picks] for c in columns)))
    return tuple(draws)


def median_of(samples: Sequence[float], seed: int = SEED) -> Estimate:
    """A timing's median ms over its rounds."""
    return Estimate(statistics.median(samples), _bootstrap([samples], statistics.median, seed), len(samples))


def _x(baseline: Sequence[float], variant: Sequence[float]) -> float:
    return statistics.median(baseline) / statistics.median(variant)


def speedup_of(baseline: Sequence[float], variant: Sequence[float], seed: int = SEED) -> Estimate:
    """x = the baseline's median over the variant's, from paired rounds (timing.speedup's x)."""
    return Estimate(_x(baseline, variant), _bootstrap([baseline, variant], _x, seed), len(baseline))


def median_of_jobs(values: Sequence[float], seed: int = SEED) -> Estimate:
    """A value measured by several separate jobs (repeats): their median, resampled over the jobs."""
    return Estimate(statistics.median(values), _bootstrap([values], statistics.median, seed), len(values), len(values))


@dataclass(frozen=True)
class Change:
    """b against a. `kind` "ratio": estimate = b / a, the minimum effect a factor's share either way
    (0.05: beyond 1.05 or below 1 / 1.05); "difference": estimate = b - a, the minimum effect a share
    of the larger magnitude. `significant`: the interval [low, high] leaves out no change."""
    a: float
    b: float
    kind: Literal["ratio", "difference"]
    estimate: float
    low: float
    high: float
    min_effect: float
    significant: bool
    beyond_min_effect: bool
    level: float = LEVEL
    n: tuple[int, int] = (1, 1)

    @property
    def counts(self) -> bool:
        """The change is real and large enough to matter: significant and beyond the minimum effect."""
        return self.significant and self.beyond_min_effect

    @property
    def direction(self) -> Literal["higher", "lower", "same"]:
        """Which way b moved, where the change counts; "same" where it does not."""
        if not self.counts:
            return "same"
        return "higher" if self.estimate > (1.0 if self.kind == "ratio" else 0.0) else "lower"

    def detectable(self) -> float:
        """The smallest change of this kind this comparison counts whatever the noise did (a factor for
        ratios, a share of |a| for differences): beyond the minimum effect and the interval's whole width.
        A change of its half-width is caught only when the noise happens to push the same way."""
        if self.kind == "ratio":
            width = math.log(self.high / self.low) if self.low > 0 else math.inf
            return max(1 + self.min_effect, math.exp(width))
        return max(self.min_effect, (self.high - self.low) / abs(self.a)) if self.a else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "kind": self.kind, "estimate": self.estimate, "low": self.low,
                "high": self.high, "level": self.level, "n": list(self.n), "min_effect": self.min_effect,
                "significant": self.significant, "beyond_min_effect": self.beyond_min_effect,
                "counts": self.counts, "direction": self.direction}


def compare(a: Estimate, b: Estimate, min_effect: float, between_jobs: float = 0.0,
            kind: Literal["ratio", "difference"] = "ratio", level: float = LEVEL) -> Change:
    """The change from a to b and whether it counts (the module docstring's rule).

    `between_jobs`: the relative standard deviation of one job's value across separate jobs of the same
    thing (noise_between_jobs); it widens the interval by z * that * sqrt(1/jobs_a + 1/jobs_b)."""
    if min_effect < 0 or between_jobs < 0:
        raise ValueError(f"a minimum effect and a spread between jobs are not negative ({min_effect}, {between_jobs})")
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    widen = z * between_jobs * math.sqrt(1 / a.jobs + 1 / b.jobs)
    draws = _paired_draws(a, b, kind)
    if kind == "ratio":
        if a.value <= 0 or b.value <= 0:
            raise ValueError(f"a ratio compares positive values, not {a.value} and {b.value}")
        estimate = b.value / a.value
        low, high = _percentiles(draws, level) if draws else (estimate, estimate)
        # widened in log space: a job's share of noise multiplies
        low = estimate * math.exp(-math.hypot(math.log(estimate / low), widen))
        high = estimate * math.exp(math.hypot(math.log(high / estimate), widen))
        significant = low > 1 or high < 1
        beyond = estimate > 1 + min_effect or estimate < 1 / (1 + min_effect)
    elif kind == "difference":
        estimate = b.value - a.value
        low, high = _percentiles(draws, level) if draws else (estimate, estimate)
        scale = max(abs(a.value), abs(b.value))
        low, high = estimate - math.hypot(estimate - low, widen * scale), estimate + math.hypot(high - estimate, widen * scale)
        significant = low > 0 or high < 0
        beyond = abs(estimate) > min_effect * scale
    else:
        raise ValueError(f"kind is ratio or difference, not {kind!r}")
    return Change(a.value, b.value, kind, estimate, low, high, min_effect, significant, beyond, level, (a.n, b.n))


def _paired_draws(a: Estimate, b: Estimate, kind: str) -> tuple[float, ...]:
    """Replicates of the change: each replicate of b against one of a, drawn in a shuffled order (two
    estimates resampled with one seed draw alike; they are independent); an exact side stays at its value."""
    if not a.replicates and not b.replicates:
        return ()
    count = max(len(a.replicates), len(b.replicates))
    ra = a.replicates or (a.value,) * count
    rb = list(b.replicates or (b.value,) * count)
    random.Random(SEED + 1).shuffle(rb)
    if kind == "ratio":
        return tuple(y / x for x, y in zip(ra, rb) if x > 0)
    return tuple(y - x for x, y in zip(ra, rb))


def _percentiles(draws: Sequence[float], level: float) -> tuple[float, float]:
    ordered = sorted(draws)
    lo = ordered[int(math.floor((1 - level) / 2 * (len(ordered) - 1)))]
    hi = ordered[int(math.ceil((1 + level) / 2 * (len(ordered) - 1)))]
    return lo, hi


def noise_between_jobs(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The relative standard deviation of one job's value, pooled over groups of jobs that measured the same
    thing (e.g. one baseline engine timed beside each variant of a setting: one group), and its degrees of
    freedom (0: no group has two jobs, nothing is known). Computed on logs, so a group's scale does not matter."""
    squares, dof = 0.0, 0
    for values in groups:
        logs = [math.log(v) for v in values if v and v > 0]
        if len(logs) >= 2:
            mean = statistics.fmean(logs)
            squares += sum((v - mean) ** 2 for v in logs)
            dof += len(logs) - 1
    return (math.sqrt(squares / dof) if dof else 0.0), dof


def wilson(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a rate of `successes` out of `n` (an agreement rate over n samples)."""
    if n <= 0:
        raise ValueError("a rate needs at least one sample")
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


# A verdict's intervals: the conventional 95% (reproduce's 99% guards against accusing an honest job).
VERDICT_LEVEL = 0.95


def combined_interval(value: float, *intervals: tuple[float, float], between_jobs: float = 0.0, jobs: int = 1,
                      level: float = VERDICT_LEVEL) -> tuple[float, float]:
    """A positive value's interval from independent sources of noise: the intervals of each (e.g. its
    rounds, resampled), and a spread between jobs (sd of log) over `jobs` jobs; half-widths add in
    quadrature in log space."""
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    widen = z * between_jobs / math.sqrt(jobs)
    below = math.sqrt(sum(math.log(value / lo) ** 2 for lo, _ in intervals) + widen ** 2)
    above = math.sqrt(sum(math.log(hi / value) ** 2 for _, hi in intervals) + widen ** 2)
    return value * math.exp(-below), value * math.exp(above)


def mean_interval(values: Sequence[float], clusters: Sequence[int] | None = None, level: float = VERDICT_LEVEL,
                  resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """A mean's seeded percentile bootstrap interval. With `clusters` (one id per value) whole clusters are
    drawn: the tokens of one text vary together, so a text, not a token, is one independent draw, and
    each replicate is its clusters' summed values over their summed counts. An exact mean where there
    are fewer than two clusters."""
    v = np.asarray(values, dtype=np.float64)
    if clusters is None:
        sums, counts = v, np.ones_like(v)
    else:
        _, which = np.unique(np.asarray(clusters), return_inverse=True)
        sums, counts = np.bincount(which, weights=v), np.bincount(which).astype(np.float64)
    k = len(sums)
    mean = float(sums.sum() / counts.sum()) if k else math.nan
    if k < 2:
        return mean, mean
    rng = np.random.default_rng(seed)
    per_draw = max(1, 4_000_000 // k)  # replicates a draw of multinomial weights holds in memory
    draws = []
    for start in range(0, resamples, per_draw):
        weights = rng.multinomial(k, np.full(k, 1.0 / k), size=min(per_draw, resamples - start)).astype(np.float64)
        draws.append(weights @ sums / (weights @ counts))
    return _percentiles(np.concatenate(draws).tolist(), level)


def bootstrap_draws(statistics_of: Callable[[list[int]], dict[str, float]], units: int, resamples: int = 200,
                    seed: int = SEED) -> list[dict[str, float]]:
    """Seeded bootstrap replicates of statistics that are no mean (COCO AP over images): `statistics_of(picks)`
    computes them all on the units at `picks` (indices drawn with replacement), so that statistics of one
    draw stay paired (an engine's AP and the reference's on the same images). Fewer resamples by default:
    each one computes the statistics whole. No replicates where there are fewer than two units."""
    if units < 2:
        return []
    rng = random.Random(seed)
    return [statistics_of([rng.randrange(units) for _ in range(units)]) for _ in range(resamples)]


def percentile_interval(draws: Sequence[float], level: float = VERDICT_LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates."""
    return _percentiles(draws, level)


def units_to_resolve(value: float, interval: tuple[float, float], n: int, threshold: float) -> int | None:
    """How many units (samples, images, texts) a bootstrap interval of `value` over `n` of them would need to
    leave out the threshold, its half-width on the threshold's side shrinking as 1 / sqrt(n). None where
    the value is the threshold."""
    gap = abs(threshold - value)
    half = value - interval[0] if threshold < value else interval[1] - value
    if gap == 0:
        return None
    return max(n + 1, math.ceil(n * (half / gap) ** 2)) if half >= gap else n


def against_threshold(value: float, interval: tuple[float, float] | None, op: str, threshold: float
                      ) -> Literal["met", "not met", "within the noise"]:
    """A measured value against a threshold: met or not where its whole interval is on one side, "within
    the noise" where the interval straddles it (an exact value, interval None, is on one side)."""
    import operator

    test = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}[op]
    low, high = interval or (value, value)
    ends = {test(low, threshold), test(high, threshold)}
    if ends == {True}:
        return "met"
    return "not met" if ends == {False} or op == "==" else "within the noise"


def samples_to_resolve(rate: float, n: int, threshold: float, level: float = VERDICT_LEVEL,
                       limit: int = 10_000_000) -> int | None:
    """How many samples a rate measured as `rate` would need for its Wilson interval to leave out the
    threshold (None: no number of samples would, the rate is the threshold)."""
    if rate == threshold:
        return None

    def resolved(m: int) -> bool:
        low, high = wilson(round(rate * m), m, level)
        return not low <= threshold <= high

    m = max(n, 1)
    while not resolved(m):
        if m > limit:
            return None
        m *= 2
    lo = m // 2
    while lo + 1 < m:  # the smallest m that resolves it, between the last doubling's ends
        mid = (lo + m) // 2
        lo, m = (lo, mid) if resolved(mid) else (mid, m)
    return m


def jobs_to_resolve(value: float, rounds: tuple[float, float], between_jobs: float, threshold: float,
                    level: float = VERDICT_LEVEL) -> int | None:
    """How many timing jobs (repeats) would make x's interval leave out the threshold, the rounds' share of
    the interval kept as it is; None where the rounds alone straddle it (more rounds are needed first)."""
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    gap = abs(math.log(threshold / value))
    half = math.log(value / rounds[0]) if threshold < value else math.log(rounds[1] / value)
    if between_jobs <= 0 or gap <= half:
        return None
    return math.ceil((z * between_jobs) ** 2 / (gap ** 2 - half ** 2))
