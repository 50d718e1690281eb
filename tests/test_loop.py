"""One RL step as a function (``run.loop.rl_step``), built and run without a trainer, a run
directory, a checkpoint or a metrics file: the loop is data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from run_helpers import TIMING, step_context, tiny_config

from jaxrl.run.loop import initial_loop, rl_step
from jaxrl.run.loop_state import LoopState


def test_one_step_is_a_pure_function_of_the_loop_state(tmp_path):
  cfg = tiny_config("e3,test", steps=2, **{"eepo.enabled": True})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop = initial_loop(ctx, ctx.programs.init_state(params))
  assert isinstance(loop, LoopState) and loop.phase == 0 and loop.cursor.drawn == 0

  def copy(x):  # rl_step donates the train state: keep our own
    return jax.tree.map(jnp.copy, x)

  first, row = rl_step(ctx, copy(loop), 0)
  again, row_again = rl_step(ctx, copy(loop), 0)
  np.testing.assert_equal(  # NaN (e.g. a fixed clip's target) equals NaN here
    {k: v for k, v in row.items() if k not in TIMING},
    {k: v for k, v in row_again.items() if k not in TIMING},
  )
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # What the step did, read off the new state: one optimizer update (or a skipped one), R
  # rollouts counted in the statistics, B questions drawn, EEPO's gate history advanced.
  r, b = cfg.num_rollouts, cfg.batch_questions
  assert int(first.train.step) == 1 and first.cursor.drawn == b
  assert int(np.sum(first.stats.seen_Q)) == r and int(np.sum(first.stats.last_step_Q == 0)) == b
  assert int(first.controllers.gate.count) == 1 and row["eepo_gate"] in (0.0, 1.0)
  assert sum(np.asarray(row["alloc_hist"]) * np.arange(len(row["alloc_hist"]))) == r
  assert "compiles_update" not in row  # no compile counter was given: nothing read behind our back
  second, _ = rl_step(ctx, first, 1)
  assert int(second.train.step) == 2 and second.cursor.drawn == 2 * b
