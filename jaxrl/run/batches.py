"""A step's batch from issue to arrival (docs/algorithms.md §9): what is decided when its
generation is issued, the generation itself, and the batch in flight.

With ``rollout.max_staleness = k`` the batch that step j trains on is issued at step j − k (at
the start of the step, before its update), so it is sampled by the params of that step: at most k
updates older than those it is trained from. Its questions, their rollout counts and τ are fixed
at issue from the statistics and controllers known then (``Issue``); the generation (one stage or
EEPO's two) runs inline, or on the one rollout thread while the trainer updates; its rewards are
verified and its statistics counted when step j takes it (``run/arrival.py``), in step order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import jax
import numpy as np

from jaxrl import rng
from jaxrl.config import forget_config
from jaxrl.rollout.collect import turn_metrics
from jaxrl.rollout.eepo import two_stage_rollouts
from jaxrl.run import clock
from jaxrl.types import Rollouts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Issue:
  """What is decided when a batch's generation is issued."""

  step: int  # the step that trains on it
  version: int  # weight version: sampled by the params after this many updates (the issuer's)
  phase: int
  qids_B: np.ndarray  # i32 questions
  counts_B: np.ndarray  # i32 G_i from the allocator
  tau: float  # sampling temperature (an f32 value)
  epoch_ended: int = -1  # the data epoch that drawing these questions finished (E3 re-ranks)

  @property
  def fresh(self) -> bool:
    """Sampled by the params its update starts from (no rescoring for ℓ_prox needed)."""
    return self.version == self.step

  def to_json(self) -> dict:
    return dict(
      dataclasses.asdict(self), qids_B=self.qids_B.tolist(), counts_B=self.counts_B.tolist()
    )

  @classmethod
  def from_json(cls, data: dict) -> Issue:
    return cls(
      **{
        **data,
        "qids_B": np.asarray(data["qids_B"], np.int32),
        "counts_B": np.asarray(data["counts_B"], np.int32),
      }
    )


@dataclasses.dataclass(frozen=True)
class Batch:
  """An issued batch, generated: rollouts with behaviour log-probs (and, when fresh, ℓ_prox and
  entropies), EEPO's gate state after it, and what its generation measured."""

  issue: Issue
  rollouts: Rollouts
  gate: object  # EEPO's gate state after this batch's stage 1 (unchanged without EEPO)
  metrics: dict  # EEPO's metrics, the generation's seconds


# How often the main thread, waiting for a batch, returns to Python: a SIGINT / SIGTERM the kernel
# hands to another thread (the rollout thread, an XLA worker) runs its handler only then, and the
# handler is what stops the rollout thread restarting a server the job's signal has just ended.
_SIGNAL_POLL_SECONDS = 0.5


def _waited(future: concurrent.futures.Future):
  """``future.result()``, waited for in slices so that the main thread's signal handlers run."""
  while not concurrent.futures.wait([future], timeout=_SIGNAL_POLL_SECONDS).done:
    pass
  return future.result()


class InFlight:
  """A batch being generated (a future), or one a checkpoint recorded without its rollouts, to be
  generated again (``deferred``); compared by identity."""

  def __init__(self, issue: Issue, future: concurrent.futures.Future | None):
    self.issue, self._future = issue, future

  @property
  def deferred(self) -> bool:
    """Recorded by a checkpoint before it was generated: the loop generates it again."""
    return self._future is None

  def result(self) -> Batch:
    if self._future is None:
      raise RuntimeError(f"the batch of step {self.issue.step + 1} was never generated")
    return _waited(self._future)

  def generated(self, wait: bool) -> Batch | None:
    """The batch if it was generated (waiting for it when ``wait``); None if it is still running
    and not waited for, deferred, or its generation failed (logged: the loop regenerates it)."""
    if self._future is None or not (wait or self._future.done()):
      return None
    try:
      return _waited(self._future)
    except Exception as e:  # whatever failed, the batch is generated again, not lost
      log.warning("the batch of step %d failed (%s: %s)", self.issue.step + 1, type(e).__name__, e)
      return None

  @classmethod
  def done(cls, batch: Batch) -> InFlight:
    future = concurrent.futures.Future()
    future.set_result(batch)
    return cls(batch.issue, future)

  @classmethod
  def later(cls, issue: Issue) -> InFlight:
    """A batch decided but not generated: the rollout source generates it when it is next
    due."""
    return cls(issue, None)


def round_key(seed: int, step: int, round_index: int):
  """Round 0 of step i samples with the step's key; dynamic sampling's extra rounds each their own."""
  if round_index == 0:
    return rng.key(seed, rng.RL, step)
  return jax.random.fold_in(rng.key(seed, rng.ROUND, step), round_index)


def generate(ctx, issue: Issue, params, gate_state, *, round_index: int = 0, fire=None) -> Batch:
  """Sample ``issue``'s rollouts from ``params`` (one stage, or EEPO's two).

  ``fire``: a dynamic-sampling extra round reuses its step's gate decision instead of asking the
  gate again (the gate is a per-step controller; its state does not advance)."""
  t0 = time.time()
  c, t, rt = ctx.cfg, ctx.task, ctx.runtime(issue.phase)
  pc = rt.phase.cfg
  ids, mask = t.train_prompt_ids[issue.qids_B], t.train_prompt_mask[issue.qids_B]
  key, n = round_key(c.seed, issue.step, round_index), pc.rollout.max_new_tokens
  collector = ctx.collector
  if not c.eepo.enabled:
    out = collector.sample(
      params,
      issue.version,
      ids,
      mask,
      issue.counts_B,
      issue.tau,
      key,
      n,
      score=issue.fresh,
      qids_B=issue.qids_B,
    )
    metrics = {"rollout_seconds": clock.ready_at(out) - t0, **turn_metrics(out)}
    return Batch(issue, out, gate_state, metrics)
  gate = rt.methods.gate if fire is None else (lambda state, h: (fire, state))
  two = two_stage_rollouts(
    collector,
    gate,
    gate_state,
    params,
    ids,
    mask,
    issue.counts_B,
    issue.tau,
    key,
    version=issue.version,
    max_new_tokens=n,
    forget=forget_config(c.eepo, c.loss),
    old_logp_from=c.eepo.old_logp_from,
    score=issue.fresh,
    qids_B=issue.qids_B,
  )
  seconds = clock.ready_at(two.rollouts) - t0
  metrics = {**two.metrics, "rollout_seconds": seconds, **turn_metrics(two.rollouts)}
  return Batch(issue, two.rollouts, two.gate_state, metrics)
