"""The RL loop as data: ``LoopState`` is what a checkpoint holds, ``rl_step`` is one step.

``rl_step(ctx, loop, i) -> (loop, record)``: data cursor → question ids → allocation → rollouts at
τ (one stage, or EEPO's two) → rewards on the host → question statistics → clip controller →
jitted GRPO update → temperature controller → epoch-end re-ranking → the step's metrics row.
Nothing in it touches files: the trainer saves, logs and stops around it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import rng
from jaxrl.config import Config
from jaxrl.methods.phases import Phase, phase_at
from jaxrl.methods.policies import Methods, PolicyStates
from jaxrl.parallel import distributed, sharding
from jaxrl.rl.programs import ForgetConfig, Programs, rl_step_config, step_hparams
from jaxrl.rl.stats import init_stats, update_stats
from jaxrl.rollout.collect import Collector, token_mean_entropy
from jaxrl.rollout.eepo import two_stage_rollouts
from jaxrl.run import records
from jaxrl.run.checkpoint import Checkpointer
from jaxrl.run.compiles import CompileCounter
from jaxrl.tasks.data.cursor import Mixture, MixtureCursor, next_mixture_batch
from jaxrl.tasks.task import TaskData
from jaxrl.types import QuestionStats, TrainState, pytree_dataclass, static_field

log = logging.getLogger(__name__)


@pytree_dataclass
class LoopState:
  """Everything the loop carries from one step to the next, and exactly what a checkpoint holds:
  arrays (train state, question statistics, controller states) as leaves, the data cursor and the
  phase index as static fields (saved as JSON)."""

  train: TrainState
  stats: QuestionStats
  policies: PolicyStates
  cursor: MixtureCursor = static_field()
  phase: int = static_field()


@dataclasses.dataclass(frozen=True)
class PhaseRuntime:
  """What a phase samples and compiles with: its policies, its train step, its data mixture."""

  phase: Phase
  methods: Methods
  update: object  # the phase's jitted GRPO update (Programs.update)
  mixture: Mixture


@dataclasses.dataclass
class StepContext:
  """What the steps read and never change (the phase runtimes are built once, on first use)."""

  cfg: Config
  task: TaskData
  programs: Programs
  collector: Collector
  phases: tuple[Phase, ...]
  vocab_size: int
  ref_params: object = None  # the KL reference (kl_coef > 0)
  compiles: CompileCounter = dataclasses.field(default_factory=CompileCounter)
  _runtimes: dict = dataclasses.field(default_factory=dict)

  def runtime(self, index: int) -> PhaseRuntime:
    if index not in self._runtimes:
      phase = self.phases[index]
      pc = phase.cfg
      mixture = self.task.mixture(phase.mixture, "anneal_phase.mixture", stream=index)
      if index:
        log.info(
          "%s phase from step %d: %d questions (%s), G=%d, max_new_tokens=%d",
          phase.name,
          phase.start + 1,
          mixture.size,
          phase.mixture or "all",
          pc.rollout.group_size,
          pc.rollout.max_new_tokens,
        )
      update = self.programs.update(rl_step_config(pc))
      self._runtimes[index] = PhaseRuntime(phase, Methods(pc, self.vocab_size), update, mixture)
    return self._runtimes[index]


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
  rt = ctx.runtime(phase.index)
  num_q = len(ctx.task.train_answers)
  alloc = rt.methods.start_phase(loop.policies.alloc, loop.stats, epoch, num_q)
  return dataclasses.replace(
    loop,
    policies=dataclasses.replace(loop.policies, alloc=alloc),
    cursor=MixtureCursor.start(rt.mixture, epoch0=epoch),
    phase=phase.index,
  )


def _rollouts(ctx: StepContext, rt: PhaseRuntime, loop: LoopState, qids_B, counts_B, tau, i):
  """The step's rollouts (one stage, or EEPO's two), the gate state, and EEPO's metrics."""
  c, t, pc = ctx.cfg, ctx.task, rt.phase.cfg
  ids, mask = t.train_prompt_ids[qids_B], t.train_prompt_mask[qids_B]
  params, key, n = loop.train.params, rng.key(c.seed, rng.RL, i), pc.rollout.max_new_tokens
  ctx.collector.engine.set_weights(params, i)
  if not c.eepo.enabled:
    out, info = ctx.collector.sample(params, ids, mask, counts_B, tau, key, n)
    return out, loop.policies.gate, info
  two = two_stage_rollouts(
    ctx.collector,
    rt.methods.gate,
    loop.policies.gate,
    params,
    ids,
    mask,
    counts_B,
    tau,
    key,
    version=i,
    max_new_tokens=n,
    forget=ForgetConfig.from_config(c),
    old_logp_from=c.eepo.old_logp_from,
  )
  return two.rollouts, two.gate_state, two.metrics


