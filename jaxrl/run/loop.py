"""The RL loop as data: ``LoopState`` is what a checkpoint holds, ``rl_step`` is one step.

``rl_step(ctx, loop, i) -> (loop, record)``: issue the batches due (data cursor → question ids →
allocation, τ → rollouts, one stage or EEPO's two; ``rollout.max_staleness = k`` issues step
i + k's) → take step i's batch → rewards on the host (dynamic sampling: more rounds until B groups
carry a signal) → ℓ_prox under the step's params when the batch is stale → question statistics →
clip controller → (every ``diagnostics.grad_variance_every`` steps, the gradient-variance
measurement at θ_i, ``run.diagnostics``) → jitted GRPO update → temperature controller → epoch-end
re-ranking → the step's metrics row. Nothing in it touches files: the trainer saves, logs and
stops around it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import Config, LossConfig
from jaxrl.methods.controllers import ControllerStates, Methods
from jaxrl.methods.phases import Phase, phase_at
from jaxrl.nn import lora
from jaxrl.parallel import distributed, sharding
from jaxrl.rl import packing
from jaxrl.rl.losses import LossHparams
from jaxrl.rl.programs import Programs
from jaxrl.rl.stats import init_stats, update_stats
from jaxrl.rl.step import rl_update
from jaxrl.rollout import dynamic, multiturn
from jaxrl.rollout.collect import Collector, token_mean_entropy
from jaxrl.rollout.sampler import sample_program
from jaxrl.run import batches, clock, diagnostics, mfu, records
from jaxrl.run.compiles import CompileCounter
from jaxrl.tasks.data.cursor import Mixture, MixtureCursor, next_mixture_batch
from jaxrl.tasks.rewards.pool import VerifyResult
from jaxrl.tasks.rewards.terms import RewardTerms, term_means
from jaxrl.tasks.task import TaskData
from jaxrl.types import QuestionStats, Rollouts, TrainState, pytree_dataclass, static_field
from jaxrl.workdir.checkpoint import Checkpointer

log = logging.getLogger(__name__)


@pytree_dataclass
class LoopState:
  """Everything the loop carries from one step to the next, and exactly what a checkpoint holds:
  arrays (train state, question statistics, controller states) as leaves, the data cursor and the
  phase index as static fields (saved as JSON)."""

  train: TrainState
  stats: QuestionStats
  controllers: ControllerStates  # the gate's state is the one after the last trained batch
  cursor: MixtureCursor = static_field()  # after the last issued batch
  phase: int = static_field()  # of the last issued batch
  # Batches issued for the next steps (``batches.InFlight``, in step order): none between steps
  # when k = 0; a checkpoint holds them generated (``save_loop``).
  pending: tuple = static_field(default=())


@dataclasses.dataclass(frozen=True)
class PhaseRuntime:
  """What a phase samples and compiles with: its controllers, its train step, its data mixture."""

  phase: Phase
  methods: Methods
  update: object  # the phase's jitted GRPO update (Programs.update)
  mixture: Mixture


# The programs whose compiles a step's row counts (``compiles_*``), held by reference: JAX names a
# trace after the function traced, so the count follows a rename (tests/test_compile_counts.py).
# The checkpoint item that holds ``ControllerStates``: a name in the checkpoint format, so it stays
# what checkpoints already on disk call it.
CONTROLLERS = "policies"

COUNTED_PROGRAMS = {"compiles_update": rl_update, "compiles_sampler": sample_program}
# A multi-turn run's sampler programs (``rollout/multiturn.py``), counted besides (its rows only).
MULTITURN_PROGRAMS = {
  "compiles_prefill": multiturn.prefill_program,
  "compiles_turn": multiturn.turn_program,
  "compiles_observe": multiturn.observe_program,
  "compiles_assemble": multiturn.assemble_program,
}


def compile_counter(*, multiturn: bool = False, **more) -> CompileCounter:
  """A counter of the traces of ``COUNTED_PROGRAMS`` (and ``MULTITURN_PROGRAMS`` when
  ``multiturn``) and of ``more`` (metric → function)."""
  programs = {**COUNTED_PROGRAMS, **(MULTITURN_PROGRAMS if multiturn else {}), **more}
  return CompileCounter(**{metric: fn.__name__ for metric, fn in programs.items()})


@dataclasses.dataclass
class StepContext:
  """What the steps read and never change. Every phase's runtime (its controllers, its train
  step, its mixture) and, when the device's peak is known, its update's FLOP count are built with
  the context, before step 0: no step builds or lowers a program."""

  cfg: Config
  task: TaskData
  programs: Programs
  collector: Collector
  phases: tuple[Phase, ...]
  vocab_size: int
  ref_params: object = None  # the KL reference (kl_coef > 0)
  compiles: CompileCounter = dataclasses.field(default_factory=CompileCounter)
  # The rollout thread (``rollout.max_staleness`` >= 1 with an engine that runs beside the
  # trainer's programs, a sidecar): batches generate there while the update runs.
  rollout_pool: concurrent.futures.ThreadPoolExecutor | None = None
  peak_flops: float | None = None  # per device (run/mfu.py): the step logs train_mfu when known
  reward_terms: RewardTerms | None = None  # reward.terms (docs/algorithms.md §13); None: verifier
  runtimes: tuple[PhaseRuntime, ...] = dataclasses.field(init=False)
  _update_flops: tuple[float, ...] = dataclasses.field(init=False, default=())

  def __post_init__(self):
    self.runtimes = tuple(self._build_runtime(phase) for phase in self.phases)
    if self.peak_flops is not None:  # XLA's count lowers each phase's update (scan unrolled)
      mesh = self.programs.mesh
      self._update_flops = tuple(
        mfu.update_flops(p.cfg, self.vocab_size, mesh) for p in self.phases
      )

  def _build_runtime(self, phase: Phase) -> PhaseRuntime:
    pc = phase.cfg
    mixture = self.task.mixture(phase.mixture, "anneal_phase.mixture", stream=phase.index)
    update = self.programs.update(LossConfig.from_config(pc))
    return PhaseRuntime(phase, Methods(pc, self.vocab_size), update, mixture)

  def update_flops(self, index: int) -> float:
    """XLA's FLOPs of phase ``index``'s update (with ``peak_flops`` known)."""
    return self._update_flops[index]

  def runtime(self, index: int) -> PhaseRuntime:
    return self.runtimes[index]


def initial_loop(ctx: StepContext, train: TrainState) -> LoopState:
  """Step 0: the warm-started train state, empty statistics, fresh controllers."""
  rt = ctx.runtime(0)
  num_q = len(ctx.task.train_answers)
  return LoopState(
    train, init_stats(num_q), rt.methods.init(num_q), MixtureCursor.start(rt.mixture), 0
  )


def _enter_due_phase(ctx: StepContext, loop: LoopState, i: int) -> LoopState:
  """At the annealing phase's first step: a fresh cursor over its mixture, allocation bounds
  around its group size."""
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


def _issue_due(ctx: StepContext, loop: LoopState, i: int) -> LoopState:
  """Issue every batch due by step ``i``: up to step i + k (not past the run's last step, nor past
  the phase step i is in), all sampled by θ_i, the params step i starts from.

  A phase boundary drains the pipeline: the next phase's first batch is issued at its own first
  step. The loop's cursor, phase and allocation state are the issue side's; stopping there keeps
  them the trained phase's while its steps run (dynamic sampling's extra rounds draw from its
  mixture, E3's epoch ends re-rank its allocation state, which ``start_phase`` has not reset)."""
  last = max(i, min(i + ctx.cfg.rollout.max_staleness, ctx.cfg.steps - 1))
  following = [p.start for p in ctx.phases if p.start > i]
  if following:
    last = min(last, following[0] - 1)
  params = None

  def sampling_params():
    nonlocal params
    if params is None:
      params = loop.train.params
      if ctx.rollout_pool is not None:  # the update donates θ_i while the rollout thread reads it
        params = jax.tree.map(jnp.copy, params)
    return params

  loop = _regenerate_deferred(ctx, loop, i, sampling_params)
  while (j := loop.pending[-1].issue.step + 1 if loop.pending else i) <= last:
    loop = _issue(ctx, loop, j, i, sampling_params())
  return loop


