"""Reward terms: their spec (``reward.terms``) and how their values combine into one reward
(``jaxrl.tasks.rewards.combine``), on docs/algorithms.md §13's worked examples and against a
Python loop over groups."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from run_helpers import step_context, tiny_config

from jaxrl.config import ConfigError, TermSpec, default_configdict, from_configdict, parse_terms
from jaxrl.run.components import task_sections
from jaxrl.run.loop import initial_loop, rl_step
from jaxrl.tasks.rewards.combine import combine_terms
from jaxrl.tasks.rewards.pool import VerifyResult
from jaxrl.tasks.rewards.terms import CallableTerm, build_terms, term_means
from jaxrl.tasks.task import check_inputs

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
    ("critic:x", "kind 'critic' is not one of"),
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


# --- the terms at run time -----------------------------------------------------------------------


def _terms(spec, rule="sum-then-normalise"):
  cd = default_configdict()
  cd.reward.terms, cd.reward.combine = spec, rule
  return build_terms(task_sections(from_configdict(cd)))


def _verified(rewards_R, scored_R):
  n = len(rewards_R) - int(np.sum(scored_R))
  return VerifyResult(np.asarray(rewards_R, np.float32), n, 0, 0, 0, None, np.asarray(scored_R))


def test_no_terms_is_the_verifier_alone():
  assert _terms("") is None


def test_callable_terms_sync_and_async_with_none():
  terms = _terms("fn:reward_fns:trl_length*2, fn:reward_fns:trl_async_match")
  assert not terms.uses_verifier
  completions, answers = ["12", "", "3", "xyz"], ["12", "1", "4", "xyz"]
  got = terms.score(["p"] * 4, completions, answers, None, np.array([0, 0, 1, 1]), 2)
  # lengths/10 ×2: [0.4, None, 0.2, 0.6]; matches: [1, 0, 0, 1]
  np.testing.assert_allclose(got.rewards_R, [1.4, 0.0, 0.2, 1.6], rtol=1e-6)
  np.testing.assert_array_equal(got.kept_R, [1, 1, 1, 1])
  means = term_means(got.metrics)
  assert means["reward_term_fn_trl_length"] == pytest.approx(0.2)  # its values, before its weight
  assert means["reward_term_fn_trl_length_applies"] == 0.75
  assert means["reward_term_fn_trl_async_match"] == 0.5
  assert not any(k.endswith(("_sum", "_n", "_rows")) for k in means)


def test_verifier_failure_and_no_applicable_term_set_the_answer_aside():
  terms = _terms("verifier, fn:reward_fns:trl_length*0.5")
  verified = _verified([1, 0, 0, 1], [True, False, True, True])
  got = terms.score(["p"] * 4, ["ab", "abcd", "", "x"], ["a"] * 4, verified, np.zeros(4, int), 1)
  # row 1: the verifier failed (set aside whatever the length says); row 2: verifier 0 applies
  np.testing.assert_array_equal(got.kept_R, [1, 0, 1, 1])
  np.testing.assert_allclose(got.rewards_R, [1.1, 0.0, 0.0, 1.05], rtol=1e-6)
  means = term_means({**got.metrics, "verify_errors": 1.0})
  assert means["reward_term_verifier"] == pytest.approx(2 / 3)
  assert means["reward_term_verifier_applies"] == 0.75
  assert means["verify_errors"] == 1.0
  only = _terms("fn:reward_fns:trl_length")
  got = only.score(["p"] * 2, ["", "ab"], ["a"] * 2, None, np.zeros(2, int), 1)
  np.testing.assert_array_equal(got.kept_R, [0, 1])


def test_counters_add_over_rounds_before_the_mean():
  terms = _terms("fn:reward_fns:trl_length")
  a = terms.score(["p"], ["abcd"], ["a"], None, np.zeros(1, int), 1).metrics
  b = terms.score(["p"] * 2, ["", "ab"], ["a"] * 2, None, np.zeros(2, int), 1).metrics
  means = term_means({k: a[k] + b[k] for k in a})
  assert means["reward_term_fn_trl_length"] == pytest.approx(0.3)  # (0.4 + 0.2) / 2
  assert means["reward_term_fn_trl_length_applies"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
  "name, match",
  [
    ("trl_too_few", "returned 2 rewards for 3 answers"),
    ("trl_nan", "answer 0 got nan, not a finite number or None"),
  ],
)
def test_a_bad_callable_result_is_named(name, match):
  terms = _terms(f"fn:reward_fns:{name}")
  with pytest.raises(ValueError, match=f"reward term 'reward_fns:{name}'.*{match}"):
    terms.score(["p"] * 3, ["a"] * 3, ["a"] * 3, None, np.zeros(3, int), 1)


def test_a_callable_past_its_time_limit_fails_its_batch_counted(caplog):
  """The call blocks until the test releases it, so the limit always passes first: that batch's
  values are None and counted; while the abandoned call still runs, the next batch fails at once
  (no second call piles up); once it has ended, calls score again."""
  import reward_fns

  reward_fns.RELEASE.clear()
  cd = default_configdict()
  cd.reward.terms, cd.reward.fn_time_limit = "verifier, fn:reward_fns:trl_blocked", 0.05
  terms = build_terms(task_sections(from_configdict(cd)))
  verified = _verified([1, 0, 1], [True, True, True])
  try:
    for _ in range(2):
      got = terms.score(["p"] * 3, ["a"] * 3, ["a"] * 3, verified, np.zeros(3, int), 1)
      np.testing.assert_array_equal(got.rewards_R, [1, 0, 1])  # the verifier's alone
      np.testing.assert_array_equal(got.kept_R, [1, 1, 1])
      assert got.metrics["reward_term_fn_trl_blocked_failed"] == 3
      assert term_means(got.metrics)["reward_term_fn_trl_blocked_applies"] == 0
  finally:
    reward_fns.RELEASE.set()
  assert "no result within reward.fn_time_limit = 0.05 s" in caplog.text
  assert "an earlier batch, past its limit, is still running" in caplog.text
  terms.scorers[1].overrun.join()
  got = terms.score(["p"] * 3, ["a"] * 3, ["a"] * 3, verified, np.zeros(3, int), 1)
  np.testing.assert_array_equal(got.rewards_R, [2, 1, 2])
  assert got.metrics["reward_term_fn_trl_blocked_failed"] == 0


def test_a_callable_off_process_0_is_not_called():
  """On processes other than the first (``active`` False) the function is not called (this one
  would raise): its values are NaN there, replaced by process 0's
  (tests/test_multihost_reward_terms.py)."""
  term = CallableTerm("reward_fns:trl_too_few", active=False)
  assert np.isnan(term(["p"] * 3, ["a"] * 3, ["a"] * 3)).all() and term.failed == 0


def test_a_missing_callable_or_model_is_named_before_the_run(tmp_path, monkeypatch):
  from huggingface_hub import constants

  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  cd = default_configdict()
  cd.reward.terms = "verifier, fn:reward_fns:nope"
  cfg = from_configdict(cd)
  match = "config.reward.terms: term fn:reward_fns:nope: reward term 'reward_fns:nope'.*'nope'"
  for check in (check_inputs, build_terms):
    with pytest.raises(ConfigError, match=match):
      check(task_sections(cfg))
  cd.reward.terms = f"model:{tmp_path}"
  with pytest.raises(ConfigError, match=f"term model:{tmp_path}: {tmp_path}: no config.json"):
    check_inputs(task_sections(from_configdict(cd)))
  cd.reward.terms = "model:acme/no-such-rm"  # a Hub id, offline and not cached
  with pytest.raises(ConfigError, match="term model:acme/no-such-rm: .*huggingface-cli download"):
    check_inputs(task_sections(from_configdict(cd)))


def test_a_step_trains_on_the_combined_reward_and_logs_each_term(tmp_path):
  """A loop step with the verifier and a length term: the row's reward is the verifier's mean plus
  half the length term's sum per answer, and each term's mean is logged."""
  cfg = tiny_config("test", steps=1, **{"reward.terms": "verifier, fn:reward_fns:trl_length*0.5"})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  ctx = dataclasses.replace(ctx, reward_terms=build_terms(task_sections(cfg)))
  _, row = rl_step(ctx, initial_loop(ctx, ctx.programs.init_state(params)), 0)
  applies = row["reward_term_fn_trl_length_applies"]
  assert 0 < applies <= 1 and row["reward_term_verifier_applies"] == 1.0
  want = row["reward_term_verifier"] + 0.5 * row["reward_term_fn_trl_length"] * applies
  assert row["reward"] == pytest.approx(want, rel=1e-5)
  assert not any(k.startswith("reward_term_") and k.endswith(("_sum", "_n", "_rows")) for k in row)
