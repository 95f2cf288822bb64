"""Statistics over per-seed results on hand-computed examples (molt/commands/stats.py)."""

import json
import math
import re

import numpy as np
import pytest
from scipy import stats

from molt.commands.stats import compare, first_reach, seeds_needed, summarize

# The module docstring's example: d = 0.08, Welch t = sqrt(9.6) on df = 50/17.
A = [0.70, 0.74, 0.78]
B = [0.80, 0.82, 0.84]


def test_summarize_gives_mean_bessel_std_and_student_t_interval():
    summary = summarize([1, 2, 3, 4])
    std = math.sqrt(5 / 3)  # squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, over n - 1 = 3
    t_975_3 = 3.182446305284263  # Student t table, 0.975 quantile on 3 degrees of freedom
    assert summary["n"] == 4 and summary["mean"] == 2.5 and summary["values"] == [1, 2, 3, 4]
    assert summary["std"] == pytest.approx(std, abs=1e-15)
    assert summary["sem"] == pytest.approx(std / 2, abs=1e-15)
    assert summary["ci"] == pytest.approx([2.5 - t_975_3 * std / 2, 2.5 + t_975_3 * std / 2], abs=1e-12)


def test_summarize_of_equal_values_has_exact_zero_spread_and_a_point_interval():
    # np.std([0.35] * 3, ddof=1) is 6.8e-17 and np.mean is 0.3499999999999999
    assert summarize([0.35] * 3) == {"n": 3, "mean": 0.35, "std": 0.0, "sem": 0.0, "ci": [0.35, 0.35],
                                     "values": [0.35] * 3}


def test_summarize_of_one_value_has_no_spread_or_interval():
    assert summarize([0.5]) == {"n": 1, "mean": 0.5, "std": None, "sem": None, "ci": None, "values": [0.5]}


def test_welch_p_value_matches_the_hand_computed_t_and_satterthwaite_df():
    var_a, var_b, n = 0.04**2, 0.02**2, 3
    t = 0.08 / math.sqrt(var_a / n + var_b / n)
    df = (var_a / n + var_b / n) ** 2 / ((var_a / n) ** 2 / (n - 1) + (var_b / n) ** 2 / (n - 1))
    assert t == pytest.approx(3.0983866769659336, abs=1e-12)  # sqrt(9.6)
    assert df == pytest.approx(50 / 17, abs=1e-12)
    result = compare(A, B, "accuracy")
    assert result.difference == pytest.approx(0.08, abs=1e-15)
    assert result.p_different == pytest.approx(0.05478676604107648, abs=1e-12)
    assert 2 * stats.t.sf(t, df) == pytest.approx(0.05478676604107648, abs=1e-12)
    assert result.welch_ci == pytest.approx((-0.0031079900636501318, 0.1631079900636503), abs=1e-12)
    assert result.verdict == "inconclusive"


def test_tost_p_value_is_the_larger_one_sided_welch_p_value():
    a, b = [0.70, 0.71, 0.72, 0.73], [0.71, 0.72, 0.73, 0.74]
    result = compare(a, b, "accuracy", margin=0.05)
    # equal spreads and sizes: s^2 = 0.0005 / 3, se^2 = 2 s^2 / 4 = 1/12000, Welch df = 2 (n - 1) = 6;
    # the binding side is H0 d >= 0.05: t = (0.01 - 0.05) / se = -4.3818
    t_high = (0.01 - 0.05) / math.sqrt(1 / 12000)
    assert stats.t.cdf(t_high, 6) == pytest.approx(0.002329607471996967, abs=1e-12)
    assert result.p_equivalent == pytest.approx(0.002329607471996967, abs=1e-12)
    assert result.p_different == pytest.approx(0.31533359620122486, abs=1e-12)
    assert result.verdict == "equivalent"


def test_tost_of_the_docstring_example_is_inconclusive_within_a_tenth():
    result = compare(A, B, "accuracy", margin=0.1)
    assert result.p_equivalent == pytest.approx(0.24802768722926244, abs=1e-12)
    assert result.verdict == "inconclusive"
    assert result.seeds_needed == 43


