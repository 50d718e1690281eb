"""bench/study_stats.py: the methods study's bootstrap interval and token-budget interpolation, on
worked examples."""

import numpy as np
import pytest

from bench.study_stats import at_budget, bootstrap_ci, cumulative_tokens, holm, paired_t


def test_bootstrap_over_seeds_and_questions_matches_the_exact_distribution():
  """Seed A scores questions [1, 0], seed B [1, 1]: the statistic is 0.75. One slot of a replicate
  is 1 with probability 1/2 (B) + 1/8 (A, both draws the first question), 0.5 with 1/4, 0 with
  1/8; the mean of two slots is 0 with probability 1/64 and at most 0.25 with 5/64, so the 2.5th
  percentile is 0.25; it is 1 with probability 25/64, so the 97.5th is 1. Resampling seeds alone
  would never go below 0.5."""
  point, lower, upper = bootstrap_ci([[1, 0], [1, 1]], resamples=20000, seed=0)
  assert (point, lower, upper) == (0.75, 0.25, 1.0)


def test_bootstrap_is_deterministic_in_its_seed_and_degenerate_without_spread():
  rng = np.random.default_rng(1)
  values = [rng.random(7), rng.random(5), rng.random(9)]  # seeds may hold other question counts
  assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
  assert bootstrap_ci(values, seed=3) != bootstrap_ci(values, seed=4)
  point, lower, upper = bootstrap_ci(values)
  assert point == pytest.approx(np.mean([v.mean() for v in values]))
  assert lower < point < upper
  assert bootstrap_ci([[0.5, 0.5], [0.5]]) == (0.5, 0.5, 0.5)


def test_cumulative_tokens_before_each_evaluation():
  # RL steps 1..4 generated 10, 20, 30, 40 tokens; evaluations at the warm start, steps 2 and 4.
  np.testing.assert_array_equal(cumulative_tokens([10, 20, 30, 40], [0, 2, 4]), [0, 30, 100])


def test_at_budget_interpolates_each_question_between_evaluations():
  tokens_E = [0, 100, 300]
  values_ExQ = [[0.2, 0.4], [0.6, 0.4], [1.0, 0.0]]
  # Halfway from 100 to 300 tokens: halfway from [0.6, 0.4] to [1.0, 0.0].
  np.testing.assert_allclose(at_budget(tokens_E, values_ExQ, 200), [0.8, 0.2])
  np.testing.assert_allclose(at_budget(tokens_E, values_ExQ, 25), [0.3, 0.4])
  np.testing.assert_array_equal(at_budget(tokens_E, values_ExQ, 100), [0.6, 0.4])
  np.testing.assert_array_equal(at_budget(tokens_E, values_ExQ, 300), [1.0, 0.0])
  with pytest.raises(ValueError, match="outside"):
    at_budget(tokens_E, values_ExQ, 301)


def test_paired_t_interval_on_a_worked_example():
  """d = [1, 2, 3]: mean 2, sample sd 1, standard error 1/√3; t(0.975, 2 dof) = 4.3027, so the
  half-width is 2.4841; t = 2√3 = 3.4641 gives the two-sided p = 0.0742."""
  mean, lower, upper, p = paired_t([1.0, 2.0, 3.0])
  assert mean == 2.0
  assert (lower, upper) == pytest.approx((2 - 2.48414, 2 + 2.48414), abs=1e-5)
  assert p == pytest.approx(0.07418, abs=1e-5)
  assert np.isnan(paired_t([0.5])[1])  # one seed: no interval
  assert paired_t([0.2, 0.2, 0.2]) == (0.2, 0.2, 0.2, 0.0)  # no spread


def test_paired_t_covers_at_its_level_over_few_seeds():
  """At 5 seeds of normal differences the interval covers the true mean in ~95% of draws (the
  percentile bootstrap over 5 seeds covers far less); 4,000 draws give a standard error of 0.34
  points, so 93.5–96.5% is a ±4.4 s.e. band."""
  rng = np.random.default_rng(0)
  hits = [
    lo <= 0.3 <= hi for lo, hi in (paired_t(rng.normal(0.3, 1.0, 5))[1:3] for _ in range(4000))
  ]
  assert 0.935 <= np.mean(hits) <= 0.965


def test_holm_adjusts_a_worked_family():
  """p = [0.01, 0.04, 0.03, 0.5]: sorted, 4 × 0.01 = 0.04, 3 × 0.03 = 0.09, 2 × 0.04 = 0.08 held
  up to the running maximum 0.09, 1 × 0.5 = 0.5; NaN stays out of the family."""
  np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.5]), [0.04, 0.09, 0.09, 0.5])
  adjusted = holm([0.01, float("nan"), 0.03])
  assert np.isnan(adjusted[1]) and adjusted[0] == pytest.approx(0.02) and adjusted[2] == 0.03
