"""Reward terms: their spec (``reward.terms``) and how their values combine into one reward
(``jaxrl.tasks.rewards.combine``), on docs/algorithms.md §13's worked examples and against a
Python loop over groups."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxrl.config import ConfigError, TermSpec, default_configdict, from_configdict, parse_terms
from jaxrl.tasks.rewards.combine import combine_terms

N = math.nan
# docs/algorithms.md §13: two terms over six answers to two questions; None as NaN.
VALUES_KxR = [[1, 0, 1, 0, 1, N], [2, N, 0, 1, N, N]]
WEIGHTS_K = [1.0, 0.5]
GROUPS_R = np.array([0, 0, 0, 1, 1, 1])


def test_terms_spec():
  assert parse_terms("") == ()
  assert parse_terms("verifier, fn:pkg.mod:score*0.5 ,model:/ckpt/rm*-2") == (
    TermSpec("verifier", "", 1.0),
    TermSpec("fn", "pkg.mod:score", 0.5),
    TermSpec("model", "/ckpt/rm", -2.0),
  )
  assert [t.label for t in parse_terms("verifier,fn:a.b:c.d,model:x")] == [
    "verifier",
    "fn_c_d",
    "model",
  ]


@pytest.mark.parametrize(
  "spec, match",
  [
    ("judge:x", "kind 'judge' is not one of"),
    ("verifier*two", "weight 'two' is not a finite number"),
    ("verifier*inf", "not a finite number"),
    ("verifier:x", "the verifier takes no source"),
    ("fn:nomodule", "expected fn:MODULE:FUNCTION"),
    ("model", "expected model:PATH"),
    ("verifier,verifier*2", "the verifier may appear once"),
  ],
)
def test_bad_terms_are_named(spec, match):
  cd = default_configdict()
  cd.reward.terms = spec
  with pytest.raises(ConfigError, match=f"config.reward.terms: .*{match}"):
    from_configdict(cd)


def test_bad_combine_rule_is_named():
  cd = default_configdict()
  cd.reward.combine = "sum"
  with pytest.raises(ConfigError, match="reward.combine"):
    from_configdict(cd)


def test_sum_then_normalise_worked_example():
  rewards_R, applies_R = combine_terms(VALUES_KxR, WEIGHTS_K, GROUPS_R, 2, "sum-then-normalise")
  np.testing.assert_array_equal(rewards_R, [2, 0, 1, 0.5, 1, 0])
  np.testing.assert_array_equal(applies_R, [1, 1, 1, 1, 1, 0])


def test_normalise_then_sum_worked_example():
  rewards_R, applies_R = combine_terms(VALUES_KxR, WEIGHTS_K, GROUPS_R, 2, "normalise-then-sum")
  np.testing.assert_allclose(
    rewards_R, [0.93090, -1.15470, 0.22380, -0.70711, 0.70711, 0], rtol=0, atol=2e-5
  )
  np.testing.assert_array_equal(applies_R, [1, 1, 1, 1, 1, 0])


def _oracle(values_KxR, weights_K, groups_R, rule, eps=1e-6):
  """A Python loop over answers, terms and groups (GRPO's sample std, docs §1.1)."""
  k, r = len(values_KxR), len(groups_R)
  out = np.zeros(r)
  for j in range(r):
    for t in range(k):
      v = values_KxR[t][j]
      if math.isnan(v):
        continue
      if rule == "normalise-then-sum":
        peers = [values_KxR[t][i] for i in range(r) if groups_R[i] == groups_R[j]]
        peers = [p for p in peers if not math.isnan(p)]
        mean = sum(peers) / len(peers)
        if max(peers) == min(peers):
          v = 0.0
        else:
          std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1))
          v = (v - mean) / (std + eps)
      out[j] += weights_K[t] * v
  return out


@pytest.mark.parametrize("rule", ["sum-then-normalise", "normalise-then-sum"])
def test_combine_matches_a_loop(rule):
  rng = np.random.default_rng(0)
  for _ in range(20):
    groups_R = np.sort(rng.integers(0, 4, 24))
    values_KxR = rng.normal(size=(3, 24)) * rng.choice([0.1, 1.0, 10.0], (3, 1))
    values_KxR[rng.random((3, 24)) < 0.3] = math.nan
    values_KxR[1, :6] = np.round(values_KxR[1, :6])  # ties, and constant groups
    weights_K = rng.normal(size=3)
    rewards_R, applies_R = combine_terms(values_KxR, weights_K, groups_R, 4, rule)
    np.testing.assert_array_equal(applies_R, ~np.isnan(values_KxR).all(0))
    want = _oracle(values_KxR.tolist(), weights_K.tolist(), groups_R, rule)
    np.testing.assert_allclose(rewards_R, want, rtol=1e-5, atol=1e-5)


def test_one_term_sum_is_the_term():
  """The verifier alone, weight 1: its rewards unchanged, bit for bit."""
  rewards_R = np.random.default_rng(1).random(16).astype(np.float32)
  got, applies = combine_terms(rewards_R[None], [1.0], np.zeros(16, int), 1, "sum-then-normalise")
  np.testing.assert_array_equal(got, rewards_R)
  assert applies.all()


def test_bad_combine_arguments():
  with pytest.raises(ValueError, match=r"\[K, R\] with K = \(1,\) weights"):
    combine_terms(VALUES_KxR, [1.0], GROUPS_R, 2, "sum-then-normalise")
  with pytest.raises(ValueError, match="rule 'mean' is not one of"):
    combine_terms(VALUES_KxR, WEIGHTS_K, GROUPS_R, 2, "mean")