def test_means_three_standard_deviations_apart_are_different():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.0, 1.0, 10), rng.normal(3.0, 1.0, 10)
    result = compare(list(a), list(b), "score")
    assert result.verdict == "different" and result.seeds_needed is None


def test_two_halves_of_one_sample_are_never_different():
    draws = np.random.default_rng(0).normal(0.0, 1.0, 10)
    result = compare(list(draws[:5]), list(draws[5:]), "score", margin=1.0)
    # five seeds a side cannot show equivalence within one sd for this draw
    assert result.verdict == "inconclusive"
    assert result.seeds_needed == 15


def test_identical_zero_spread_arms_are_equivalent_within_a_margin():
    result = compare([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], "score", margin=0.1)
    assert (result.p_different, result.p_equivalent, result.verdict) == (1.0, 0.0, "equivalent")
    assert result.welch_ci == result.bootstrap_ci == (0.0, 0.0)


def test_unequal_zero_spread_arms_are_different():
    result = compare([0.5, 0.5], [0.6, 0.6], "score", margin=0.05)
    assert (result.p_different, result.p_equivalent, result.verdict) == (0.0, 1.0, "different")


def test_bootstrap_interval_is_deterministic_for_a_seed_and_contains_the_difference():
    first, second = compare(A, B, "accuracy", seed=3), compare(A, B, "accuracy", seed=3)
    assert first.bootstrap_ci == second.bootstrap_ci
    assert first.bootstrap_ci is not None
    assert first.bootstrap_ci[0] <= first.difference <= first.bootstrap_ci[1]


def test_seeds_needed_matches_the_normal_approximation_by_hand():
    sigma = math.sqrt((0.04**2 + 0.02**2) / 2)  # 0.031623
    z_95, z_90, z_975, z_80 = 1.6448536269514722, 1.2815515655446004, 1.959963984540054, 0.8416212335729143
    equivalence = 2 * (z_95 + z_90) ** 2 * sigma**2 / (0.1 - 0.08) ** 2  # 42.82
    difference = 2 * (z_975 + z_80) ** 2 * sigma**2 / 0.08**2  # 2.45
    assert (math.ceil(equivalence), math.ceil(difference)) == (43, 3)
    assert seeds_needed(0.08, sigma, 0.1, 0.95) == 43
    assert seeds_needed(0.08, sigma, None, 0.95) == 3
    assert seeds_needed(0.0, sigma, None, 0.95) is None
    assert seeds_needed(0.08, 0.0, 0.1, 0.95) is None


def test_describe_and_to_dict_report_the_verdict_and_the_seeds_needed():
    result = compare(A, B, "accuracy", margin=0.1)
    text = result.describe()
    assert "p(equivalent within ±0.1) 0.248 (TOST)" in text
    assert "verdict: inconclusive; about 43 seeds per arm would settle it at the observed spread" in text
    assert "equivalent within ±0.05" in compare([0.5, 0.5], [0.5, 0.5], "score", margin=0.05).describe()
    assert json.loads(json.dumps(result.to_dict()))["welch_ci"] == list(result.welch_ci)


def test_first_reach_of_the_value_and_of_the_lower_bound():
    points = [(10.0, 0.5, 0.1), (20.0, 0.7, 0.1), (30.0, 0.8, 0.05), (40.0, 0.9, None)]
    assert first_reach(points, 0.7) == 20.0
    assert first_reach(points, 0.7, lower_bound=True) == 30.0  # 0.7 - 0.1 falls short, 0.8 - 0.05 clears
    assert first_reach(points, 0.9, lower_bound=True) == 40.0  # a None stderr counts as 0
    assert first_reach(points, 0.95) is None


def test_an_arm_with_fewer_than_two_values_is_refused():
    message = "arm B of 'score' needs at least 2 values; got [0.5]; hint: run more seeds"
    with pytest.raises(ValueError, match=re.escape(message)):
        compare([0.5, 0.6], [0.5], "score")


def test_a_nan_value_is_refused():
    with pytest.raises(ValueError, match="values\\[1\\] is NaN"):
        summarize([0.5, float("nan")])
    with pytest.raises(ValueError, match="is NaN"):
        compare([0.5, 0.6], [0.5, float("nan")], "score")


def test_empty_values_are_refused():
    with pytest.raises(ValueError, match="values is empty"):
        summarize([])
