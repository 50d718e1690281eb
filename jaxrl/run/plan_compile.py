"""``--plan``'s compiled part: the trainer's own programs (``Programs``' update, π_old rescoring
and EEPO's forgetting step, the JAX and multi-turn samplers) lowered on abstract inputs of a
phase's shapes, carrying the trainer's shardings, and compiled; ``Compiled`` is XLA's
``memory_analysis()`` of one. ``mfu`` lowers the train step through here too.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from jaxrl.config import Config, forget_config, loss_config
from jaxrl.parallel import sharding
from jaxrl.rl import packing, step
from jaxrl.rl.losses import LossHparams
from jaxrl.rl.programs import Programs, reference_copy
from jaxrl.rollout import sampler, turn_programs
from jaxrl.run.plan_estimate import prompt_len
from jaxrl.types import Rollouts


@dataclasses.dataclass(frozen=True)
class Compiled:
  """XLA's memory analysis of one compiled program, per device."""

  name: str
  seconds: float  # lower + compile
  argument: int
  output: int
  alias: int  # outputs that reuse donated argument buffers
  temp: int
  code: int

  @property
  def peak(self) -> int:
    return self.argument + self.output - self.alias + self.temp


def shaped(tree, shardings):
  """ShapeDtypeStructs carrying shardings: what ``jit(...).lower`` takes for real arrays."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def abstract_batch(pc: Config, rows_sharding=None) -> Rollouts:
  """A step's rollouts with rewards as the loop hands them to the update (``shard_batch``'s
  shardings, or none = host arrays)."""
  return abstract_rollouts(
    pc.num_rollouts, prompt_len(pc), pc.rollout.max_new_tokens, rows_sharding
  )


def abstract_rollouts(r: int, p: int, n: int, rows_sharding=None) -> Rollouts:
  """``Rollouts`` of ShapeDtypeStructs: r rows of p prompt and n response tokens."""

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding)

  return Rollouts(
    prompt_ids_RxP=sds((r, p), jnp.int32),
    prompt_mask_RxP=sds((r, p), jnp.bool_),
    tokens_RxN=sds((r, n), jnp.int32),
    mask_RxN=sds((r, n), jnp.bool_),
    loss_mask_RxN=sds((r, n), jnp.bool_),
    behaviour_logp_RxN=sds((r, n), jnp.float32),
    prox_logp_RxN=sds((r, n), jnp.float32),
    entropy_RxN=sds((r, n), jnp.float32),
    lengths_R=sds((r,), jnp.int32),
    group_ids_R=sds((r,), jnp.int32),
    finished_R=sds((r,), jnp.bool_),
    rewards_R=sds((r,), jnp.float32),
  )


def analyse(name: str, lower) -> Compiled:
  t0 = time.perf_counter()
  mem = lower().compile().memory_analysis()
  return Compiled(
    name,
    time.perf_counter() - t0,
    int(mem.argument_size_in_bytes),
    int(mem.output_size_in_bytes),
    int(mem.alias_size_in_bytes),
    int(mem.temp_size_in_bytes),
    int(mem.generated_code_size_in_bytes),
  )


def lower_train_step(pc: Config, programs: Programs, params):
  """The phase's GRPO update, the very program ``Trainer`` runs (``Programs.update``), lowered on
  abstract inputs of the phase's shapes."""
  update = programs.update(loss_config(pc))
  state_sh = programs.state_shardings
  state = shaped(
    jax.eval_shape(
      functools.partial(step.init_state, tx=programs.tx, trainable=programs.trainable), params
    ),
    state_sh,
  )
  hp = jax.eval_shape(
    lambda: LossHparams.from_config(
      pc.loss, pc.modulation, pc.rollout.temperature, pc.loss.eps_high
    )
  )
  ref = shaped(params, state_sh.params) if reference_copy(pc.loss, pc.model) else None
  rows_sh = sharding.batch_sharding(programs.mesh)
  batch = abstract_batch(pc, rows_sh)
  loss = pc.loss
  pack = abstract_packing(pc, rows_sh, pc.num_rollouts, loss.mini_batches, loss.micro_batches)
  return update.lower(state, batch, hp, ref, pack)


def abstract_packing(
  pc: Config, rows_sharding, rows: int, mini_batches: int, micro_batches: int
) -> packing.Packing | None:
  """With ``loss.packing``, the packed layout of ``rows`` rows with the most buffer rows (one per
  sequence: every sequence as long as the budget), so the plan sizes the largest packed buffers
  a program meets; None for a padded one."""
  if not pc.loss.packing:
    return None
  largest = packing.largest(rows, mini_batches, micro_batches)
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows_sharding)  # noqa: E731
  return dataclasses.replace(largest, slot_R=sds(largest.slot_R), offset_R=sds(largest.offset_R))


def compile_train_step(pc: Config, programs: Programs, params) -> Compiled:
  return analyse("train step (rl_update)", lambda: lower_train_step(pc, programs, params))


