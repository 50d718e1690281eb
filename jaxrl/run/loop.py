"""One RL step, read top to bottom: ``rl_step(ctx, loop, i) -> (loop, record)``.

    take     the step's batch from the rollout source (issued k steps ahead or now; one sampling
             stage or EEPO's two; run/source.py)
    arrive   rewards, answers nobody scored set aside, dynamic sampling's further rounds, the
             questions' statistics (run/arrival.py)
    measure  the batch on the policy the update starts from (ℓ_prox when it is stale), H_t, the
             clip controller, the loss's traced values; diagnostics when due, timed apart
    update   the jitted GRPO update (packed when ``loss.packing``), its time ended on its results
    advance  the temperature controller, EEPO's gate, E3's re-ranking at an epoch's end
    record   the step's metrics row

Nothing in it touches files: the trainer saves, logs and stops around it. What it reads is the
``StepContext`` (run/context.py), what it carries the ``LoopState`` (run/loop_state.py).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxrl.methods.controllers import ControllerStates
from jaxrl.parallel import distributed, sharding
from jaxrl.rl import packing
from jaxrl.rl.losses import LossHparams
from jaxrl.rl.stats import init_stats
from jaxrl.rollout.collect import token_mean_entropy
from jaxrl.run import arrival, batches, clock, diagnostics, mfu, records
from jaxrl.run.context import PhaseRuntime, StepContext
from jaxrl.run.loop_state import LoopState
from jaxrl.tasks.data.cursor import MixtureCursor
from jaxrl.tasks.rewards.terms import term_means
from jaxrl.types import Rollouts, TrainState


def initial_loop(ctx: StepContext, train: TrainState) -> LoopState:
  """Step 0: the warm-started train state, empty statistics, fresh controllers."""
  rt = ctx.runtime(0)
  num_q = len(ctx.task.train_answers)
  return LoopState(
    train, init_stats(num_q), rt.methods.init(num_q), MixtureCursor.start(rt.mixture), 0
  )


@dataclasses.dataclass(frozen=True)
class Measured:
  """The batch as the update reads it, and what the step measured of it before the update."""

  rollouts: Rollouts  # on the policy the update starts from (ℓ_prox set when stale)
  h_t: object  # f32 token-mean entropy at τ over the model's tokens (E3's H_t)
  clip: object  # the clip controller's state after H_t
  hp: LossHparams  # the loss's traced values (ε_high from the clip controller)


def rl_step(ctx: StepContext, loop: LoopState, i: int) -> tuple[LoopState, dict]:
  """RL step ``i`` (0-based): the next loop state and the step's metrics row."""
  t0 = time.time()
  # take: step i's batch, generated (ahead or now, one stage or EEPO's two)
  loop, batch = ctx.source.take(loop, i)
  t1 = time.time()
  # arrive: rewards, dynamic sampling's rounds, the questions' statistics
  loop, got = arrival.arrive(ctx, loop, batch, i)
  # measure: on the policy θ_i, H_t, ε_high, the loss's values; diagnostics before θ_i is donated
  seen = _measure(ctx, loop, batch, got)
  diagnosed = _diagnose(ctx, loop, batch, seen.hp, i)
  t2 = time.time()
  # update: the GRPO step, its clock stopped on the new params
  rt = ctx.runtime(batch.issue.phase)
  train, update, packed = _update(ctx, rt, loop.train, seen.rollouts, seen.hp)
  t3 = clock.ready_at(train, update)
  update = distributed.to_host(update)
  # advance: the controllers; record: the metrics row
  ctl = _advance(rt, loop.controllers, batch, got, seen)
  measured = {**diagnosed, **packed}
  record = _record(ctx, loop, batch, got, seen, update, ctl, (t0, t1, t2, t3), measured, i)
  return dataclasses.replace(loop, train=train, stats=got.stats, controllers=ctl), record


def _measure(
  ctx: StepContext, loop: LoopState, batch: batches.Batch, got: arrival.Arrival
) -> Measured:
  """The rollouts on the policy the update starts from, and the entropy of them at τ under those
  params: E3's H_t and the clip controller's measured entropy, known before this step's update
  (over the model's tokens, §11); the loss's traced values (no recompile when they change)."""
  rt, tau = ctx.runtime(batch.issue.phase), batch.issue.tau
  rollouts = ctx.source.on_policy(loop.train.params, got.rollouts, batch.issue)
  h_t = token_mean_entropy(rollouts)
  clip_state = rt.methods.update_clip(loop.controllers.clip, h_t)
  eps_high = rt.methods.clip.current(clip_state)
  hp = LossHparams.from_config(ctx.cfg.loss, ctx.cfg.modulation, tau, eps_high)
  return Measured(rollouts, h_t, clip_state, hp)


