"""``--plan``: what a run needs per device, from shapes alone (no weights, no allocation).

The model, the train state and a step's batch are built abstractly (``jax.eval_shape``) with the
shardings the trainer gives them (``sharding.tree_shardings``, ``sharding.shard_batch``), so the
state's byte counts are exact. Activations depend on what XLA makes of the step, so the plan gives
an analytic estimate and, when the process has the mesh's devices (real ones, or fake CPU devices
via ``XLA_FLAGS=--xla_force_host_platform_device_count=N``), lowers and compiles the very programs
the trainer jits and reports XLA's ``memory_analysis()``. Without enough devices the mesh is an
``AbstractMesh``: every sharded number is still exact, only the compiled part is skipped (and the
report says how to get it), because a table is more use to someone sizing a run than an error.

This module builds the ``Plan`` (the shapes, the shardings, the state's bytes, the memory check
before a run); the analytic estimate is ``plan_estimate``'s, the compiled programs are
``plan_compile``'s and the markdown is ``plan_report``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from jaxrl.config import Config
from jaxrl.fields import ConfigError
from jaxrl.methods import registry
from jaxrl.nn import arch, lora, model, reward_model
from jaxrl.parallel import sharding
from jaxrl.rl.programs import Programs, reference_copy
from jaxrl.rollout.sections import turn_tokens
from jaxrl.run.phases import run_phases
from jaxrl.run.plan_compile import (
  Compiled,
  analyse,
  compile_forget,
  compile_multiturn,
  compile_rescoring,
  compile_sampler,
  compile_train_step,
  shaped,
)
from jaxrl.run.plan_estimate import Estimate, activation_estimate, rollout_estimate
from jaxrl.tasks import task
from jaxrl.tasks.rewards.terms import rows_per_forward, term_model_dir
from jaxrl.tasks.term_specs import parse_terms

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


def reward_model_plan(cfg: Config, mesh) -> tuple[int, object]:
  """(bytes per device, a thunk lowering its forward) of ``reward.terms``' reward model, in the
  policy's compute dtype and sharded like it (``jaxrl.nn.reward_model``); (0, None) without one."""
  paths = [t.source for t in parse_terms(cfg.reward.terms) if t.kind == "model"]
  if not paths:
    return 0, None
  try:
    rm_cfg = reward_model.reward_model_config(
      term_model_dir(paths[0], ("config.json",), task=cfg.task, seed=cfg.seed), cfg.model.dtype
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
    return forward.lower(shaped(params, param_sh), score, tokens, mask)

  return held, lower


def _device_memory() -> int | None:
  # A local device: only those report their memory (another process's raises), and every
  # process runs the same kind.
  stats = jax.local_devices()[0].memory_stats()
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def build(cfg: Config, *, compile_steps: bool = True, rollout_side: bool = True) -> Plan:
  """Every number of the plan; ``render`` formats it. ``compile_steps=False`` skips XLA."""
  registry.check(allocation=cfg.allocation, temperature=cfg.temperature, clip=cfg.clip)
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
        t = turn_tokens(cfg.rollout, cfg.anneal_phase)  # one T for every phase
        compiled.extend(compile_multiturn(pc, graphdef, mcfg, params, param_sh, t))
      elif rollout_side and pc.rollout.engine == "jax":
        compiled.append(compile_sampler(pc, graphdef, mcfg, params, param_sh))
      elif rollout_side:
        compiled.append(compile_rescoring(pc, programs, params))
      if rollout_side and pc.eepo.enabled:
        compiled.append(compile_forget(pc, programs, params))
      if rollout_side and rm_lower is not None:
        compiled.append(analyse("reward model forward (reward_scores)", rm_lower))
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
