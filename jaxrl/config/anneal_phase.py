"""The run's config inside the annealing phase (Entropy Scheduling §5), derived from the run's, and
the multi-turn turn budget, which every phase shares. The phases themselves (when each starts,
which config and mixture it runs) are ``jaxrl.methods.phases``: where they start follows the
schedules of ``methods/``, a layer above this one."""

from __future__ import annotations

import dataclasses

from jaxrl.config.methods_sections import AnnealPhaseSection
from jaxrl.config.rollout_sections import RolloutSection
from jaxrl.config.schema import Config


def annealing(cfg: Config) -> Config:
  """The run's config inside the annealing phase: the phase's group size and response length, and
  every allocation bound scaled by G_anneal / G so the allocators keep their shape around the new G.
  """
  p = cfg.anneal_phase
  g = p.group_size or cfg.rollout.group_size
  ratio = g / cfg.rollout.group_size
  lo = lambda b: max(1, min(g, int(b * ratio)))  # scaled bounds still contain G
  hi = lambda b: max(g, -(-int(b * g) // cfg.rollout.group_size))
  a = cfg.allocation
  return dataclasses.replace(
    cfg,
    anneal_phase=dataclasses.replace(p, enabled=False),
    rollout=dataclasses.replace(
      cfg.rollout, group_size=g, max_new_tokens=_anneal_response(cfg.rollout, p)
    ),
    allocation=dataclasses.replace(
      a,
      g_min=lo(a.g_min),
      g_max=hi(a.g_max),
      e3=dataclasses.replace(a.e3, g_min_floor=lo(a.e3.g_min_floor), g_max_cap=hi(a.e3.g_max_cap)),
    ),
  )


def response_lengths(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> tuple[int, ...]:
  """Each phase's ``rollout.max_new_tokens``: the main phase's, and the annealing phase's if on."""
  if not anneal_phase.enabled:
    return (rollout.max_new_tokens,)
  return rollout.max_new_tokens, _anneal_response(rollout, anneal_phase)


def shortest_response(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> int:
  """The smallest ``rollout.max_new_tokens`` over the run's phases (main, and annealing if on)."""
  return min(response_lengths(rollout, anneal_phase))


def turn_tokens(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> int:
  """T, the tokens of one model turn at most (docs/algorithms.md §11): ``rollout.max_turn_tokens``,
  0 = the whole response; one value for every phase (the multi-turn programs compile once), so
  capped by the shortest phase's response."""
  shortest = shortest_response(rollout, anneal_phase)
  return min(rollout.max_turn_tokens or shortest, shortest)


def _anneal_response(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> int:
  """The annealing phase's response length: its own, 0 = the main phase's."""
  return anneal_phase.max_new_tokens or rollout.max_new_tokens