def rl_step(ctx: StepContext, loop: LoopState, i: int) -> tuple[LoopState, dict]:
  """RL step ``i`` (0-based): the next loop state and the step's metrics row."""
  t0 = time.time()
  loop = _enter_due_phase(ctx, loop, i)
  c, rt = ctx.cfg, ctx.runtime(loop.phase)
  methods, policies = rt.methods, loop.policies
  epoch_before = loop.cursor.epoch(rt.mixture)
  qids_B, cursor = next_mixture_batch(loop.cursor, c.seed, rt.mixture, c.batch_questions)
  counts_B = methods.allocate(policies.alloc, loop.stats, jnp.asarray(qids_B))
  tau = policies.temperature.tau
  rollouts, gate_state, eepo = _rollouts(ctx, rt, loop, qids_B, counts_B, tau, i)
  t1 = time.time()
  group_ids_R = np.asarray(rollouts.group_ids_R)
  verified = ctx.task.verify(ctx.task.decode(rollouts), ctx.task.train_answers[qids_B[group_ids_R]])
  rewards_R = verified.rewards_R
  stats = update_stats(loop.stats, qids_B, group_ids_R, rewards_R, i)
  # Entropy of the rollouts at τ under the params that sampled them: E3's H_t and the clip
  # controller's measured entropy, known before this step's update.
  h_t = token_mean_entropy(rollouts)
  clip_state = methods.update_clip(policies.clip, h_t)
  hp = step_hparams(c, tau, methods.clip.current(clip_state))
  batch = dataclasses.replace(rollouts, rewards_R=jnp.asarray(rewards_R, jnp.float32))
  t2 = time.time()
  train, update = rt.update(
    loop.train, sharding.shard_batch(batch, ctx.programs.mesh), hp, ctx.ref_params
  )
  update = distributed.to_host(update)
  t3 = time.time()
  policies = dataclasses.replace(
    policies,
    temperature=methods.update_temperature(policies.temperature, h_t),
    clip=clip_state,
    gate=gate_state,
  )
  if cursor.epoch(rt.mixture) != epoch_before:  # a pass over the data ended: E3 re-ranks
    policies = dataclasses.replace(
      policies, alloc=methods.on_epoch_end(policies.alloc, stats, epoch_before)
    )
  record = records.step_record(
    update=update,
    rollouts=rollouts,
    rewards_R=rewards_R,
    entropy=h_t,
    num_groups=c.batch_questions,
    decisions=records.decision_metrics(methods, policies, tau, hp),
    counts_B=counts_B,
    times=(t0, t1, t2, t3),
    context=_context(ctx, rt, cursor),
    verified=verified,
    eepo=eepo,
  )
  return LoopState(train, stats, policies, cursor, loop.phase), record


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


def save_loop(ckpt: Checkpointer, step: int, loop: LoopState, mesh) -> bool:
  """One checkpoint of the loop after ``step`` steps (asynchronous when the checkpointer is)."""
  tree = {
    "state": loop.train,
    "stats": _replicated_global(loop.stats, mesh),
    "policies": _replicated_global(loop.policies, mesh),
  }
  return ckpt.save(step, tree, {"cursor": loop.cursor.to_json(), "phase": loop.phase, "step": step})


def restore_loop(
  ckpt: Checkpointer, step: int, like: LoopState, state_shardings, mesh
) -> LoopState:
  """The loop saved after ``step`` steps; ``like`` gives the structure (a fresh ``initial_loop``)."""
  rep = sharding.replicated(mesh)
  target = {
    "state": state_shardings,
    "stats": jax.tree.map(lambda _: rep, like.stats),
    "policies": jax.tree.map(lambda _: rep, like.policies),
  }
  tree = {"state": like.train, "stats": like.stats, "policies": like.policies}
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, target
  )
  tree, meta = ckpt.restore(step, abstract)
  cursor = MixtureCursor.from_json(meta["cursor"])
  return LoopState(tree["state"], tree["stats"], tree["policies"], cursor, meta["phase"])