def _advance(
  rt: PhaseRuntime,
  ctl: ControllerStates,
  batch: batches.Batch,
  got: arrival.Arrival,
  seen: Measured,
) -> ControllerStates:
  """The controllers after the step: τ from H_t, the clip's state, the gate's after the batch,
  and E3's re-ranking for every pass over the data the step's draws ended."""
  ctl = dataclasses.replace(
    ctl,
    temperature=rt.methods.update_temperature(ctl.temperature, seen.h_t),
    clip=seen.clip,
    gate=batch.gate,
  )
  for epoch in got.epochs_ended:
    ctl = dataclasses.replace(ctl, alloc=rt.methods.on_epoch_end(ctl.alloc, got.stats, epoch))
  return ctl


def _diagnose(ctx: StepContext, loop: LoopState, batch: batches.Batch, hp, i: int) -> dict:
  """The step's diagnostics (DynaMO's gradient-variance ratio when due), timed apart: they are
  not the step's work (``step_time`` leaves ``diagnostics_seconds`` out)."""
  if not diagnostics.grad_variance_due(ctx.cfg, i):
    return {}
  started = time.time()
  ctx.source.settle(loop)
  ratio = diagnostics.grad_variance_ratio(
    ctx, batch.issue, loop.train.params, hp, i, lambda q, r: arrival.verify(ctx, q, r)
  )
  return {"dynamo_grad_var_ratio": ratio, "diagnostics_seconds": time.time() - started}


def _update(ctx: StepContext, rt: PhaseRuntime, train: TrainState, rollouts, hp):
  """The train step on the rollouts, packed when ``loss.packing`` is on (the lengths, read on the
  host, decide the layout): the new train state, its metrics, and the throughputs and what packing
  did, over the positions the update processed."""
  pack = packing.for_update(rt.phase.cfg.loss, rollouts)
  mesh, positions, pack_metrics = ctx.programs.mesh, None, {}
  if pack is not None:
    loss = rt.phase.cfg.loss
    chunks = loss.mini_batches * loss.micro_batches
    pack_metrics = packing.metrics(pack, rollouts.prompt_mask_RxP, rollouts.mask_RxN, chunks)
    positions = chunks * pack.rows * (rollouts.prompt_ids_RxP.shape[1] + rollouts.mask_RxN.shape[1])
    pack = sharding.shard_batch(pack, mesh)
  train, update = rt.update(train, sharding.shard_batch(rollouts, mesh), hp, ctx.ref_params, pack)
  return train, update, {"_positions": positions, **pack_metrics}


def _record(ctx: StepContext, loop, batch, got, seen: Measured, update, ctl, times, measured, i):
  """The step's metrics row (and its text samples), of the rows of the step's questions: not
  padding, not set aside."""
  c, methods, tau = ctx.cfg, ctx.runtime(batch.issue.phase).methods, batch.issue.tau
  rollouts, hp, h_t = seen.rollouts, seen.hp, seen.h_t
  in_group_R = np.asarray(rollouts.group_ids_R) < c.batch_questions
  real = jax.tree.map(lambda x: np.asarray(x)[in_group_R], rollouts)
  update_s = times[3] - times[2]
  record = records.step_record(
    update=update,
    rollouts=real,
    rewards_R=real.rewards_R,
    entropy=h_t,
    num_groups=c.batch_questions,
    decisions={
      **records.decision_metrics(methods, ctl, tau, hp),
      **records.paper_metrics_row(methods, ctl, h_t),
    },
    counts_B=batch.issue.counts_B,
    times=times,
    context=_context(ctx, ctx.runtime(loop.phase), loop.cursor),
    verified=term_means(got.verified),
    extra={
      **batch.metrics,
      **got.metrics,
      "rollout_staleness": float(i - batch.issue.version),
      **records.update_rates(rollouts, update_s, measured.pop("_positions")),
      **_mfu(ctx, batch.issue.phase, update_s, rollouts),
      **measured,
    },
  )
  # Text rows for samples.jsonl (the trainer takes them out of the metrics row).
  record["samples"] = records.sample_rows(
    ctx.task, real, got.qids_B, got.counts_B, tau, c.log.samples_per_step
  )
  return record


def _mfu(ctx: StepContext, phase: int, seconds: float, rollouts) -> dict:
  """The update's model FLOPs utilisation, of its useful FLOPs: XLA's count over the padded rows,
  scaled by the share of their positions that are not padding (padding is compute, not model
  work)."""
  if ctx.peak_flops is None:  # CPU, unless log.peak_tflops says otherwise
    return {}
  useful, raw = records.useful_and_raw_tokens(rollouts)
  flops = ctx.update_flops(phase) * useful / raw
  return {"train_mfu": mfu.mfu(flops, seconds, ctx.peak_flops, ctx.programs.mesh.size)}


def _context(ctx: StepContext, rt: PhaseRuntime, cursor: MixtureCursor) -> dict:
  pc = rt.phase.cfg
  return dict(
    epoch=cursor.epoch(rt.mixture),
    phase=rt.phase.index,
    group_size=pc.rollout.group_size,
    max_new_tokens=pc.rollout.max_new_tokens,
    # Compiled versions of the hot functions: constant after the first step, or something (a
    # shape, a Python scalar) is recompiling every step.
    **ctx.compiles.counts(),
  )