def _regenerate_deferred(ctx: StepContext, loop: LoopState, i: int, sampling_params) -> LoopState:
  """Generate again the batches a checkpoint recorded without their rollouts (still running, or
  failed, when it was written; always after the generated ones): their decisions (questions,
  counts, τ) as issued, sampled by θ_i."""
  deferred = [p.issue for p in loop.pending if p.deferred]
  if not deferred:
    return loop
  loop = dataclasses.replace(loop, pending=tuple(p for p in loop.pending if not p.deferred))
  for issue in deferred:
    log.info("generating the batch of step %d again, by the params of step %d", issue.step + 1, i)
    loop = _launch(ctx, loop, dataclasses.replace(issue, version=i), sampling_params())
  return loop


def _issue(ctx: StepContext, loop: LoopState, j: int, i: int, params) -> LoopState:
  """Decide batch ``j``'s questions, counts and τ from what is known at step ``i``; start it."""
  loop = _enter_due_phase(ctx, loop, j)
  c, rt = ctx.cfg, ctx.runtime(loop.phase)
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
  return _launch(ctx, dataclasses.replace(loop, cursor=cursor), issue, params)


def _launch(ctx: StepContext, loop: LoopState, issue: batches.Issue, params) -> LoopState:
  """Start generating ``issue``'s batch (inline, or on the rollout thread) after those pending."""
  # EEPO's gate goes through the batches in issue order: each reads the state the last left.
  prev, gate = (loop.pending or (None,))[-1], loop.controllers.gate

  def job():
    return batches.generate(ctx, issue, params, prev.result().gate if prev else gate)

  if ctx.rollout_pool is None:
    flight = batches.InFlight.done(job())
  else:
    flight = batches.InFlight(issue, ctx.rollout_pool.submit(job))
  return dataclasses.replace(loop, pending=loop.pending + (flight,))


