"""Training phases: the main phase from step 0 and the optional annealing phase (ES §5).

A phase is a start step, the run's config inside it (``jaxrl.config.derived.annealing``: group size, response
length, allocation bounds) and the data mixture it samples. The loop asks ``phase_at(step)`` and
switches when the answer changes; a phase switch is the only point where shapes change.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl.config import Config, annealing
from jaxrl.methods import schedules
from jaxrl.methods.sections import AnnealPhaseSection, ClipSection, TemperatureSection


@dataclasses.dataclass(frozen=True)
class Phase:
  index: int
  start: int  # first RL step (0-based) of the phase
  cfg: Config  # the run's config inside the phase, whole: a step's parts take their sections of it
  mixture: str  # data mixture spec ("" = every training question)
  name: str


def anneal_start(
  *,
  anneal_phase: AnnealPhaseSection,
  clip: ClipSection,
  temperature: TemperatureSection,
  steps: int,
) -> int:
  """First step of the annealing phase: configured, or where the entropy schedule starts to anneal
  (the adaptive clip's stable-then-anneal schedule first, else E3's t_anneal, whose default
  ⌊0.6·steps⌋ also serves runs without an annealing schedule)."""
  if anneal_phase.start:
    return anneal_phase.start
  if clip.method == "adaptive" and clip.schedule == "stable_then_anneal":
    return math.ceil(schedules.stable_anneal_start(steps, clip.rho))
  return temperature.anneal_start or schedules.e3_anneal_start(steps)


def run_phases(cfg: Config) -> tuple[Phase, ...]:
  main = Phase(0, 0, cfg, "", "main")
  if not cfg.anneal_phase.enabled:
    return (main,)
  start = anneal_start(
    anneal_phase=cfg.anneal_phase, clip=cfg.clip, temperature=cfg.temperature, steps=cfg.steps
  )
  return main, Phase(1, start, annealing(cfg), cfg.anneal_phase.mixture, "annealing")


def phase_at(phases: tuple[Phase, ...], step: int) -> Phase:
  return [p for p in phases if p.start <= step][-1]
