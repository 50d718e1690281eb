"""The run's config inside the annealing phase (Entropy Scheduling §5), derived from the run's, and
the multi-turn turn budget, which every phase shares. The phases themselves (when each starts,
which config and mixture it runs) are ``jaxrl.methods.phases``: where they start follows the
schedules of ``methods/``, a layer above this one."""

from __future__ import annotations

import dataclasses

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
      cfg.rollout, group_size=g, max_new_tokens=p.max_new_tokens or cfg.rollout.max_new_tokens
    ),
    allocation=dataclasses.replace(
      a,
      g_min=lo(a.g_min),
      g_max=hi(a.g_max),
      e3=dataclasses.replace(a.e3, g_min_floor=lo(a.e3.g_min_floor), g_max_cap=hi(a.e3.g_max_cap)),
    ),
  )


def shortest_response(cfg: Config) -> int:
  """The smallest ``rollout.max_new_tokens`` over the run's phases (main, and annealing if on)."""
  lengths = [cfg.rollout.max_new_tokens]
  if cfg.anneal_phase.enabled:
    lengths.append(annealing(cfg).rollout.max_new_tokens)
  return min(lengths)


def turn_tokens(cfg: Config) -> int:
  """T, the tokens of one model turn at most (docs/algorithms.md §11): ``rollout.max_turn_tokens``,
  0 = the whole response; one value for every phase (the multi-turn programs compile once), so
  capped by the shortest phase's response."""
  shortest = shortest_response(cfg)
  return min(cfg.rollout.max_turn_tokens or shortest, shortest)
