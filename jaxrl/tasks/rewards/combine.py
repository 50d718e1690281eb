"""Reward terms combined into one reward per rollout (docs/algorithms.md §13).

A pure function over the terms' values ``f32[K, R]``, NaN where a term gave None (it does not
apply to that answer). ``sum-then-normalise`` (TRL's default) sums the weighted values that apply;
the update's group advantage (§1.1) then normalises the sum. ``normalise-then-sum`` (GDPO) first
turns each term into its own group advantage over the answers it applies to, so that a term of
large spread does not drown the others, then sums those with the weights; the update normalises
that sum again. Either way an answer no term applies to has no reward: the trainer sets it aside.
"""

from __future__ import annotations

import typing

import numpy as np

from jaxrl.rl.advantages import group_advantages
from jaxrl.tasks.sections import RewardCombine

COMBINE_RULES = typing.get_args(RewardCombine)


def combine_terms(
  values_KxR: np.ndarray, weights_K, group_ids_R: np.ndarray, num_groups: int, rule: str
) -> tuple[np.ndarray, np.ndarray]:
  """(f32[R] rewards, bool[R] whether any term applies) of K terms' values (NaN: None).

  ``group_ids_R`` in [0, num_groups): the question of each answer, read by
  ``normalise-then-sum``. An answer no term applies to gets 0 and False.
  """
  values_KxR = np.asarray(values_KxR, np.float32)
  weights_K = np.asarray(weights_K, np.float32)
  if values_KxR.ndim != 2 or weights_K.shape != values_KxR.shape[:1]:
    raise ValueError(
      f"combine_terms: values {values_KxR.shape} must be [K, R] with K = {weights_K.shape} weights"
    )
  if rule not in COMBINE_RULES:
    raise ValueError(f"combine_terms: rule {rule!r} is not one of {COMBINE_RULES}")
  applies_KxR = ~np.isnan(values_KxR)
  if rule == "normalise-then-sum":
    values_KxR = np.stack(
      [
        np.asarray(group_advantages(np.nan_to_num(v_R), group_ids_R, num_groups, valid_R=a_R))
        for v_R, a_R in zip(values_KxR, applies_KxR)
      ]
    ).reshape(values_KxR.shape)
  weighted_KxR = np.where(applies_KxR, weights_K[:, None] * values_KxR, 0.0)
  return weighted_KxR.sum(0).astype(np.float32), applies_KxR.any(0)
