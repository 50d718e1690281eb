"""The four papers' controllers, built once from the config and composed in the loop.

Each controller is a pure optax-style object from ``jaxrl.allocation`` / ``jaxrl.schedules``; this module
only chooses them from the config, holds their states in one checkpointable pytree, and jits their
per-step decisions (so a new value never recompiles). The loop (``jaxrl.run.loop.rl_step``) calls, per step:

  counts_B = allocate(...)           before sampling (E3 ranks / DynaMO priorities)
  τ_t      = temperature.current     before sampling; temperature.update(H_t) after it
  clip.update(H_t); ε_high = clip.current   after sampling, before the update (ES Algorithm 1)
  gate(H_stage1)                     EEPO, between the two rollout stages
  on_epoch_end(stats, epoch)         when the data cursor finishes a pass (E3 ranks and bounds)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.config import Config
from jaxrl.methods import registry, schedules
from jaxrl.types import pytree_dataclass

log = logging.getLogger(__name__)


@pytree_dataclass
class ControllerStates:
  """Every controller's state; saved in each checkpoint."""

  alloc: Any
  temperature: schedules.TemperatureState
  clip: schedules.ClipState
  gate: schedules.GateState


@dataclasses.dataclass
class Methods:
  """The run's controllers (allocator, temperature, clip, EEPO gate) and their jitted decisions."""

  # The phase's whole config: the controllers read the allocation, temperature, clip, eepo and
  # modulation sections and the rollout's group size and temperature, the loss's clip, the steps.
  cfg: Config
  vocab_size: int

  def __post_init__(self):
    cfg = self.cfg
    registry.check(cfg)
    self.allocator = registry.ALLOCATORS[cfg.allocation.method](
      cfg.allocation, cfg.rollout.group_size
    )
    self.temperature = registry.TEMPERATURES[cfg.temperature.method](
      cfg.temperature, tau0=cfg.rollout.temperature, steps=cfg.steps, vocab_size=self.vocab_size
    )
    self.clip = registry.CLIPS[cfg.clip.method](
      cfg.clip, eps_high=cfg.loss.eps_high, steps=cfg.steps
    )
    self.gate_ctl = schedules.eepo_gate_controller(cfg.eepo.m, cfg.eepo.alpha)
    if cfg.temperature.method == "e3" and cfg.clip.method == "adaptive":
      log.warning(
        "temperature.method=e3 and clip.method=adaptive both steer entropy; running both "
        "(docs/algorithms.md §7 allows it), but their effects are confounded"
      )
    self.allocate = jax.jit(self.allocator.allocate)
    self.on_epoch_end = jax.jit(self.allocator.on_epoch_end)
    self.update_temperature = jax.jit(self.temperature.update)
    self.update_clip = jax.jit(self.clip.update)
    self.gate = jax.jit(self.gate_ctl.gate)

  def init(self, num_questions: int) -> ControllerStates:
    return ControllerStates(
      alloc=self.allocator.init(num_questions),
      temperature=self.temperature.init(),
      clip=self.clip.init(),
      gate=self.gate_ctl.init(),
    )

  def start_phase(self, alloc, stats, epoch: int, num_questions: int):
    """Allocation state at the start of a phase with a new group size (bounds scale with G).

    E3 recomputes its epoch's bounds around the new G and re-ranks on the statistics so far (the
    new mixture's questions need ranks relative to each other); the others restart from ``init``
    (DynaMO's state is only its bounds; it reads live statistics).
    """
    if self.cfg.allocation.method == "e3":
      return self.on_epoch_end(alloc, stats, epoch - 1)
    return self.allocator.init(num_questions)

  def describe(self) -> str:
    c = self.cfg
    parts = [
      f"allocation={c.allocation.method}",
      f"temperature={c.temperature.method}",
      f"clip={c.clip.method}" + (f"({c.clip.schedule})" if c.clip.method == "adaptive" else ""),
      f"eepo={'on' if c.eepo.enabled else 'off'}",
      f"modulation={'on' if c.modulation.enabled else 'off'}",
    ]
    return ", ".join(parts)


def eepo_stage1_counts(counts_B: jnp.ndarray) -> jnp.ndarray:
  """Stage-1 rollouts per question: ⌊G_i/2⌋, and ⌈G_i/2⌉ for the first half of the odd G_i.

  **Decision:** the paper takes ⌊G_i/2⌋. With G_i chosen per question that sum varies, and so would
  the sampler's shapes; rounding half of the odd groups up (their number is even, as Σ G_i = R is)
  makes both stages exactly R/2 rollouts, so neither recompiles.
  """
  odd_B = (counts_B % 2).astype(jnp.int32)
  rank_B = jnp.cumsum(odd_B) - odd_B  # index of each odd group among the odd ones
  up_B = odd_B * (rank_B < jnp.sum(odd_B) // 2)
  return counts_B // 2 + up_B
