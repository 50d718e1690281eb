"""Asynchronous rollouts with the JAX sampler (``rollout.max_staleness`` = k, docs/algorithms.md §9):
staleness bounded by k, runs deterministic, a save and restore with batches in flight exact, and
EEPO's gate carried through the batches in issue order. (k = 0 is pinned bit for bit by the golden
step in tests/test_train.py; subprocess kill/resume in tests/test_kill_resume.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import loop_leaves, run_steps, step_context, tiny_config

from jaxrl.run.loop import initial_loop
from jaxrl.run.loop_state import restore_loop, save_loop
from jaxrl.workdir.checkpoint import Checkpointer


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_bounded_and_runs_are_deterministic(tmp_path, k):
  cfg = tiny_config("test", steps=5, **{"rollout.max_staleness": k, "sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  start = initial_loop(ctx, ctx.programs.init_state(params))
  copy = lambda x: jax.tree.map(jnp.copy, x)  # noqa: E731 (rl_step donates the train state)
  one, rows = run_steps(ctx, copy(start), 0, cfg.steps)
  two, rows_again = run_steps(ctx, copy(start), 0, cfg.steps)
  np.testing.assert_equal(rows, rows_again)
  for a, b in zip(loop_leaves(one), loop_leaves(two)):
    np.testing.assert_array_equal(a, b)
  # Step i trains on the batch issued at step max(0, i - k): by θ_0 at first, then k behind.
  assert [r["rollout_staleness"] for r in rows] == [float(min(i, k)) for i in range(cfg.steps)]
  # A stale batch is rescored under the update's params: the mismatch to the sampler shows.
  assert rows[0]["behaviour_logp_diff_max"] == 0.0
  assert all(r["behaviour_logp_diff_max"] > 0 for r in rows[1:])
  assert not one.pending  # nothing is issued past the last step


def test_k0_trains_on_the_batch_its_own_params_sampled(tmp_path):
  cfg = tiny_config("test", steps=2, **{"sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop, rows = run_steps(ctx, initial_loop(ctx, ctx.programs.init_state(params)), 0, 2)
  # ℓ_prox is the sampler's own ℓ (= ℓ_μ at top_p = 1): no rescoring, no mismatch, nothing in
  # flight between steps.
  assert all(r["rollout_staleness"] == 0 and r["mismatch_kl"] == 0 for r in rows)
  assert not loop.pending


def test_save_and_restore_with_batches_in_flight_is_exact(tmp_path):
  """k = 2 with every method (E3, EEPO, DynaMO modulation, entropy-scheduled clip) and dynamic
  sampling: 6 straight steps equal 3 steps, a checkpoint with the two batches in flight, a fresh
  context restored from it, and 3 more steps."""
  cfg = tiny_config(
    "all,test",
    steps=6,
    **{"rollout.max_staleness": 2, "rollout.dynamic_sampling": True, "sft.steps": 0},
  )
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  start = initial_loop(ctx, ctx.programs.init_state(params))
  copy = lambda x: jax.tree.map(jnp.copy, x)  # noqa: E731
  straight, rows = run_steps(ctx, copy(start), 0, 6)

  half, first_rows = run_steps(ctx, copy(start), 0, 3)
  assert [b.issue.step for b in (p.result() for p in half.pending)] == [3, 4]
  # EEPO's gate went through the two batches in flight too: one stage-1 reading per batch.
  assert int(half.controllers.gate.count) == 3
  assert int(half.pending[-1].result().gate.count) == 5
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=2, async_save=False)
  try:
    assert save_loop(ckpt, 3, half, ctx.programs.mesh)
    ctx2, params2 = step_context(cfg, tmp_path / "tokenizer2")
    like = initial_loop(ctx2, ctx2.programs.init_state(params2))
    resumed = restore_loop(ckpt, 3, like, ctx2.programs.state_shardings, ctx2.programs.mesh)
  finally:
    ckpt.close()
  assert [p.issue.step for p in resumed.pending] == [3, 4]
  end, last_rows = run_steps(ctx2, resumed, 3, 6)
  np.testing.assert_equal(first_rows + last_rows, rows)
  for a, b in zip(loop_leaves(straight), loop_leaves(end)):
    np.testing.assert_array_equal(a, b)
