"""Statistics over per-seed results (one float per seed), for `molt sweep` and `molt compare`.

For arms A and B on one metric, d = mean B - mean A:
  - Welch's t-test (Welch 1947): `p_different` (two-sided), `welch_ci`.
  - Percentile bootstrap of d (Efron & Tibshirani 1993, ch. 13): too narrow with few seeds.
  - TOST, two one-sided Welch tests (Schuirmann 1987): is d inside (-margin, +margin)?

Example, A = [0.70, 0.74, 0.78], B = [0.80, 0.82, 0.84], confidence 0.95, margin 0.1: d = 0.08,
Welch t = 3.0984 on df = 50/17, p_different 0.05479, p_equivalent 0.2480, seeds_needed 43.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy import stats

POWER = 0.8  # 1 - beta for `seeds_needed`
Interval = tuple[float, float]


def summarize(values: Sequence[float], confidence: float = 0.95) -> dict[str, Any]:
    """n, mean, std (ddof=1), sem = std / sqrt(n) and ci = mean -+ t_{(1+confidence)/2, n-1} * sem.

    std, sem and ci are None for n < 2; equal values give std = sem = 0 and ci [mean, mean].

    Raises:
        ValueError: no values, a NaN, or ``confidence`` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1; got {confidence}; "
                         "hint: use 0.95")
    if len(values) == 0:
        raise ValueError("values is empty; got []; hint: give one value per seed")
    for i, value in enumerate(values):
        if math.isnan(value):
            raise ValueError(f"values[{i}] is NaN; got {list(values)}; hint: drop or rerun the "
                             "failed seed")
    n = len(values)
    flat = min(values) == max(values)  # mean and std of equal floats can round away from exact
    mean = float(values[0]) if flat else float(np.mean(values))
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "sem": None, "ci": None, "values": list(values)}
    std = 0.0 if flat else float(np.std(values, ddof=1))
    sem = std / math.sqrt(n)
    ci = [mean, mean] if flat else [float(x) for x in stats.t.interval(confidence, n - 1, loc=mean,
                                                                       scale=sem)]
    return {"n": n, "mean": mean, "std": std, "sem": sem, "ci": ci, "values": list(values)}


@dataclass(frozen=True)
class Comparison:
    """The result of `compare`; ``difference`` d = mean B - mean A."""

    metric: str
    a: dict[str, Any]
    b: dict[str, Any]
    difference: float
    welch_ci: Interval | None
    bootstrap_ci: Interval | None
    p_different: float | None
    margin: float | None
    p_equivalent: float | None
    verdict: str  # "equivalent", "different" or "inconclusive"
    seeds_needed: int | None
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        """Every field, intervals as lists."""
        out = dict(self.__dict__)
        for key in ("welch_ci", "bootstrap_ci"):
            out[key] = None if out[key] is None else list(out[key])
        return out

    def describe(self) -> str:
        """The comparison, for people."""
        level = f"{self.confidence:.0%} CI"
        lines = [f"{self.metric}"]
        for name, arm in (("A", self.a), ("B", self.b)):
            lines.append(f"  {name}: n={arm['n']}  mean {arm['mean']:.4g}  {level} "
                         f"{_fmt(arm['ci'])}")
        lines.append(f"  B - A: {self.difference:+.4g}  Welch {level} {_fmt(self.welch_ci)}"
                     f"  bootstrap {level} {_fmt(self.bootstrap_ci)}")
        p_line = f"  p(different) {self.p_different:.4g} (Welch)"
        if self.margin is not None:
            p_line += f"  p(equivalent within ±{self.margin:g}) {self.p_equivalent:.4g} (TOST)"
        lines.append(p_line)
        verdict = self.verdict
        if verdict == "equivalent":
            verdict = f"equivalent within ±{self.margin:g}"
        if self.seeds_needed is not None:
            verdict += (f"; about {self.seeds_needed} seeds per arm would settle it at the "
                        "observed spread")
        lines.append(f"  verdict: {verdict}")
        return "\n".join(lines)


def _fmt(interval: Sequence[float] | None) -> str:
    return "n/a" if interval is None else f"[{interval[0]:.4g}, {interval[1]:.4g}]"


def _mean_difference(x: np.ndarray, y: np.ndarray, axis: int) -> np.ndarray:
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def _tost(a: np.ndarray, b: np.ndarray, margin: float) -> float:
    """max p of one-sided Welch tests of H0 d <= -margin and of H0 d >= +margin."""
    p_low = stats.ttest_ind(b + margin, a, equal_var=False, alternative="greater").pvalue
    p_high = stats.ttest_ind(b - margin, a, equal_var=False, alternative="less").pvalue
    return float(max(p_low, p_high))


