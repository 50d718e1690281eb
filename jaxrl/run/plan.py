"""``--plan``: what a run needs per device, from shapes alone (no weights, no allocation).

The model, the train state and a step's batch are built abstractly (``jax.eval_shape``) with the
shardings the trainer gives them (``sharding.tree_shardings``, ``sharding.shard_batch``), so the
state's byte counts are exact. Activations depend on what XLA makes of the step, so the plan gives
an analytic estimate and, when the process has the mesh's devices (real ones, or fake CPU devices
via ``XLA_FLAGS=--xla_force_host_platform_device_count=N``), lowers and compiles the very programs
the trainer jits and reports XLA's ``memory_analysis()``. Without enough devices the mesh is an
``AbstractMesh``: every sharded number is still exact, only the compiled part is skipped (and the
report says how to get it), because a table is more use to someone sizing a run than an error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from jaxrl.config import Config, ConfigError, LossConfig, parse_terms
from jaxrl.config.anneal_phase import turn_tokens
from jaxrl.methods import registry
from jaxrl.methods.phases import run_phases
from jaxrl.nn import arch, attention, lora, model, reward_model
from jaxrl.nn.attention import block_size
from jaxrl.parallel import sharding
from jaxrl.rl import packing, step
from jaxrl.rl.losses import LossHparams
from jaxrl.rl.programs import ForgetConfig, Programs, reference_copy
from jaxrl.rollout import multiturn, sampler
from jaxrl.rollout.sampler import segment_ends
from jaxrl.tasks import task
from jaxrl.tasks.rewards.terms import rows_per_forward, term_model_dir
from jaxrl.types import Rollouts

GiB = 1024**3
FAKE_DEVICES = "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count={n}"
# The last key of a parameter's path → the weight kind the table shows (in model order).
_KINDS = {
  "embed_tokens": "embed",
  "q_proj": "q_proj",
  "k_proj": "k_proj",
  "v_proj": "v_proj",
  "o_proj": "o_proj",
  "q_bias": "q/k/v bias",
  "k_bias": "q/k/v bias",
  "v_bias": "q/k/v bias",
  "q_norm": "q/k norm",
  "k_norm": "q/k norm",
  "gate_proj": "mlp gate_proj",
  "up_proj": "mlp up_proj",
  "down_proj": "mlp down_proj",
  "input_layernorm": "layer norms",
  "post_attention_layernorm": "layer norms",
  "norm": "final norm",
  "lm_head": "lm_head",
}


@dataclasses.dataclass(frozen=True)
class WeightRow:
  """One weight kind: its leaves share shape, dtype, spec and shard."""

  kind: str
  leaves: int  # arrays of this kind (L per kind in the loop layout)
  shape: tuple[int, ...]
  dtype: str
  spec: str  # the PartitionSpec
  shard_shape: tuple[int, ...]  # on one device
  bytes_per_device: int  # all leaves of the kind


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Analytic per-device bytes: named items and the total they add up to."""

  rows: int  # rows per device
  tokens: int  # sequence length (T, or KV slots S)
  items: tuple[tuple[str, int], ...]
  total: int


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