def compile_sampler(pc: Config, graphdef, mcfg, params, param_sh) -> Compiled:
  """The JAX sampler's jitted body with host prompts, as ``JaxEngine.generate`` calls it."""
  p, b = prompt_len(pc), pc.batch_questions
  sds = jax.ShapeDtypeStruct
  args = (
    graphdef,
    shaped(params, param_sh),
    sds((b, p), jnp.int32),
    sds((b, p), jnp.bool_),
    sds((b,), jnp.int32),
    jax.eval_shape(lambda: jax.random.PRNGKey(0)),
    sds((), jnp.float32),
    sds((), jnp.float32),
  )
  static = dict(
    num_rollouts=pc.num_rollouts,
    max_new_tokens=pc.rollout.max_new_tokens,
    eos_id=(1,),
    pad_id=0,
    model_cfg=mcfg,
    greedy=False,
  )
  return analyse("JAX sampler (generate)", lambda: sampler.sample_program.lower(*args, **static))


def compile_multiturn(pc: Config, graphdef, mcfg, params, param_sh, turn_tokens: int):
  """The multi-turn sampler's three jitted programs with host prompts and observations, as
  ``multiturn.generate`` calls them (docs/algorithms.md §11); the turn state between them is
  the prefill's output."""
  p, b, r, o = (
    prompt_len(pc),
    pc.batch_questions,
    pc.num_rollouts,
    pc.rollout.max_observation_tokens,
  )
  sds = jax.ShapeDtypeStruct
  weights = shaped(params, param_sh)
  prompts = (sds((b, p), jnp.int32), sds((b, p), jnp.bool_), sds((b,), jnp.int32))
  prefill_static = dict(
    num_rollouts=r, max_new_tokens=pc.rollout.max_new_tokens, pad_id=0, model_cfg=mcfg
  )
  prefill = functools.partial(turn_programs.prefill_program, **prefill_static)
  state = jax.eval_shape(lambda w, *a: prefill(graphdef, w, *a), weights, *prompts)[0]
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  tau = sds((), jnp.float32)
  turn_static = dict(
    max_turn_tokens=turn_tokens, eos_id=(1,), stop_ids=(2,), pad_id=0, greedy=False
  )
  observation = (sds((r, o), jnp.int32), sds((r, o), jnp.bool_), sds((r,), jnp.bool_))
  return (
    analyse(
      "multi-turn prefill (prefill_program)",
      lambda: turn_programs.prefill_program.lower(graphdef, weights, *prompts, **prefill_static),
    ),
    analyse(
      "multi-turn turn (turn_program)",
      lambda: turn_programs.turn_program.lower(
        graphdef, weights, state, key, tau, tau, **turn_static
      ),
    ),
    analyse(
      "multi-turn observation (observe_program)",
      lambda: turn_programs.observe_program.lower(graphdef, weights, state, *observation, pad_id=0),
    ),
  )


def compile_rescoring(pc: Config, programs: Programs, params) -> Compiled:
  """vLLM's π_old rescoring as the loop runs it (``Programs.logp``): R rows sharded over the
  data axes, in ``step.sequential_chunks`` sequential chunks."""
  batch = abstract_batch(pc, sharding.batch_sharding(programs.mesh))
  score = programs.logp(pc.loss.logprob_chunk)
  tau = jax.ShapeDtypeStruct((), jnp.float32)
  rows = (
    batch.prompt_ids_RxP,
    batch.prompt_mask_RxP,
    batch.tokens_RxN,
    batch.mask_RxN,
  )
  micro = step.sequential_chunks(pc.num_rollouts, pc.loss.micro_batches)
  pack = abstract_packing(pc, batch.prompt_ids_RxP.sharding, pc.num_rollouts, 1, micro)
  return analyse(
    "pi_old rescoring (logp_responses_chunked)",
    lambda: score.lower(
      shaped(params, programs.param_shardings), *rows, tau, micro=micro, pack=pack
    ),
  )


def compile_forget(pc: Config, programs: Programs, params) -> Compiled:
  """EEPO's forgetting step θ' = θ + η∇L over the stage-1 rows (R/2), in as many strided chunks
  as the loop uses (``step.sequential_chunks``), the very program it runs (``Programs.forget``)."""
  batch = abstract_batch(pc, sharding.batch_sharding(programs.mesh))
  half = pc.num_rollouts // 2

  def rows(x):
    return jax.ShapeDtypeStruct((half, *x.shape[1:]), x.dtype, sharding=x.sharding)

  forget = programs.forget(forget_config(pc.eepo, pc.loss))
  tau = jax.ShapeDtypeStruct((), jnp.float32)
  stage1 = (
    batch.prompt_ids_RxP,
    batch.prompt_mask_RxP,
    batch.tokens_RxN,
    batch.mask_RxN,
    batch.loss_mask_RxN,
  )
  micro = step.sequential_chunks(half, pc.loss.micro_batches)
  pack = abstract_packing(pc, batch.prompt_ids_RxP.sharding, half, 1, micro)
  return analyse(
    "EEPO forgetting step (eepo_forget)",
    lambda: forget.lower(
      shaped(params, programs.param_shardings), *map(rows, stage1), tau, pack, micro=micro
    ),
  )