@dataclasses.dataclass(frozen=True)
class Arrival:
  """A taken batch, verified: the rows to train on and what the step learned about its data."""

  # Trained rows, rewards set (dynamic sampling: padded to a fixed count); rows in group B (no
  # question: padding, unscored answers) carry no tokens.
  rollouts: Rollouts
  stats: QuestionStats  # every sampled group counted
  verified: dict  # the verifier's counters, summed over rounds
  epochs_ended: tuple[int, ...]
  metrics: dict  # the model tokens its sampling generated (every round), dynamic sampling's
  qids_B: np.ndarray  # the trained groups' questions ...
  counts_B: np.ndarray  # ... and their allocated G


def _verify(ctx: StepContext, qids_B, rollouts: Rollouts) -> tuple[Rollouts, dict]:
  """The rollouts with their rewards, and the verifier's counters. Answers it did not score
  (timed out, skipped at its deadline, crashed) are set aside: a reward of 0 there would train on
  a verdict nobody gave. Their rows join the group of no question (index B), out of the update,
  the statistics and the group's advantage; the rest of their group trains as a smaller group.
  Responses the budget cut follow ``rollout.overlong`` (``dynamic.overlong``)."""
  group_ids_R = np.asarray(rollouts.group_ids_R)
  responses = ctx.task.decode(rollouts)
  qids_R = qids_B[group_ids_R]
  answers = ctx.task.train_answers[qids_R]
  terms = ctx.reward_terms
  if terms is None or terms.uses_verifier:
    verified = ctx.task.verify(responses, answers)
  else:
    verified = VerifyResult(np.zeros(len(responses), np.float32), 0, 0, 0, 0)
  rewards_R, scored_R, term_counters = verified.rewards_R, verified.scored, {}
  if terms is not None:  # reward.terms: the verifier's, a callable's, a reward model's (§13)
    prompts = ctx.task.prompt_texts(qids_R)
    got = terms.score(prompts, responses, list(answers), verified, group_ids_R, len(qids_B))
    rewards_R, scored_R, term_counters = got.rewards_R, got.kept_R, got.metrics
  # Each process verifies every row, under its own clock: process 0's verdicts are everyone's.
  rewards_R = np.asarray(rewards_R, np.float32)
  if rollouts.rewards_R is not None:  # the environment's trajectory reward (Collector.sample)
    rewards_R = rewards_R + np.asarray(rollouts.rewards_R, np.float32)
  rewards_R, scored_R = distributed.from_main((rewards_R, scored_R.astype(np.int32)))
  r = ctx.cfg.rollout
  finished_R = np.asarray(rollouts.finished_R, bool)
  rewards_R, kept_R = dynamic.overlong(rewards_R, finished_R, r.overlong, r.overlong_reward)
  scored = dataclasses.replace(rollouts, rewards_R=rewards_R)
  counters = {**verified.metrics(), "overlong_rows": float((~finished_R).sum()), **term_counters}
  return dynamic.set_aside(scored, scored_R.astype(bool) & kept_R, len(qids_B)), counters