@dataclasses.dataclass(frozen=True)
class PhasePlan:
  """One phase's step shapes and what they cost per device."""

  name: str
  cfg: Config  # the phase's config (the annealing phase has its own shapes)
  activations: Estimate  # the train step's largest micro-batch
  rollout: Estimate  # the JAX sampler, or vLLM's π_old rescoring pass
  compiled: tuple[Compiled, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
  source: str  # where the architecture came from
  model_cfg: model.ModelConfig
  mesh_shape: dict[str, int]
  devices: str  # what this process has, e.g. "8 x cpu"
  device_memory: int | None  # bytes per device, when the backend reports it
  weights: tuple[WeightRow, ...]
  params: int  # bytes per device
  opt_state: int
  ref_params: int  # 0 without KL, and with LoRA (the reference is the base: adapters off)
  adapters: int  # bytes per device of the LoRA adapters (part of params); 0 without LoRA
  phases: tuple[PhasePlan, ...]
  skipped: str  # why nothing was compiled ("" = compiled)
  # bytes per device of a reward model's params and head (reward.terms' model:PATH), held for the
  # whole run beside the train state; 0 without one
  reward_model: int = 0

  @property
  def state(self) -> int:
    return self.params + self.opt_state + self.ref_params

  @property
  def resident(self) -> int:
    """What every device holds between steps: the train state and a reward model."""
    return self.state + self.reward_model

  @property
  def trained(self) -> int:
    """Bytes per device of what the update differentiates: the adapters, or every param."""
    return self.adapters or self.params

  def train_peak(self, ph: PhasePlan) -> int:
    """The update's estimated peak per device: resident state + gradients + activations."""
    return self.resident + grad_copies(ph.cfg) * self.trained + ph.activations.total

  def rollout_peak(self, ph: PhasePlan) -> int:
    """The rollouts' estimated peak per device: resident state + the sampler's (or the
    rescoring's) buffers."""
    return self.resident + ph.rollout.total

  def peak(self, ph: PhasePlan) -> int:
    """The phase's estimated peak per device: the larger of the two (more where rollouts run
    beside the update, ``rollout.max_staleness`` >= 1)."""
    return max(self.train_peak(ph), self.rollout_peak(ph))


def grad_copies(pc: Config) -> int:
  """Gradient trees live at once: the accumulator and the micro-batch's own when accumulating."""
  return 2 if pc.loss.micro_batches > 1 else 1


# -- shapes and shardings ---------------------------------------------------------------------------


def architecture(cfg: Config) -> tuple[model.ModelConfig, str]:
  """The checkpoint's config.json when it is there, else the model section; and which one."""
  m = cfg.model
  if m.checkpoint and arch.missing_checkpoint(m) is None:
    return arch.model_config(m), f"config.json of {m.checkpoint}"
  vocab = m.vocab_size
  if not vocab and cfg.task.name in task.BUILTIN_TASKS:
    from jaxrl.tasks.data.tokenizer import vocab_size  # lazy: it imports transformers (heavy)

    vocab = vocab_size(task.tokenizer_variant(cfg.task))
  if not vocab:
    raise ConfigError(
      "model.vocab_size",
      "is 0 (= the tokenizer's) and there is no checkpoint to read it from: set it to plan the run",
    )
  missing = f" ({m.checkpoint} is not downloaded)" if m.checkpoint else ""
  return arch.from_section(m, vocab), f"the config's model section{missing}"


def prompt_len(cfg: Config) -> int:
  """P as the task pads prompts: task.max_prompt_len, or a built-in task's longest + BOS."""
  if cfg.task.max_prompt_len:
    return cfg.task.max_prompt_len
  if cfg.task.name not in task.BUILTIN_TASKS:
    raise ConfigError("task.max_prompt_len", "the plan needs a fixed prompt length: set it")
  return task.prompt_len(cfg.task)


def plan_mesh(cfg: Config):
  """(mesh, "") on the mesh's devices; (AbstractMesh, why) when this process has too few."""
  m = cfg.mesh
  need = m.data * m.fsdp * m.tensor
  have = jax.devices()
  if need <= len(have):
    return sharding.make_mesh(m.data, m.fsdp, m.tensor), ""
  why = (
    f"the mesh data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} needs {need} devices and "
    f"this process has {len(have)} ({have[0].platform}). To compile the step here, plan on "
    f"fake CPU devices: {FAKE_DEVICES.format(n=need)} python -m jaxrl.main --config=... --plan"
  )
  return AbstractMesh(
    (m.data, m.fsdp, m.tensor), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3
  ), why


def bytes_per_device(tree, shardings) -> int:
  """Σ over leaves of one device's shard size × itemsize."""
  sizes = jax.tree.map(
    lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize, tree, shardings
  )
  return int(sum(jax.tree.leaves(sizes)))


def weight_rows(params, shardings) -> tuple[WeightRow, ...]:
  """The weight table: one row per kind, in model order."""
  found: dict[str, WeightRow] = {}
  for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings)):
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    kind = _KINDS.get(name, name)
    shard = tuple(s.shard_shape(x.shape))
    size = math.prod(shard) * np.dtype(x.dtype).itemsize
    spec = "P(" + ", ".join("None" if a is None else repr(a) for a in s.spec) + ")"
    row = found.get(kind)
    found[kind] = (
      WeightRow(kind, 1, tuple(x.shape), str(x.dtype), spec, shard, size)
      if row is None
      else dataclasses.replace(
        row, leaves=row.leaves + 1, bytes_per_device=row.bytes_per_device + size
      )
    )
  order = list(dict.fromkeys(_KINDS.values()))
  return tuple(sorted(found.values(), key=lambda r: order.index(r.kind) if r.kind in order else 99))


