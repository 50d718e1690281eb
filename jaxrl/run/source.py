"""Where a step's batch comes from: ``RolloutSource``, the one rollout stage of the loop.

Its variations are the source's, not the step's: batches issued ``rollout.max_staleness = k``
steps ahead (generated inline, or on the rollout thread while the trainer updates), one sampling
stage or EEPO's two (``batches.generate``), dynamic sampling's further rounds
(``extra_round``), and a stale batch made ready for the update (``on_policy``: ℓ_prox and
entropies under the step's params, docs/algorithms.md §9). The step asks it for step i's batch and
receives it generated, whichever of these ran.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.run import batches
from jaxrl.run.loop_state import LoopState
from jaxrl.run.phases import phase_at
from jaxrl.tasks.data.cursor import MixtureCursor, next_mixture_batch
from jaxrl.types import Rollouts

log = logging.getLogger(__name__)


class RolloutSource:
  """The batches of a run's steps, decided and generated in step order.

  Built by ``StepContext`` (``ctx``: what it reads — the config, the task, the collector, each
  phase's runtime, the rollout thread); it keeps no state of its own: the batches in flight, the
  cursor and the phase are the ``LoopState``'s, so a checkpoint holds them."""

  def __init__(self, ctx):
    self._ctx = ctx

  def take(self, loop: LoopState, i: int) -> tuple[LoopState, batches.Batch]:
    """Issue the batches due, then wait for step ``i``'s: the loop without it, and the batch."""
    loop = self._issue_due(loop, i)
    batch = loop.pending[0].result()
    assert batch.issue.step == i, (batch.issue.step, i)
    return dataclasses.replace(loop, pending=loop.pending[1:]), batch

  def extra_round(
    self, loop: LoopState, batch: batches.Batch, i: int, round_index: int
  ) -> tuple[LoopState, batches.Issue, Rollouts, int]:
    """Dynamic sampling's round ``round_index`` of step ``i`` (docs/algorithms.md §10): B more
    questions from the cursor, allocated from the statistics known at the step's start, sampled
    by θ_i at the step's τ with the step's gate decision. Returns the loop with the advanced
    cursor, the round's issue, its rollouts, and the data epoch the draw ended (-1: none)."""
    c, rt = self._ctx.cfg, self._ctx.runtime(batch.issue.phase)
    mixture = self._ctx.runtime(loop.phase).mixture
    epoch_before = loop.cursor.epoch(mixture)
    qids_B, cursor = next_mixture_batch(loop.cursor, c.seed, mixture, c.batch_questions)
    loop = dataclasses.replace(loop, cursor=cursor)
    counts_B = rt.methods.allocate(loop.controllers.alloc, loop.stats, jnp.asarray(qids_B))
    issue = dataclasses.replace(
      batch.issue,
      version=i,
      qids_B=np.asarray(qids_B, np.int32),
      counts_B=np.asarray(counts_B, np.int32),
      epoch_ended=-1,
    )
    fire = batch.metrics.get("eepo_gate")

    def job():
      return batches.generate(
        self._ctx,
        issue,
        loop.train.params,
        batch.gate,
        round_index=round_index,
        fire=None if fire is None else bool(fire),
      )

    # Through the rollout thread when there is one: the engine serves one caller at a time.
    pool = self._ctx.rollout_pool
    out = (job() if pool is None else pool.submit(job).result()).rollouts
    ended = epoch_before if cursor.epoch(mixture) != epoch_before else -1
    return loop, issue, out, ended

  def on_policy(self, params, rollouts: Rollouts, issue: batches.Issue) -> Rollouts:
    """The rollouts as the update from ``params`` reads them: a batch sampled by older params
    (issued ahead) gets ℓ_prox and entropies under ``params`` (§9); a fresh one is unchanged."""
    if issue.fresh:
      return rollouts
    return self._ctx.collector.anchor(params, rollouts, issue.tau)

  def settle(self, loop: LoopState) -> None:
    """Wait until no batch is generating: the engine serves one caller at a time."""
    for pending in loop.pending:
      pending.generated(wait=True)

  # -- issuing -------------------------------------------------------------------------------------

  def _issue_due(self, loop: LoopState, i: int) -> LoopState:
    """Issue every batch due by step ``i``: up to step i + k (not past the run's last step, nor
    past the phase step i is in), all sampled by θ_i, the params step i starts from.

    A phase boundary drains the pipeline: the next phase's first batch is issued at its own first
    step. The loop's cursor, phase and allocation state are the issue side's; stopping there keeps
    them the trained phase's while its steps run (dynamic sampling's extra rounds draw from its
    mixture, E3's epoch ends re-rank its allocation state, which ``start_phase`` has not reset)."""
    ctx = self._ctx
    last = max(i, min(i + ctx.cfg.rollout.max_staleness, ctx.cfg.steps - 1))
    following = [p.start for p in ctx.phases if p.start > i]
    if following:
      last = min(last, following[0] - 1)
    params = None

    def sampling_params():
      nonlocal params
      if params is None:
        params = loop.train.params
        if ctx.rollout_pool is not None:  # the update donates θ_i while the thread reads it
          params = jax.tree.map(jnp.copy, params)
      return params

    loop = self._regenerate_deferred(loop, i, sampling_params)
    while (j := loop.pending[-1].issue.step + 1 if loop.pending else i) <= last:
      loop = self._issue(loop, j, i, sampling_params())
    return loop

  def _regenerate_deferred(self, loop: LoopState, i: int, sampling_params) -> LoopState:
    """Generate again the batches a checkpoint recorded without their rollouts (still running, or
    failed, when it was written; always after the generated ones): their decisions (questions,
    counts, τ) as issued, sampled by θ_i."""
    deferred = [p.issue for p in loop.pending if p.deferred]
    if not deferred:
      return loop
    loop = dataclasses.replace(loop, pending=tuple(p for p in loop.pending if not p.deferred))
    for issue in deferred:
      log.info("generating the batch of step %d again, by the params of step %d", issue.step + 1, i)
      loop = self._launch(loop, dataclasses.replace(issue, version=i), sampling_params())
    return loop

  def _issue(self, loop: LoopState, j: int, i: int, params) -> LoopState:
    """Decide batch ``j``'s questions, counts and τ from what is known at step ``i``; start it."""
    loop = self._enter_due_phase(loop, j)
    c, rt = self._ctx.cfg, self._ctx.runtime(loop.phase)
    epoch_before = loop.cursor.epoch(rt.mixture)
    qids_B, cursor = next_mixture_batch(loop.cursor, c.seed, rt.mixture, c.batch_questions)
    counts_B = rt.methods.allocate(loop.controllers.alloc, loop.stats, jnp.asarray(qids_B))
    issue = batches.Issue(
      step=j,
      version=i,
      phase=loop.phase,
      qids_B=np.asarray(qids_B, np.int32),
      counts_B=np.asarray(counts_B, np.int32),
      tau=float(loop.controllers.temperature.tau),
      epoch_ended=epoch_before if cursor.epoch(rt.mixture) != epoch_before else -1,
    )
    return self._launch(dataclasses.replace(loop, cursor=cursor), issue, params)

  def _launch(self, loop: LoopState, issue: batches.Issue, params) -> LoopState:
    """Start generating ``issue``'s batch (inline, or on the rollout thread) after those
    pending."""
    # EEPO's gate goes through the batches in issue order: each reads the state the last left.
    prev, gate = (loop.pending or (None,))[-1], loop.controllers.gate

    def job():
      return batches.generate(self._ctx, issue, params, prev.result().gate if prev else gate)

    if self._ctx.rollout_pool is None:
      flight = batches.InFlight.done(job())
    else:
      flight = batches.InFlight(issue, self._ctx.rollout_pool.submit(job))
    return dataclasses.replace(loop, pending=loop.pending + (flight,))

  def _enter_due_phase(self, loop: LoopState, i: int) -> LoopState:
    """At the annealing phase's first step: a fresh cursor over its mixture, allocation bounds
    around its group size."""
    ctx = self._ctx
    phase = phase_at(ctx.phases, i)
    if phase.index == loop.phase:
      return loop
    epoch = loop.cursor.epoch(ctx.runtime(loop.phase).mixture)
    rt, pc = ctx.runtime(phase.index), phase.cfg
    log.info(
      "%s phase from step %d: %d questions (%s), G=%d, max_new_tokens=%d",
      phase.name,
      phase.start + 1,
      rt.mixture.size,
      phase.mixture or "all",
      pc.rollout.group_size,
      pc.rollout.max_new_tokens,
    )
    num_q = len(ctx.task.train_answers)
    alloc = rt.methods.start_phase(loop.controllers.alloc, loop.stats, epoch, num_q)
    return dataclasses.replace(
      loop,
      controllers=dataclasses.replace(loop.controllers, alloc=alloc),
      cursor=MixtureCursor.start(rt.mixture, epoch0=epoch),
      phase=phase.index,
    )