def _arrive(ctx: StepContext, loop: LoopState, batch: batches.Batch, i: int):
  """Rewards and statistics of step ``i``'s batch (dynamic sampling: its further rounds, which
  advance the cursor); returns the loop with that cursor and the ``Arrival``."""
  issue = batch.issue
  generated = records.generated_tokens(batch.rollouts)
  first, verified = _verify(ctx, issue.qids_B, batch.rollouts)
  rounds = [(issue, first)]
  ended = (issue.epoch_ended,) if issue.epoch_ended >= 0 else ()
  if ctx.cfg.rollout.dynamic_sampling:
    loop, rounds, more, ended, extra_tokens = _more_rounds(ctx, loop, batch, i, rounds, ended)
    verified = {k: verified[k] + more.get(k, 0.0) for k in verified}
    generated += extra_tokens
  stats = loop.stats
  for r_issue, r_out in rounds:
    stats = update_stats(stats, r_issue.qids_B, np.asarray(r_out.group_ids_R), r_out.rewards_R, i)
  if not ctx.cfg.rollout.dynamic_sampling:
    rollouts = rounds[0][1]
    return loop, Arrival(
      rollouts,
      stats,
      verified,
      ended,
      {"generated_tokens": generated},
      np.asarray(issue.qids_B),
      issue.counts_B,
    )
  got = _dynamic_arrival(ctx, batch, rounds, stats, verified, ended)
  return loop, dataclasses.replace(got, metrics={**got.metrics, "generated_tokens": generated})


def _more_rounds(ctx: StepContext, loop: LoopState, batch, i: int, rounds, ended):
  """Dynamic sampling (docs/algorithms.md §10): draw rounds of B questions from the cursor,
  sampled by θ_i with the step's τ, until B informative groups or ``rollout.max_rounds`` rounds;
  also the model tokens the extra rounds generated. Allocation reads the statistics known at the
  step's start; the gate's decision is the step's."""
  c, rt = ctx.cfg, ctx.runtime(batch.issue.phase)
  b, verified, tokens = c.batch_questions, {}, 0.0
  found = int(dynamic.informative_groups(rounds[0][1].rewards_R, rounds[0][1].group_ids_R, b).sum())
  fire = batch.metrics.get("eepo_gate")
  mixture = ctx.runtime(loop.phase).mixture
  while found < b and len(rounds) < c.rollout.max_rounds:
    epoch_before = loop.cursor.epoch(mixture)
    qids_B, cursor = next_mixture_batch(loop.cursor, c.seed, mixture, b)
    loop = dataclasses.replace(loop, cursor=cursor)
    if cursor.epoch(mixture) != epoch_before:
      ended += (epoch_before,)
    counts_B = rt.methods.allocate(loop.controllers.alloc, loop.stats, jnp.asarray(qids_B))
    issue = dataclasses.replace(
      batch.issue,
      version=i,
      qids_B=np.asarray(qids_B, np.int32),
      counts_B=np.asarray(counts_B, np.int32),
      epoch_ended=-1,
    )

    def job(issue=issue, r=len(rounds)):
      return batches.generate(
        ctx,
        issue,
        loop.train.params,
        batch.gate,
        round_index=r,
        fire=None if fire is None else bool(fire),
      )

    # Through the rollout thread when there is one: the engine serves one caller at a time.
    out = (job() if ctx.rollout_pool is None else ctx.rollout_pool.submit(job).result()).rollouts
    tokens += records.generated_tokens(out)
    out, v = _verify(ctx, issue.qids_B, out)
    verified = {k: verified.get(k, 0.0) + v[k] for k in v}
    rounds.append((issue, out))
    found += int(dynamic.informative_groups(out.rewards_R, out.group_ids_R, b).sum())
  return loop, rounds, verified, ended, tokens


