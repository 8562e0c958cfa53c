"""95% intervals for scores measured on a handful of prompts (standard library only).

A variant's score and its difference to a baseline on the *same* prompts are both means over a
few samples (3-20 per task and length), so the interval uses Student's t distribution with n - 1
degrees of freedom rather than the normal one. Pairing matters: the difference of two variants on
the same prompts varies much less than either score, so its interval is the one that says whether
a variant keeps the baseline's answers.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz),
    valid where x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the CDF of the Beta(a, b) distribution at x."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (0 < p < 1), by bisection on :func:`t_cdf`."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be within (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class MeanInterval:
    """A mean over ``n`` values and its two-sided interval (None with fewer than two values)."""
    n: int
    mean: float
    low: float | None
    high: float | None

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    def as_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "low": self.low, "high": self.high}


def mean_interval(values: Sequence[float], confidence: float = 0.95,
                  bounds: tuple[float, float] | None = None) -> MeanInterval:
    """The mean of ``values`` with its t interval: mean ± t(1 - (1 - confidence) / 2, n - 1) x
    s / sqrt(n), s the sample standard deviation. Equal values give a zero-width interval.
    ``bounds``: the range the mean cannot leave (a score in [0, 1]); the interval is cut to it."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values")
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return MeanInterval(n, mean, None, None)
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * statistics.stdev(values) / math.sqrt(n)
    low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return MeanInterval(n, mean, low, high)


def paired_difference(candidate: Sequence[float], baseline: Sequence[float], confidence: float = 0.95,
                      bounds: tuple[float, float] | None = None) -> MeanInterval:
    """Mean of candidate[i] - baseline[i] (the same prompt i) with its t interval (cut to
    ``bounds``: [-1, 1] for scores in [0, 1])."""
    if len(candidate) != len(baseline):
        raise ValueError(f"paired scores need equal lengths, got {len(candidate)} and {len(baseline)}")
    return mean_interval([c - b for c, b in zip(candidate, baseline)], confidence, bounds)


# ---------------------------------------------------------------------------------------------
# Paired hits (each prompt a hit or a miss under a reference and under a variant)
# ---------------------------------------------------------------------------------------------

def mcnemar_exact_p(lost: int, gained: int) -> float:
    """McNemar's exact two-sided p: under "the variant loses as often as it gains", the
    ``lost`` of the ``lost + gained`` discordant prompts are Binomial(n, 1/2); the p is twice
    the smaller tail, at most 1 (1 when no prompt changed)."""
    n, k = lost + gained, min(lost, gained)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def wilson_interval(hits: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion ``hits / n``."""
    z = _normal_quantile(1 - (1 - confidence) / 2)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _normal_quantile(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


def newcombe_paired_interval(both: int, lost: int, gained: int, neither: int,
                             confidence: float = 0.95) -> tuple[float, float, float]:
    """(difference, low, high) of reference hit rate - variant hit rate on the same prompts:
    Newcombe's method 10 (Statistics in Medicine 17, 1998), which combines the two hit rates'
    Wilson intervals with the correlation (phi) of the paired outcomes. ``both``: prompts both
    hit; ``lost``: the reference hit, the variant missed; ``gained``: the other way round;
    ``neither``: both missed. It stays within [-1, 1] and is not symmetric about the difference
    (a Wald or t interval on the per-prompt differences is, and leaves [-1, 1] with few prompts).
    With no discordant prompt it is nearly zero-wide (exactly so at a hit rate of 1/2), as any
    paired interval: the count of prompts changed then says more."""
    n = both + lost + gained + neither
    if n == 0:
        raise ValueError("no prompts")
    p1, p2 = (both + lost) / n, (both + gained) / n
    l1, u1 = wilson_interval(both + lost, n, confidence)
    l2, u2 = wilson_interval(both + gained, n, confidence)
    margins = (both + lost) * (gained + neither) * (both + gained) * (lost + neither)
    phi = (both * neither - lost * gained) / math.sqrt(margins) if margins else 0.0
    delta = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    epsilon = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    diff = p1 - p2
    return diff, diff - delta, diff + epsilon
