"""A checkpoint is never held hostage by the batches in flight (``rollout.max_staleness`` ≥ 1):
one that failed, or is still running when a stop asks for a save, is recorded by its decisions
alone and generated again on resume; a failed rollout costs no trained step."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import loop_leaves, read_metrics, run_steps, step_context, tiny_config

from jaxrl.run import batches
from jaxrl.run.loop import initial_loop
from jaxrl.run.loop_state import restore_loop, save_loop
from jaxrl.run.train import Trainer
from jaxrl.workdir.checkpoint import Checkpointer


def _failed(issue) -> batches.InFlight:
  future = concurrent.futures.Future()
  future.set_exception(ConnectionResetError("the sidecar went away"))
  return batches.InFlight(issue, future)


def _running(issue) -> batches.InFlight:
  return batches.InFlight(issue, concurrent.futures.Future())  # never finishes


@pytest.mark.parametrize("fault", ["failed", "running"])
def test_a_batch_in_flight_that_failed_or_runs_does_not_stop_the_save(tmp_path, fault):
  """k = 2: after 2 steps the batches of steps 3 and 4 are in flight. The first is replaced by
  one that failed (or never finishes, saved without waiting): the save records both by their
  decisions, and the restored loop generates them again and trains on."""
  cfg = tiny_config("test", steps=5, **{"rollout.max_staleness": 2, "sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  copy = lambda x: jax.tree.map(jnp.copy, x)  # noqa: E731 (rl_step donates the train state)
  loop, _ = run_steps(ctx, initial_loop(ctx, ctx.programs.init_state(params)), 0, 2)
  issues = [p.issue for p in loop.pending]
  assert [q.step for q in issues] == [2, 3]
  broken = (_failed if fault == "failed" else _running)(issues[0])
  loop = loop.__class__(
    loop.train, loop.stats, loop.controllers, loop.cursor, loop.phase, (broken, loop.pending[1])
  )
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=2, async_save=False)
  try:
    assert save_loop(ckpt, 2, loop, ctx.programs.mesh, wait=fault == "failed")
    like = initial_loop(ctx, ctx.programs.init_state(params))
    resumed = restore_loop(ckpt, 2, like, ctx.programs.state_shardings, ctx.programs.mesh)
  finally:
    ckpt.close()
  # Both recorded by their decisions (the second's EEPO gate input depended on the first).
  assert [(p.issue.step, p.deferred) for p in resumed.pending] == [(2, True), (3, True)]
  for saved, issue in zip(resumed.pending, issues):
    np.testing.assert_array_equal(saved.issue.qids_B, issue.qids_B)
    np.testing.assert_array_equal(saved.issue.counts_B, issue.counts_B)
  for a, b in zip(loop_leaves(resumed), loop_leaves(loop)):
    np.testing.assert_array_equal(a, b)
  end, rows = run_steps(ctx, copy(resumed), 2, 5)
  # Generated again by the params of the resumed step: fresh, then k behind again.
  assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 2.0]
  assert int(end.train.step) == 5 and not end.pending


def test_a_failed_rollout_checkpoints_the_steps_trained_before_it(tmp_path, monkeypatch):
  """A rollout that fails at step 3 (no checkpoint since the start) leaves a checkpoint of the
  two steps trained; the run resumed from it ends as a run that never failed."""
  cfg = tiny_config("test", steps=4, **{"checkpoint.every": 100})
  straight = Trainer.open(cfg, str(tmp_path / "straight")).run().rl
  generate = batches.generate

  def failing(ctx, issue, *args, **kwargs):
    if issue.step == 2:
      raise ConnectionResetError("the sidecar went away")
    return generate(ctx, issue, *args, **kwargs)

  workdir = tmp_path / "failed"
  monkeypatch.setattr(batches, "generate", failing)
  with pytest.raises(ConnectionResetError):
    Trainer.open(cfg, str(workdir)).run()
  monkeypatch.setattr(batches, "generate", generate)
  ckpt = Checkpointer(str(workdir / "checkpoints"), keep=2, async_save=False)
  try:
    assert ckpt.latest_step() == 2
  finally:
    ckpt.close()
  resumed = Trainer.open(cfg, str(workdir)).run().rl
  assert read_metrics(workdir) == read_metrics(tmp_path / "straight")
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
