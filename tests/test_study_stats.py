"""bench/study_stats.py: the methods study's bootstrap interval and token-budget interpolation, on
worked examples."""

import numpy as np
import pytest

from bench.study_stats import at_budget, bootstrap_ci, cumulative_tokens


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