# -- analytic activations ---------------------------------------------------------------------------


def _split(dim: int, mesh_shape: dict, axis: str) -> int:
  """A dimension's size on one device under ``logical_to_spec``'s rule (split only if divisible)."""
  n = mesh_shape[axis]
  return dim // n if dim % n == 0 else dim


def _holds_scores(rows: int, t: int, m: model.ModelConfig, mesh_shape: dict) -> bool:
  """Whether attention over T tokens from slot 0 (the update's forward, the rescoring) holds
  [rows, H, block, T] scores: not where cuDNN's fused attention takes the call, by the trainer's
  own test (``attention.fused_implementation``) on these shapes."""
  k = _split(m.num_kv_heads, mesh_shape, "tensor")
  a = _split(m.num_heads, mesh_shape, "tensor") // k
  dtype = jnp.dtype(m.dtype)
  q = jax.ShapeDtypeStruct((rows, t, k, a, m.head_dim), dtype)
  keys = jax.ShapeDtypeStruct((rows, k, m.head_dim, t), dtype)
  return attention.fused_implementation(q, keys, 0) is None


def _layer_internals(rows: int, t: int, m: model.ModelConfig, mesh_shape: dict) -> int:
  """One layer's activations per token: the two norms' outputs and residuals, q/k/v before and
  after RoPE, the attention output, gate, silu(gate), up and their product."""
  h, k = _split(m.num_heads, mesh_shape, "tensor"), _split(m.num_kv_heads, mesh_shape, "tensor")
  f = _split(m.intermediate_size, mesh_shape, "tensor")
  d, e = m.hidden_size, m.head_dim
  return rows * t * (5 * d + 3 * h * e + 3 * k * e + 4 * f) * jnp.dtype(m.dtype).itemsize


def activation_estimate(pc: Config, m: model.ModelConfig, mesh_shape: dict) -> Estimate:
  """Activations of the train step's largest micro-batch on one device, forward + backward.

  Assumes the micro-batch's rows are split over data x fsdp and heads / mlp over tensor. With remat
  "full" the backward keeps each layer's input and recomputes one layer at a time, so one layer's
  internals are live at once. Attention runs in blocks of at most ``attention_block`` queries
  (``block_size``), each rematerialised: one block's f32 scores [rows, H, block, T], probs and
  their two gradients.
  """
  rows = pc.num_rollouts // (pc.loss.mini_batches * pc.loss.micro_batches)
  rows //= mesh_shape["data"] * mesh_shape["fsdp"]
  t = prompt_len(pc) + pc.rollout.max_new_tokens
  b = jnp.dtype(m.dtype).itemsize
  d, e = m.hidden_size, m.head_dim
  h, k = _split(m.num_heads, mesh_shape, "tensor"), _split(m.num_kv_heads, mesh_shape, "tensor")
  f = _split(m.intermediate_size, mesh_shape, "tensor")
  internals = _layer_internals(rows, t, m, mesh_shape)
  q_block = block_size(t, m.attention_block)
  # f32 scores + probs, and their gradients
  attention = rows * h * q_block * t * 2 * (4 + b) if _holds_scores(rows, t, m, mesh_shape) else 0
  inputs = m.num_layers * rows * t * d * b
  dots = m.num_layers * rows * t * (h * e + 2 * k * e + 2 * d + 2 * f) * b  # projection outputs
  chunk = pc.loss.logprob_chunk * _split(m.vocab_size, mesh_shape, "tensor") * 4
  layers = {
    "none": m.num_layers * (internals + attention),
    "full": inputs + internals + attention,
    "dots": dots + internals + attention,
    "offload": inputs + internals + attention,
  }[m.remat]
  items = [
    ("layer inputs kept for the backward, all layers", inputs if m.remat != "none" else 0),
    ("projection outputs kept (remat dots)", dots if m.remat == "dots" else 0),
    ("one layer's internals", internals),
    (
      f"one attention block: f32 scores [rows, H, {q_block}, T] + probs, and their gradients",
      attention,
    ),
    (f"log-prob chunk: f32 logits [C={pc.loss.logprob_chunk}, V]", chunk),
  ]
  if m.remat == "offload":
    items.append(("(projection outputs parked in host memory, not counted)", dots))
  return Estimate(rows, t, tuple(i for i in items if i[1]), layers + chunk)


