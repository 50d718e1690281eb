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

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.methods import registry, schedules
from jaxrl.methods.sections import AllocationSection, ClipSection, EEPOSection, TemperatureSection
from jaxrl.rl.sections import ModulationSection
from jaxrl.types import pytree_dataclass

log = logging.getLogger(__name__)


@pytree_dataclass
class ControllerStates:
  """Every controller's state; saved in each checkpoint."""

  alloc: Any
  temperature: schedules.TemperatureState
  clip: schedules.ClipState
  gate: schedules.GateState


class Methods:
  """The run's controllers (allocator, temperature, clip, EEPO gate) and their jitted decisions,
  built from a phase's sections and the few run-wide values they read: the group size G
  (``rollout.group_size``), the sampling temperature τ0 (``rollout.temperature``), the clip
  ``loss.eps_high``, the RL steps and the vocabulary size."""

  def __init__(
    self,
    *,
    allocation: AllocationSection,
    temperature: TemperatureSection,
    clip: ClipSection,
    eepo: EEPOSection,
    modulation: ModulationSection,
    group_size: int,
    tau0: float,
    eps_high: float,
    steps: int,
    vocab_size: int,
  ):
    registry.check(allocation=allocation, temperature=temperature, clip=clip)
    self.allocation_method = allocation.method
    self.allocator = registry.ALLOCATORS[allocation.method](allocation, group_size)
    self.temperature = registry.TEMPERATURES[temperature.method](
      temperature, tau0=tau0, steps=steps, vocab_size=vocab_size
    )
    self.clip = registry.CLIPS[clip.method](clip, eps_high=eps_high, steps=steps)
    self.gate_ctl = schedules.eepo_gate_controller(eepo.m, eepo.alpha)
    if temperature.method == "e3" and clip.method == "adaptive":
      log.warning(
        "temperature.method=e3 and clip.method=adaptive both steer entropy; running both "
        "(docs/algorithms.md §7 allows it), but their effects are confounded"
      )
    self.description = ", ".join(
      [
        f"allocation={allocation.method}",
        f"temperature={temperature.method}",
        f"clip={clip.method}" + (f"({clip.schedule})" if clip.method == "adaptive" else ""),
        f"eepo={'on' if eepo.enabled else 'off'}",
        f"modulation={'on' if modulation.enabled else 'off'}",
      ]
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
    if self.allocation_method == "e3":
      return self.on_epoch_end(alloc, stats, epoch - 1)
    return self.allocator.init(num_questions)

  def describe(self) -> str:
    return self.description


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
