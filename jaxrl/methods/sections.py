"""The four papers' config sections, beside their controllers (``controllers``, ``allocation``,
``schedules``): ``allocation`` (E3, DynaMO), ``temperature`` (E3), ``clip`` (Entropy Scheduling),
``eepo`` and ``anneal_phase`` (the annealing curriculum). DynaMO's token-level ``modulation`` is a
term of the loss: ``jaxrl.rl.sections``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.fields import (
  AT_LEAST_0,
  AT_LEAST_1,
  FRACTION,
  POSITIVE,
  Range,
  check_ranges,
  need,
)

OldLogpFrom = Literal["rollout", "policy"]


UnlearnClip = Literal["straight-through", "paper"]


@dataclasses.dataclass(frozen=True)
class E3AllocationSection:
  """E3's bounds curriculum (``allocation.method = "e3"``)."""

  step: int = 2  # G_min/G_max widen by this per epoch
  g_min_floor: int = 4
  g_max_cap: int = 12
  curriculum: bool = True  # False: bounds stay (allocation.g_min, allocation.g_max)

  def check(self) -> None:
    # A negative step narrows the bounds each epoch (the curriculum silently off); a floor
    # below 1 lets a question get no rollout.
    check_ranges("allocation.e3", self, dict(step=AT_LEAST_0, g_min_floor=AT_LEAST_1))


@dataclasses.dataclass(frozen=True)
class DynamoAllocationSection:
  """DynaMO's priorities (``allocation.method = "dynamo"``)."""

  min_history: int = 4
  floor: float = 0.01
  mastered: float = 0.85

  def check(self) -> None:
    # ``mastered`` is compared with an accuracy: above 1 nothing is ever mastered, at 0 everything
    # is; ``floor`` is the least priority, which a negative one would make a negative share.
    check_ranges(
      "allocation.dynamo",
      self,
      dict(min_history=AT_LEAST_0, floor=AT_LEAST_0, mastered=Range(0, low_ok=False, high=1)),
    )


@dataclasses.dataclass(frozen=True)
class AllocationSection:
  """How the step's fixed budget R = batch_questions * rollout.group_size is split over questions."""

  method: str = "uniform"  # a name of methods.registry.ALLOCATORS: uniform | e3 | dynamo | ...
  g_min: int = 4  # DynaMO bounds (and E3 bounds without the curriculum)
  g_max: int = 12
  e3: E3AllocationSection = E3AllocationSection()
  dynamo: DynamoAllocationSection = DynamoAllocationSection()

  def check(self) -> None:
    self.e3.check()
    self.dynamo.check()
    need(
      1 <= self.g_min <= self.g_max,
      "allocation.g_min",
      f"need 1 <= g_min <= g_max, got g_min={self.g_min} g_max={self.g_max}",
    )


@dataclasses.dataclass(frozen=True)
class TemperatureSection:
  """The sampling temperature: fixed, or E3's entropy-targeting scheduler (with annealing)."""

  method: str = "fixed"  # fixed (rollout.temperature) | e3 (entropy targeting)
  anneal: bool = True  # E3 annealing of the entropy target (Eq. 5)
  anneal_start: int = 0  # 0: floor(0.6 * steps)
  eta: float = 0.9
  tau_min: float = 0.1
  tau_max: float = 3.0

  def check(self) -> None:
    need(0 < self.tau_min <= self.tau_max, "temperature.tau_min", "need 0 < tau_min <= tau_max")
    # eta: the entropy target anneals from H_init to eta * H_init (E3 Eq. 5)
    check_ranges("temperature", self, dict(tau_max=POSITIVE, anneal_start=AT_LEAST_0, eta=FRACTION))


@dataclasses.dataclass(frozen=True)
class ClipSection:
  """ε_high: fixed, or Entropy Scheduling's adaptive clip-higher tracking an entropy schedule."""

  method: str = "fixed"  # fixed (loss.eps_high) | adaptive (Entropy Scheduling)
  schedule: str = "constant"  # constant | cosine | stable_then_anneal
  h_target: float = 0.2  # constant target, and H_0 of the decaying schedules
  h_end: float = 0.1
  rho: float = 0.1  # stable_then_anneal: the last rho * steps anneal
  c0: float = 0.28
  c_min: float = 0.2
  c_max: float = 0.4
  delta: float = 0.01
  window: int = 4
  warmup: int = 5

  def check(self) -> None:
    need(
      self.c_min <= self.c0 <= self.c_max,
      "clip.c0",
      f"need c_min <= c0 <= c_max, got {self.c_min}, {self.c0}, {self.c_max}",
    )
    need(self.window >= 1, "clip.window", "must be >= 1")
    check_ranges("clip", self, dict(rho=Range(0, low_ok=False, high=1), delta=POSITIVE))
    entropies = ("warmup", "c_min", "h_target", "h_end")
    check_ranges("clip", self, dict.fromkeys(entropies, AT_LEAST_0))


@dataclasses.dataclass(frozen=True)
class EEPOSection:
  """EEPO's sample-then-forget two-stage rollouts (the gate and the unlearning step)."""

  enabled: bool = False
  m: int = 3  # gate: mean entropy of the last m steps ...
  alpha: float = 0.3  # ... below alpha fires the unlearning step
  lr: float = 3e-3  # eta of the plain SGD ascent step on the rollout copy
  eps_l: float = 1e-3
  eps_r: float = 1e-2
  old_logp_from: OldLogpFrom = "rollout"  # rollout (θ', the paper) | policy (recompute under θ)
  # log(1 − p)'s floor at log eps_r: "straight-through" keeps the unfloored gradient (a dominant
  # token is still pushed down); "paper": p clipped to [eps_l, 1 − eps_r] (EEPO Eq. 8–9), no
  # gradient where p > 1 − eps_r (docs/algorithms.md §5.2)
  unlearn_clip: UnlearnClip = "straight-through"

  def check(self) -> None:
    need(self.m >= 1, "eepo.m", "must be >= 1")
    check_ranges("eepo", self, dict(lr=POSITIVE, eps_l=POSITIVE, eps_r=POSITIVE, alpha=AT_LEAST_0))


@dataclasses.dataclass(frozen=True)
class AnnealPhaseSection:
  """The annealing-phase curriculum (Entropy Scheduling §5): from step ``start`` on, the run samples
  a different data mixture, more rollouts per question and longer responses. The switch compiles the
  train step and the sampler once for the new shapes; nothing recompiles afterwards."""

  enabled: bool = False
  start: int = 0  # first step; 0 = where the entropy schedule anneals (else 0.6·steps)
  mixture: str = ""  # "" = keep; else "LEVEL:WEIGHT,..." e.g. "4x4+:1,5x5+:2"
  group_size: int = 0  # 0 = keep (paper: 8 → 32); allocation bounds scale with it
  max_new_tokens: int = 0  # 0 = keep (paper: 4k → 16k)

  def check(self) -> None:
    keep = Range(0, note=" (0 = keep)")
    check_ranges(
      "anneal_phase",
      self,
      dict(
        start=Range(0, note=" (0 = where the entropy schedule anneals)"),
        group_size=keep,
        max_new_tokens=keep,
      ),
    )
