"""A non-finite step is skipped, counted and never applied; too many in a row stop the run."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import read_metrics, tiny_config

from jaxrl.run.stops import NonFiniteError
from jaxrl.run.train import Trainer


def _poison(trainer: Trainer, bad_calls: set[int]):
  """Make the given rollout calls' log-probs NaN (π_old, as the JAX sampler reports it beside the
  behaviour log-probs): the ratio, the loss and the gradients follow."""
  generate, calls = trainer.engine.generate, [0]

  def generate_with_nan(*args, **kwargs):
    out = generate(*args, **kwargs)
    calls[0] += 1
    if calls[0] in bad_calls:
      nan = jnp.full_like(out.behaviour_logp_RxN, jnp.nan)
      return dataclasses.replace(out, behaviour_logp_RxN=nan, prox_logp_RxN=nan)
    return out

  trainer.engine.generate = generate_with_nan


def _params(result):
  return [np.asarray(x) for x in jax.tree.leaves(result.params)]


@pytest.mark.slow
def test_nan_step_is_skipped_and_training_continues(tmp_path):
  cfg = tiny_config(steps=4, **{"sft.steps": 20})
  with Trainer.open(cfg, str(tmp_path / "clean")) as clean:
    clean.rl(clean.warm_start(clean.init_params()))
  with Trainer.open(cfg, str(tmp_path / "poisoned")) as poisoned:
    _poison(poisoned, {4})  # step 4's update gets a NaN loss and gradients
    poisoned_result = poisoned.rl(poisoned.warm_start(poisoned.init_params()))
  rows, clean_rows = read_metrics(tmp_path / "poisoned"), read_metrics(tmp_path / "clean")
  assert [r["nonfinite_updates"] for r in rows] == [0, 0, 0, 1]
  assert rows[3]["loss"] == "nan"  # the metrics writer logs non-finite values as strings
  assert rows[:3] == clean_rows[:3]  # identical up to the bad step
  # The skipped update left θ (and the optimizer state) exactly as after step 3: a 3-step run.
  with Trainer.open(dataclasses.replace(cfg, steps=3), str(tmp_path / "three")) as three:
    three_result = three.rl(three.warm_start(three.init_params()))
  for a, b in zip(_params(poisoned_result), _params(three_result)):
    np.testing.assert_array_equal(a, b)
  assert all(np.isfinite(a).all() for a in _params(poisoned_result))


@pytest.mark.slow
def test_too_many_nonfinite_steps_stop_the_run(tmp_path):
  cfg = tiny_config(
    steps=6, **{"sft.steps": 20, "optim.max_nonfinite_steps": 2, "checkpoint.every": 1}
  )
  with Trainer.open(cfg, str(tmp_path)) as trainer:
    _poison(trainer, {2, 3})
    with pytest.raises(NonFiniteError, match="2 consecutive steps"):
      trainer.rl(trainer.warm_start(trainer.init_params()))
  rows = read_metrics(tmp_path)
  assert [r["nonfinite_updates"] for r in rows] == [0, 1]  # the 2nd bad step raised before logging
