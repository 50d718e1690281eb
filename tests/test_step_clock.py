"""The step's clocks stop when the device work is done: ``clock.ready_at`` blocks on what the timed
work produced before it reads the clock, and the rollout and the update are timed through it (JAX
dispatches asynchronously: a clock read after the call alone measures the dispatch)."""

import jax.numpy as jnp
from run_helpers import step_context, tiny_config

from jaxrl.run import clock
from jaxrl.run.loop import initial_loop, rl_step
from jaxrl.types import Rollouts, TrainState


def test_ready_at_blocks_on_the_outputs_before_it_reads_the_clock(monkeypatch):
  events = []
  out = jnp.arange(3) * 2
  monkeypatch.setattr(clock.jax, "block_until_ready", lambda x: events.append(("block", x)) or x)
  monkeypatch.setattr(clock.time, "time", lambda: events.append(("clock", None)) or 12.5)
  assert clock.ready_at(out, "metrics") == 12.5
  assert [e for e, _ in events] == ["block", "clock"]
  assert events[0][1][0] is out and events[0][1][1] == "metrics"


def test_the_rollout_and_the_update_are_timed_when_their_arrays_are_ready(tmp_path, monkeypatch):
  cfg = tiny_config("test", **{"sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop = initial_loop(ctx, ctx.programs.init_state(params))
  timed = []
  real = clock.ready_at
  monkeypatch.setattr(clock, "ready_at", lambda *outs: timed.append(outs) or real(*outs))
  _, row = rl_step(ctx, loop, 0)
  rollout, update = timed  # the batch's samples, then the new train state with its metrics
  assert len(rollout) == 1 and isinstance(rollout[0], Rollouts)
  state, metrics = update
  assert isinstance(state, TrainState) and "loss" in metrics
  assert row["rollout_seconds"] > 0 and row["update_seconds"] > 0
  # throughputs over the tokens that are not padding, and over every position processed
  assert 0 < row["train_tok_s"] <= row["train_raw_tok_s"]