def rollout_estimate(pc: Config, m: model.ModelConfig, mesh_shape: dict) -> Estimate:
  """The JAX sampler's buffers on one device, or (vLLM) the π_old rescoring forward's one layer;
  both assume the R rows are split over data x fsdp."""
  rows = -(-pc.num_rollouts // (mesh_shape["data"] * mesh_shape["fsdp"]))
  p = prompt_len(pc)
  s = p + pc.rollout.max_new_tokens
  h, k = _split(m.num_heads, mesh_shape, "tensor"), _split(m.num_kv_heads, mesh_shape, "tensor")
  if pc.rollout.engine != "jax":  # rescoring: one micro-batch chunk at a time
    rows = -(-rows // pc.loss.micro_batches)
    q_block = block_size(s, m.attention_block)
    scores = rows * h * q_block * s * 4 if _holds_scores(rows, s, m, mesh_shape) else 0
    internals = _layer_internals(rows, s, m, mesh_shape)
    chunk = pc.loss.logprob_chunk * _split(m.vocab_size, mesh_shape, "tensor") * 4
    items = (
      ("one layer's internals", internals),
      (f"one attention block's f32 scores [R, H, {q_block}, T]", scores),
      (f"log-prob chunk: f32 logits [C={pc.loss.logprob_chunk}, V]", chunk),
    )
    return Estimate(rows, s, tuple(i for i in items if i[1]), internals + scores + chunk)
  cache = 2 * m.num_layers * rows * k * s * m.head_dim * jnp.dtype(m.dtype).itemsize
  # Each distinct prompt is prefilled once (then copied to its rows); a prefill sees its P slots.
  prompts = -(-pc.batch_questions // (mesh_shape["data"] * mesh_shape["fsdp"]))
  prefill_block = block_size(p, m.attention_block)
  prefill = prompts * h * prefill_block * p * 4
  # The last decode segment's cache is grown from the one before, k then v: while one of them is
  # copied, its previous segment's array exists too (XLA's compiled peak at qwen7b agrees).
  ends = segment_ends(pc.rollout.max_new_tokens)
  growing = cache // 2 * (p + ends[-2]) // s if len(ends) > 1 else 0
  logits = rows * _split(m.vocab_size, mesh_shape, "tensor") * 4
  shared = (
    ("KV cache: k [L, R, K, E, P+N] and v [L, R, K, P+N, E]", cache),
    (
      f"prefill: one attention block's f32 scores [B, H, {prefill_block}, P]",
      prefill,
    ),
    ("decode: f32 logits [R, V]", logits),
  )
  if pc.task.environment:
    items = shared + multiturn_items(pc, m, mesh_shape, rows)
  else:
    growth = "the previous decode segment's k (or v) while the last one's is grown from it"
    items = shared + ((growth, growing),)
  items = tuple(i for i in items if i[1])
  return Estimate(rows, s, items, sum(v for _, v in items))


def multiturn_items(
  pc: Config, m: model.ModelConfig, mesh_shape: dict, rows: int
) -> tuple[tuple[str, int], ...]:
  """What the multi-turn sampler (``rollout.multiturn``, docs/algorithms.md §11) holds besides the
  KV cache, the prefill and the decode logits, on one device of ``rows`` rows: its turn state,
  carried between the host-driven programs (``_TurnState``), the observation block the host
  fills, and the observation's forward over the turn's last token and O positions. Its cache has
  P + N slots from the prefill on (one cache for every turn): no decode segment grows from
  another (the compiled prefill pads its P slots into it without a second copy)."""
  p, n, o = prompt_len(pc), pc.rollout.max_new_tokens, pc.rollout.max_observation_tokens
  s = p + n
  h = _split(m.num_heads, mesh_shape, "tensor")
  observe_block = block_size(1 + o, m.attention_block)
  return (
    ("multi-turn: tokens i32, log-probs f32, entropies f32 [R, N]", rows * n * 12),
    ("multi-turn: response mask bool [R, N] (model and environment tokens)", rows * n),
    ("multi-turn: loss mask bool [R, N] (the model's tokens)", rows * n),
    ("multi-turn: valid cache slots bool [R, P+N]", rows * s),
    # next position, turns, tool calls (i32); in turn, asked, ended, finished, done (bool).
    ("multi-turn: per-turn row state: 3 i32 + 5 bool [R]", rows * (3 * 4 + 5)),
    (f"multi-turn: observation block: ids i32 + mask bool [R, O={o}]", rows * o * 5),
    (
      f"observation forward: one attention block's f32 scores [R, H, {observe_block}, P+N]",
      rows * h * observe_block * s * 4,
    ),
    (
      f"observation forward: one layer's internals over 1 + O = {1 + o} positions",
      _layer_internals(rows, 1 + o, m, mesh_shape),
    ),
  )


# -- compiled programs ------------------------------------------------------------------------------


def _shaped(tree, shardings):
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


def _analyse(name: str, lower) -> Compiled:
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
  update = programs.update(LossConfig.from_config(pc))
  state_sh = programs.state_shardings
  state = _shaped(
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
  ref = _shaped(params, state_sh.params) if reference_copy(pc.loss, pc.model) else None
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
  return _analyse("train step (rl_update)", lambda: lower_train_step(pc, programs, params))


def compile_sampler(pc: Config, graphdef, mcfg, params, param_sh) -> Compiled:
  """The JAX sampler's jitted body with host prompts, as ``JaxEngine.generate`` calls it."""
  p, b = prompt_len(pc), pc.batch_questions
  sds = jax.ShapeDtypeStruct
  args = (
    graphdef,
    _shaped(params, param_sh),
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
  return _analyse("JAX sampler (generate)", lambda: sampler.sample_program.lower(*args, **static))


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
  weights = _shaped(params, param_sh)
  prompts = (sds((b, p), jnp.int32), sds((b, p), jnp.bool_), sds((b,), jnp.int32))
  prefill_static = dict(
    num_rollouts=r, max_new_tokens=pc.rollout.max_new_tokens, pad_id=0, model_cfg=mcfg
  )
  prefill = functools.partial(multiturn.prefill_program, **prefill_static)
  state = jax.eval_shape(lambda w, *a: prefill(graphdef, w, *a), weights, *prompts)[0]
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  tau = sds((), jnp.float32)
  turn_static = dict(
    max_turn_tokens=turn_tokens, eos_id=(1,), stop_ids=(2,), pad_id=0, greedy=False
  )
  observation = (sds((r, o), jnp.int32), sds((r, o), jnp.bool_), sds((r,), jnp.bool_))
  return (
    _analyse(
      "multi-turn prefill (prefill_program)",
      lambda: multiturn.prefill_program.lower(graphdef, weights, *prompts, **prefill_static),
    ),
    _analyse(
      "multi-turn turn (turn_program)",
      lambda: multiturn.turn_program.lower(graphdef, weights, state, key, tau, tau, **turn_static),
    ),
    _analyse(
      "multi-turn observation (observe_program)",
      lambda: multiturn.observe_program.lower(graphdef, weights, state, *observation, pad_id=0),
    ),
  )


def compile_rescoring(pc: Config, programs: Programs, params) -> Compiled:
  """vLLM's π_old rescoring as the loop runs it (``Programs.score``): R rows sharded over the
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
  return _analyse(
    "pi_old rescoring (logp_responses_chunked)",
    lambda: score.lower(
      _shaped(params, programs.param_shardings), *rows, tau, micro=micro, pack=pack
    ),
  )


def compile_forget(pc: Config, programs: Programs, params) -> Compiled:
  """EEPO's forgetting step θ' = θ + η∇L over the stage-1 rows (R/2), in as many strided chunks
  as the loop uses (``step.sequential_chunks``), the very program it runs (``Programs.forget``)."""
  batch = abstract_batch(pc, sharding.batch_sharding(programs.mesh))
  half = pc.num_rollouts // 2

  def rows(x):
    return jax.ShapeDtypeStruct((half, *x.shape[1:]), x.dtype, sharding=x.sharding)

  forget = programs.forget(ForgetConfig.from_config(pc.eepo, pc.loss))
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
  return _analyse(
    "EEPO forgetting step (eepo_forget)",
    lambda: forget.lower(
      _shaped(params, programs.param_shardings), *map(rows, stage1), tau, pack, micro=micro
    ),
  )


def reward_model_plan(cfg: Config, mesh) -> tuple[int, object]:
  """(bytes per device, a thunk lowering its forward) of ``reward.terms``' reward model, in the
  policy's compute dtype and sharded like it (``jaxrl.nn.reward_model``); (0, None) without one."""
  paths = [t.source for t in parse_terms(cfg.reward.terms) if t.kind == "model"]
  if not paths:
    return 0, None
  try:
    rm_cfg = reward_model.reward_model_config(
      term_model_dir(cfg, paths[0], ("config.json",)), cfg.model.dtype
    )
  except (OSError, ValueError) as e:  # before check_inputs reads it: name the field here too
    raise ConfigError("reward.terms", f"term model:{paths[0]}: {e}") from None
  graphdef, params = model.abstract(rm_cfg)
  param_sh = sharding.tree_shardings(params, mesh)
  score_1xD = jax.ShapeDtypeStruct((1, rm_cfg.hidden_size), rm_cfg.param_dtype)
  held = bytes_per_device(params, param_sh) + math.prod(score_1xD.shape) * score_1xD.dtype.itemsize
  rows_sh = sharding.batch_sharding(mesh)
  rows, t = rows_per_forward(cfg.reward.model_rows, mesh), cfg.reward.model_max_tokens
  tokens = jax.ShapeDtypeStruct((rows, t), jnp.int32, sharding=rows_sh)
  mask = jax.ShapeDtypeStruct((rows, t), jnp.bool_, sharding=rows_sh)
  score = jax.ShapeDtypeStruct(score_1xD.shape, score_1xD.dtype, sharding=sharding.replicated(mesh))
  forward = jax.jit(functools.partial(reward_model.reward_scores, graphdef, pad_id=0))

  def lower():
    return forward.lower(_shaped(params, param_sh), score, tokens, mask)

  return held, lower


def _device_memory() -> int | None:
  # A local device: only those report their memory (another process's raises), and every
  # process runs the same kind.
  stats = jax.local_devices()[0].memory_stats()
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def build(cfg: Config, *, compile_steps: bool = True, rollout_side: bool = True) -> Plan:
  """Every number of the plan; ``render`` formats it. ``compile_steps=False`` skips XLA."""
  registry.check(cfg)
  mcfg, source = architecture(cfg)
  mesh, skipped = plan_mesh(cfg)
  if not compile_steps and not skipped:
    skipped = "compilation was not asked for"
  graphdef, params = model.abstract(mcfg)
  programs = Programs.for_run(cfg.optim, graphdef, params, mesh)
  param_sh, opt_sh = programs.param_shardings, programs.state_shardings.opt_state
  trained = lora.partition(params, programs.trainable)[0]
  opt = jax.eval_shape(programs.tx.init, trained)
  mesh_shape = dict(mesh.shape)
  rm_bytes, rm_lower = reward_model_plan(cfg, mesh)
  phases = []
  for phase in run_phases(cfg):
    pc = phase.cfg
    compiled = []
    if not skipped:
      compiled.append(compile_train_step(pc, programs, params))
      if rollout_side and pc.rollout.engine == "jax" and cfg.task.environment:
        t = turn_tokens(cfg)  # one T for every phase
        compiled.extend(compile_multiturn(pc, graphdef, mcfg, params, param_sh, t))
      elif rollout_side and pc.rollout.engine == "jax":
        compiled.append(compile_sampler(pc, graphdef, mcfg, params, param_sh))
      elif rollout_side:
        compiled.append(compile_rescoring(pc, programs, params))
      if rollout_side and pc.eepo.enabled:
        compiled.append(compile_forget(pc, programs, params))
      if rollout_side and rm_lower is not None:
        compiled.append(_analyse("reward model forward (reward_scores)", rm_lower))
    phases.append(
      PhasePlan(
        phase.name,
        pc,
        activation_estimate(pc, mcfg, mesh_shape),
        rollout_estimate(pc, mcfg, mesh_shape),
        tuple(compiled),
      )
    )
  devices = jax.devices()
  p_bytes = bytes_per_device(params, param_sh)
  return Plan(
    source=source,
    model_cfg=mcfg,
    mesh_shape=mesh_shape,
    devices=f"{len(devices)} x {devices[0].platform}",
    device_memory=_device_memory(),
    weights=weight_rows(params, param_sh),
    params=p_bytes,
    opt_state=bytes_per_device(opt, opt_sh),
    ref_params=p_bytes if reference_copy(cfg.loss, cfg.model) else 0,
    adapters=bytes_per_device(*(lora.partition(t, "adapters")[0] for t in (params, param_sh)))
    if lora.has_adapters(params)
    else 0,
    phases=tuple(phases),
    skipped=skipped,
    reward_model=rm_bytes,
  )


def _capacity(device_memory: int | None) -> tuple[int, str]:
  """(bytes one device may use, what they are): the device's own memory where the backend
  reports it (GPU), else this host's RAM shared by its local devices (CPU)."""
  if device_memory:
    return device_memory, "device memory"
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return ram // max(jax.local_device_count(), 1), "host RAM per local device"


# The analytic estimate against XLA's compiled peak (tiny configs, P + N = 512 to 8k tokens, on a
# CPU): the update's came out 1.5 to 1.8 times XLA's (the attention block's scores, probs and their
# gradients counted whole), the sampler's 0.95 to 1.1 times. A run is refused only where the
# estimate exceeds twice what a device has: that excess cannot make a run that fits look too large,
# and a run refused needs more than the device by XLA's count too.
OVER_CAPACITY = 2.0


def memory_error(cfg: Config) -> ConfigError | None:
  """A run whose estimated peak per device (``Plan.peak``, no XLA) exceeds ``OVER_CAPACITY``
  times what a device has, as a ConfigError naming the sequence length (or the model, when the
  train state is the largest item) and the size, before anything is allocated; None: it may fit
  (``--plan`` compiles the programs and gives XLA's own numbers)."""
  p = build(cfg, compile_steps=False)
  capacity, what = _capacity(p.device_memory)
  worst = max(p.phases, key=p.peak)
  need = p.peak(worst)
  if need <= OVER_CAPACITY * capacity:
    return None
  train = p.train_peak(worst) >= p.rollout_peak(worst)
  items = [
    ("train state", p.state),
    ("reward model", p.reward_model),
    *(worst.activations if train else worst.rollout).items,
  ]
  name, size = max(items, key=lambda item: item[1])
  # The sequence length drives the largest buffers unless the state itself is the problem.
  field = "model" if name == "train state" else "rollout.max_new_tokens"
  return ConfigError(
    field,
    f"the run needs about {need / GiB:.1f} GiB per device ({name}: {size / GiB:.1f} GiB; "
    f"R={worst.cfg.num_rollouts} rows, P+N={worst.rollout.tokens} tokens), over "
    f"{OVER_CAPACITY:g} x the {capacity / GiB:.1f} GiB of {what} (the estimate's margin; --plan "
    "shows every item)",
  )
