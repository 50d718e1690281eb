"""Reward terms score step i's batch while step i + 1's generates when the loop has a rollout thread
(``rollout.max_staleness`` = k >= 1 and an engine that runs beside the trainer: ``RolloutSource.take``
submits the next batches before ``arrival.arrive`` scores), and not otherwise (docs/rewards.md, "When the terms
score"). The order is shown with events, never timing: a ``fn:`` term and the engine each wait,
bounded, for the other to have started."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import pytest
import reward_fns
from run_helpers import step_context, tiny_config

from jaxrl.run.components import task_sections
from jaxrl.run.loop import initial_loop, rl_step
from jaxrl.tasks.rewards.terms import build_terms


class AnnouncingEngine:
  """The JAX engine, announcing its second call (step 1's batch): it sets
  ``reward_fns.NEXT_BATCH_ASKED`` on entry and ``NEXT_BATCH_DONE`` once generated; with ``meet`` it
  generates only after scoring has started (a bounded wait), noting in ``met`` whether it had."""

  def __init__(self, engine, meet: bool):
    self.engine, self.meet, self.calls, self.met = engine, meet, 0, []

  def __getattr__(self, name):  # everything else is the JAX engine's
    return getattr(self.engine, name)

  def generate(self, params, version, request):
    self.calls += 1
    if self.calls != 2:
      return self.engine.generate(params, version, request)
    reward_fns.NEXT_BATCH_ASKED.set()
    if self.meet:
      self.met.append(reward_fns.SCORING_STARTED.wait(reward_fns.MEET_SECONDS))
    out = self.engine.generate(params, version, request)
    reward_fns.NEXT_BATCH_DONE.set()
    return out


@pytest.fixture(autouse=True)
def fresh_events():
  for event in (
    reward_fns.NEXT_BATCH_ASKED,
    reward_fns.NEXT_BATCH_DONE,
    reward_fns.SCORING_STARTED,
  ):
    event.clear()
  reward_fns.SEEN.clear()


def _two_steps(tmp_path, k: int, term: str, *, thread: bool, meet: bool = False):
  """Steps 0 and 1 of ``tiny:test`` with the verifier and ``fn:reward_fns:TERM``; with ``thread``
  a rollout thread, as the trainer makes one for a concurrent engine. Returns the engine."""
  terms = f"verifier, fn:reward_fns:{term}"
  cfg = tiny_config(
    "test", steps=2, **{"rollout.max_staleness": k, "sft.steps": 0, "reward.terms": terms}
  )
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  engine = AnnouncingEngine(ctx.collector.engine, meet)
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts") if thread else None
  ctx = dataclasses.replace(
    ctx,
    collector=dataclasses.replace(ctx.collector, engine=engine),
    reward_terms=build_terms(task_sections(cfg)),
    rollout_pool=pool,
  )
  try:
    loop = initial_loop(ctx, ctx.programs.init_state(jax.tree.map(jnp.copy, params)))
    for i in range(2):
      loop, _ = rl_step(ctx, loop, i)
  finally:
    ctx.reward_terms.close()
    if pool is not None:
      pool.shutdown(wait=True)
  assert engine.calls == 2 and not loop.pending
  return engine


def test_k1_with_a_rollout_thread_scores_while_the_next_batch_generates(tmp_path):
  engine = _two_steps(tmp_path, 1, "trl_waits_for_next_batch", thread=True, meet=True)
  # Both waits ended by the other's event: step 0's scoring had begun before step 1's generation
  # returned, and step 1's generation had begun before step 0's scoring returned.
  assert reward_fns.SEEN == [True]
  assert engine.met == [True]


def test_k1_inline_generates_the_next_batch_before_scoring(tmp_path):
  """The JAX engine shares the trainer's devices: no rollout thread, so ``RolloutSource.take`` generates
  step 1's batch to the end before step 0's scoring starts."""
  _two_steps(tmp_path, 1, "trl_notes_next_batch", thread=False)
  assert reward_fns.SEEN == [(True, True)]


def test_k0_scores_before_the_next_batch_is_asked_for(tmp_path):
  """k = 0 (the trainer makes no rollout thread): step 1's batch is issued at step 1, after step
  0's update."""
  _two_steps(tmp_path, 0, "trl_notes_next_batch", thread=False)
  assert reward_fns.SEEN == [(False, False)]
