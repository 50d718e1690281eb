"""The gradient-variance diagnostic (jaxrl.rl.grad_variance, docs/algorithms.md §12): worked
examples, and DynaMO's Appendix C ratio on a model whose per-rollout gradients have known spread."""

import jax
import numpy as np
import pytest
from run_helpers import loop_leaves, run_steps, step_context, tiny_config

from jaxrl import rng
from jaxrl.config import ConfigError
from jaxrl.rl.grad_variance import (
  allocation_grad_variance_ratio,
  grad_variance_ratio,
  trace_variance,
  uniform_counts,
  variance_key,
)
from jaxrl.run.loop import initial_loop


def test_trace_variance_worked():
  # Mean (2, 0); squared distances 1, 1, 4, 4; their mean 2.5.
  # (Accumulated in f32: 2/3 enters the running mean, hence approx.)
  assert trace_variance([[1, 0], [3, 0], [2, 2], [2, -2]]) == pytest.approx(2.5, rel=1e-6)
  # A pytree gradient: the same numbers split over two leaves.
  tree = [{"a": x, "b": [y]} for x, y in [(1, 0), (3, 0), (2, 2), (2, -2)]]
  assert trace_variance(tree) == pytest.approx(2.5, rel=1e-6)
  with pytest.raises(ValueError):
    trace_variance([[1.0, 2.0]])  # one draw has no spread


def test_grad_variance_ratio_worked():
  # The batches are their own gradients: A's draws 1, 3 (variance 1), uniform's 0, 4 (variance 4).
  ratio = grad_variance_ratio(np.asarray, [[1.0], [3.0]], [[0.0], [4.0]])
  assert ratio == pytest.approx(0.25, rel=1e-6)
  assert np.isnan(grad_variance_ratio(np.asarray, [[1.0], [3.0]], [[2.0], [2.0]]))


def test_uniform_counts_keep_the_budget():
  np.testing.assert_array_equal(uniform_counts([2, 6]), [4, 4])
  np.testing.assert_array_equal(uniform_counts([1, 1, 9]), [4, 4, 3])  # R = 11: 3 each, 2 left


def gaussian_model(sigma_B):
  """Question i's rollout k contributes g_ik ~ N(0, σ_i²·I_D); a batch's gradient is Σ_i of the
  group means, whose total variance is D·Σ_i σ_i²/n_i (DynaMO Appendix C)."""
  sigma_B = np.asarray(sigma_B, np.float64)

  def sample(counts_B, key):
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    gen = np.random.default_rng(seed)
    return [gen.normal(0.0, s, size=(int(n), 3)) for s, n in zip(sigma_B, counts_B)]

  def grad(batch):
    return sum(g_NxD.mean(axis=0) for g_NxD in batch)

  return sample, grad


def test_dynamo_optimum_against_uniform():
  # σ = (1, 3), R = 8: n ∝ σ is (2, 6), variance 1/2 + 9/6 = 2 per dimension; uniform (4, 4) gives
  # 1/4 + 9/4 = 2.5; the ratio 0.8 = (Σσ)²/(B·Σσ²) = 16/20. With M = 4000 draws each, a variance
  # estimate's relative standard error is √(2/M) = 2.2% per dimension, /√3 over D = 3, so the
  # ratio's is about √2 · 1.3% = 1.8%: within 6% is > 3 standard errors.
  sample, grad = gaussian_model([1.0, 3.0])
  key = variance_key(0, 5)
  ratio = allocation_grad_variance_ratio(grad, sample, [2, 6], key, draws=4000)
  assert ratio == pytest.approx(0.8, rel=0.06)
  # Pure in its key: the same key gives the same draws and the same ratio.
  assert allocation_grad_variance_ratio(grad, sample, [2, 6], key, draws=50) == (
    allocation_grad_variance_ratio(grad, sample, [2, 6], key, draws=50)
  )


def test_the_diagnostic_has_its_own_stream():
  streams = [rng.INIT, rng.RL, rng.EVAL, rng.ROUND, rng.SFT]
  assert rng.GRAD_VARIANCE not in streams
  # Its key at step t differs from the rollouts' key of step t.
  assert not np.array_equal(
    np.asarray(jax.random.key_data(variance_key(0, 3))),
    np.asarray(jax.random.key_data(rng.key(0, rng.RL, 3))),
  )


def test_the_loop_measures_without_changing_training(tmp_path):
  # DynaMO on the tiny task, 2 steps, measured at step 2 (grad_variance_every = 2): every row and
  # the final loop state equal those of the run that does not measure, bit for bit; the measured
  # row adds a positive, finite ratio, and the other row none. (Fresh params answer nothing
  # right, so every group is uninformative: the entropy bonus over all rows gives the gradient
  # something to vary.)
  bonus = {"loss.entropy_coef": 0.01, "loss.informative_only": False}

  def run(**diag):
    cfg = tiny_config("dynamo,test", steps=2, **bonus, **diag)
    ctx, params = step_context(cfg, tmp_path / "tokenizer")
    loop = initial_loop(ctx, ctx.programs.init_state(params))
    return run_steps(ctx, loop, 0, 2)

  plain_loop, plain_rows = run()
  loop, rows = run(**{"diagnostics.grad_variance_every": 2, "diagnostics.grad_variance_draws": 2})
  assert "dynamo_grad_var_ratio" not in rows[0]
  ratio = rows[1].pop("dynamo_grad_var_ratio")
  assert np.isfinite(ratio) and ratio > 0, ratio
  np.testing.assert_equal(rows, plain_rows)  # NaN (a fixed clip's target) equals NaN here
  for a, b in zip(loop_leaves(loop), loop_leaves(plain_loop)):
    np.testing.assert_array_equal(a, b)


def test_the_config_needs_two_draws():
  with pytest.raises(ConfigError, match="diagnostics.grad_variance_draws"):
    tiny_config("dynamo,test", **{"diagnostics.grad_variance_draws": 1})
  assert tiny_config("dynamo,test").diagnostics.grad_variance_every == 0  # off by default