def _welch_bootstrap(a: np.ndarray, b: np.ndarray, confidence: float,
                     seed: int) -> tuple[float, Interval, Interval]:
    """(Welch two-sided p, Welch interval of d, percentile-bootstrap interval of d)."""
    welch = stats.ttest_ind(b, a, equal_var=False)
    low, high = welch.confidence_interval(confidence)
    boot = stats.bootstrap((b, a), _mean_difference, vectorized=True, n_resamples=9999,
                           method="percentile", confidence_level=confidence,
                           rng=np.random.default_rng(seed)).confidence_interval
    return float(welch.pvalue), (float(low), float(high)), (float(boot.low), float(boot.high))


def seeds_needed(difference: float, sigma: float, margin: float | None,
                 confidence: float) -> int | None:
    """Seeds per arm for 80% power at the observed spread (a floor), by the normal approximation
    of Chow, Shao & Wang, "Sample Size Calculations in Clinical Research" (2008), ch. 3.2.

    With alpha = 1 - confidence, beta = 0.2, z_p = norm.ppf(p), d = |difference|, rounded up:
      equivalence (margin, d < margin): 2 (z_{1-alpha} + z_{1-beta/2})^2 sigma^2 / (margin - d)^2
      difference (otherwise):           2 (z_{1-alpha/2} + z_{1-beta})^2 sigma^2 / d^2
    None when sigma or the gap is 0.
    """
    alpha, beta, d = 1.0 - confidence, 1.0 - POWER, abs(difference)
    if margin is not None and d < margin:
        z, gap = stats.norm.ppf(1 - alpha) + stats.norm.ppf(1 - beta / 2), margin - d
    else:
        z, gap = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(1 - beta), d
    return None if sigma == 0.0 or gap == 0.0 else math.ceil(2 * z**2 * sigma**2 / gap**2)


def compare(a: Sequence[float], b: Sequence[float], metric: str, margin: float | None = None,
            confidence: float = 0.95, seed: int = 0) -> Comparison:
    """Compare arm B with arm A on one metric: Welch, bootstrap and (with a margin) TOST.

    verdict: "equivalent" if p_equivalent < alpha = 1 - confidence, else "different" if
    p_different < alpha, else "inconclusive" (with `seeds_needed`). With no spread in either arm:
    p-values 0.0 or 1.0, intervals [d, d]. The bootstrap is deterministic for a seed.

    Raises:
        ValueError: an arm with fewer than 2 values, or a margin not above 0.
    """
    for name, arm in (("A", a), ("B", b)):
        if len(arm) < 2:
            raise ValueError(f"arm {name} of '{metric}' needs at least 2 values; got {list(arm)}; "
                             "hint: run more seeds")
    if margin is not None and not margin > 0:
        raise ValueError(f"margin must be positive; got {margin}; hint: the smallest difference "
                         "that matters")
    sum_a, sum_b = summarize(a, confidence), summarize(b, confidence)
    d = sum_b["mean"] - sum_a["mean"]
    if sum_a["std"] == 0.0 and sum_b["std"] == 0.0:
        p_equivalent = None if margin is None else (0.0 if abs(d) < margin else 1.0)
        p_different, welch_ci, bootstrap_ci = (1.0 if d == 0.0 else 0.0), (d, d), (d, d)
    else:
        x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        p_equivalent = None if margin is None else _tost(x, y, margin)
        p_different, welch_ci, bootstrap_ci = _welch_bootstrap(x, y, confidence, seed)
    alpha = 1.0 - confidence
    equivalent = p_equivalent is not None and p_equivalent < alpha
    verdict = "equivalent" if equivalent else "different" if p_different < alpha else "inconclusive"
    sigma = math.sqrt((sum_a["std"] ** 2 + sum_b["std"] ** 2) / 2)
    needed = seeds_needed(d, sigma, margin, confidence) if verdict == "inconclusive" else None
    if needed is not None:  # the seeds in hand did not settle it: more than those
        needed = max(needed, sum_a["n"] + 1, sum_b["n"] + 1)
    return Comparison(metric, sum_a, sum_b, d, welch_ci, bootstrap_ci, p_different, margin,
                      p_equivalent, verdict, needed, confidence)


def first_reach(points: Sequence[tuple[float, float, float | None]], threshold: float,
                lower_bound: bool = False) -> float | None:
    """Time of the first (time_s, value, stderr) point, in time order, with value >= threshold
    (with lower_bound: value - stderr, a None stderr as 0); None if never."""
    for time_s, value, stderr in points:
        margin = (stderr or 0.0) if lower_bound else 0.0
        if value - margin >= threshold:
            return time_s
    return None