def _dynamic_arrival(ctx: StepContext, batch, rounds, stats, verified, ended) -> Arrival:
  """The B groups a dynamic-sampling step trains on, padded to its fixed row count."""
  c = ctx.cfg
  pc, methods = ctx.runtime(batch.issue.phase).phase.cfg, ctx.runtime(batch.issue.phase).methods
  b = c.batch_questions
  flags = [dynamic.informative_groups(out.rewards_R, out.group_ids_R, b) for _, out in rounds]
  present = [dynamic.groups_present(out.group_ids_R, b) for _, out in rounds]
  picks = dynamic.select_groups(np.concatenate(flags), b, np.concatenate(present))
  outs = [out for _, out in rounds]
  if not batch.issue.fresh:  # the whole batch is rescored under θ_i, extra rounds included
    outs = [dataclasses.replace(o, prox_logp_RxN=None) for o in outs]
  chosen = dynamic.gather_groups(outs, [(int(p) // b, int(p) % b) for p in picks])
  rows = dynamic.trained_rows(
    b,
    methods.allocator.max_count,
    pc.num_rollouts,
    c.rollout.max_rounds,
    pc.loss.mini_batches * pc.loss.micro_batches * c.mesh.data * c.mesh.fsdp,
  )
  informative = int(np.concatenate(flags).sum())
  metrics = dict(
    dynamic_rounds=float(len(rounds)),
    dynamic_groups_drawn=float(len(rounds) * b),
    dynamic_informative=float(informative),
    dynamic_fill=min(informative, b) / b,
  )
  padded = jax.tree.map(jnp.asarray, dynamic.pad_rows(chosen, rows, b, template=outs[0]))
  qids_B = np.concatenate([np.asarray(r.qids_B) for r, _ in rounds])[picks]
  counts_B = np.concatenate([np.asarray(r.counts_B) for r, _ in rounds])[picks]
  return Arrival(padded, stats, verified, ended, metrics, qids_B, counts_B)


def rl_step(ctx: StepContext, loop: LoopState, i: int) -> tuple[LoopState, dict]:
  """RL step ``i`` (0-based): the next loop state and the step's metrics row.

  Take the step's batch (issuing the batches due) → score it (rewards, the questions'
  statistics) → measure it (H_t, the clip, diagnostics) → update θ → advance the controllers →
  record the step."""
  t0 = time.time()
  loop, batch = _take(ctx, loop, i)
  t1 = time.time()
  loop, got = _arrive(ctx, loop, batch, i)
  rt, tau = ctx.runtime(batch.issue.phase), batch.issue.tau
  rollouts = got.rollouts
  if not batch.issue.fresh:  # sampled by older params: ℓ_prox and entropies under θ_i (§9)
    rollouts = ctx.collector.anchor(loop.train.params, rollouts, tau)
  # Entropy of the rollouts at τ under the params the update starts from: E3's H_t and the clip
  # controller's measured entropy, known before this step's update (over the model's tokens, §11).
  h_t = token_mean_entropy(rollouts)
  clip_state = rt.methods.update_clip(loop.controllers.clip, h_t)
  eps_high = rt.methods.clip.current(clip_state)
  hp = LossHparams.from_config(ctx.cfg.loss, ctx.cfg.modulation, tau, eps_high)
  measured = _diagnose(ctx, loop, batch, hp, i)  # before the update, which donates θ_i
  t2 = time.time()
  train, update, packed = _update(ctx, rt, loop.train, rollouts, hp)
  t3 = clock.ready_at(train, update)  # the new params too: the optimizer's work ends the update
  update = distributed.to_host(update)
  ctl = dataclasses.replace(
    loop.controllers,
    temperature=rt.methods.update_temperature(loop.controllers.temperature, h_t),
    clip=clip_state,
    gate=batch.gate,
  )
  for epoch in got.epochs_ended:  # a pass over the data ended: E3 re-ranks
    ctl = dataclasses.replace(ctl, alloc=rt.methods.on_epoch_end(ctl.alloc, got.stats, epoch))
  times, measured = (t0, t1, t2, t3), {**measured, **packed}
  record = _record(ctx, loop, batch, got, rollouts, update, hp, h_t, ctl, times, measured, i)
  return dataclasses.replace(loop, train=train, stats=got.stats, controllers=ctl), record


def _take(ctx: StepContext, loop: LoopState, i: int):
  """Issue the batches due, then wait for step ``i``'s: the loop without it, and the batch."""
  loop = _issue_due(ctx, loop, i)
  batch = loop.pending[0].result()
  assert batch.issue.step == i, (batch.issue.step, i)
  return dataclasses.replace(loop, pending=loop.pending[1:]), batch


def _diagnose(ctx: StepContext, loop: LoopState, batch, hp, i: int) -> dict:
  """The step's diagnostics (DynaMO's gradient-variance ratio when due), timed apart: they are
  not the step's work (``step_time`` leaves ``diagnostics_seconds`` out)."""
  if not diagnostics.grad_variance_due(ctx.cfg, i):
    return {}
  started = time.time()
  for pending in loop.pending:  # the engine serves one caller: let the thread finish
    pending.generated(wait=True)
  ratio = diagnostics.grad_variance_ratio(
    ctx, batch.issue, loop.train.params, hp, i, lambda q, r: _verify(ctx, q, r)
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


def _record(ctx: StepContext, loop, batch, got, rollouts, update, hp, h_t, ctl, times, measured, i):
  """The step's metrics row (and its text samples), of the rows of the step's questions: not
  padding, not set aside."""
  c, methods, tau = ctx.cfg, ctx.runtime(batch.issue.phase).methods, batch.issue.tau
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


# -- checkpoints -------------------------------------------------------------------------------------


def _replicated_global(tree, mesh):
  """Host-side state (question statistics, controllers) as arrays replicated over the global
  mesh: what a multi-process orbax save needs (a no-op with one process)."""
  if jax.process_count() == 1:
    return tree
  rep = sharding.replicated(mesh)
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(
      np.shape(x), rep, lambda index, x=np.asarray(x): x[index]
    ),
    tree,
  )


def _restored_rollouts(fields: dict) -> Rollouts:
  """A pending batch's rollouts from its checkpointed fields; one saved before the loss mask
  existed was single-turn, so its loss mask is its response mask (docs/algorithms.md §11)."""
  fields = {k: np.asarray(v) for k, v in fields.items()}
  fields.setdefault("loss_mask_RxN", fields["mask_RxN"])
  return Rollouts(**fields)


def _pending_tree(batch: batches.Batch) -> dict:
  """A generated batch's arrays: its rollouts' fields that are set, and its gate state."""
  fields = {
    f.name: np.asarray(v)
    for f in dataclasses.fields(Rollouts)
    if (v := getattr(batch.rollouts, f.name)) is not None
  }
  return {"rollouts": fields, "gate": batch.gate}


def _kept(train: TrainState) -> TrainState:
  """The train state as a checkpoint keeps it (also a ``TrainState`` of shardings): a LoRA run's
  adapters and their moments, not the frozen base, which the resumed run rebuilds as the first
  one did (warm start or HF checkpoint); a full fine-tuning run's whole state."""
  kept, _ = lora.partition(train.params, lora.policy_trainable(train.params))
  return dataclasses.replace(train, params=kept)


def save_loop(ckpt: Checkpointer, step: int, loop: LoopState, mesh, *, wait: bool = True) -> bool:
  """One checkpoint of the loop after ``step`` steps (asynchronous when the checkpointer is).

  Batches in flight are saved generated (waited for when ``wait``): a resumed run trains on
  exactly them. From the first one that is not (still running when not waited for, or failed),
  the checkpoint records their decisions alone, and the resumed run generates them again by its
  params (``_regenerate_deferred``): a batch's failure never costs the trained step."""
  done: list[batches.Batch] = []
  for p in loop.pending:
    if (batch := p.generated(wait)) is None:
      break
    done.append(batch)
  deferred = [p.issue.to_json() for p in loop.pending[len(done) :]]
  tree = {
    "state": _kept(loop.train),
    "stats": _replicated_global(loop.stats, mesh),
    CONTROLLERS: _replicated_global(loop.controllers, mesh),
  }
  meta = {"cursor": loop.cursor.to_json(), "phase": loop.phase, "step": step}
  if lora.has_adapters(loop.train.params):
    meta[lora.FINGERPRINT] = lora.fingerprint(loop.train.params)
  if done:
    tree["pending"] = [_replicated_global(_pending_tree(b), mesh) for b in done]
    meta["pending"] = [
      {
        "issue": b.issue.to_json(),
        "metrics": b.metrics,
        "fields": {
          k: [list(v.shape), v.dtype.name] for k, v in _pending_tree(b)["rollouts"].items()
        },
      }
      for b in done
    ]
  if deferred:
    meta["deferred"] = deferred
  return ckpt.save(step, tree, meta)


def restore_loop(
  ckpt: Checkpointer, step: int, like: LoopState, state_shardings, mesh
) -> LoopState:
  """The loop saved after ``step`` steps; ``like`` gives the structure (a fresh ``initial_loop``)."""
  rep = sharding.replicated(mesh)
  tree = {"state": _kept(like.train), "stats": like.stats, CONTROLLERS: like.controllers}
  target = {
    "state": _kept(state_shardings),
    "stats": jax.tree.map(lambda _: rep, like.stats),
    CONTROLLERS: jax.tree.map(lambda _: rep, like.controllers),
  }
  saved_meta = ckpt.restore_meta(step)
  saved = saved_meta.get("pending", [])
  if saved:
    tree["pending"] = [
      {
        "rollouts": {k: np.zeros(shape, dtype) for k, (shape, dtype) in p["fields"].items()},
        "gate": like.controllers.gate,
      }
      for p in saved
    ]
    target["pending"] = jax.tree.map(lambda _: rep, tree["pending"])
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, target
  )
  tree, meta = ckpt.restore(step, abstract)
  pending = tuple(
    batches.InFlight.done(
      batches.Batch(
        batches.Issue.from_json(p["issue"]),
        _restored_rollouts(arrays["rollouts"]),
        arrays["gate"],
        p["metrics"],
      )
    )
    for p, arrays in zip(saved, tree.get("pending", []))
  ) + tuple(
    batches.InFlight.later(batches.Issue.from_json(d)) for d in saved_meta.get("deferred", [])
  )
  cursor = MixtureCursor.from_json(meta["cursor"])
  train = _with_base(tree["state"], like.train, meta, ckpt.directory)
  return LoopState(train, tree["stats"], tree[CONTROLLERS], cursor, meta["phase"], pending)


def _with_base(restored: TrainState, like: TrainState, meta: dict, where: str) -> TrainState:
  """A LoRA run's restored adapters on the base this run rebuilt, after checking it is the one
  they were trained on; a full fine-tuning state as restored."""
  if not lora.has_adapters(like.params):
    return restored
  lora.check_base(meta.get(lora.FINGERPRINT), like.params, where)
  _, base = lora.partition(like.params, "adapters")
  return dataclasses.replace(restored, params=lora.combine(restored.params, base))
