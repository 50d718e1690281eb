"""Dynamic sampling (docs/algorithms.md §10, DAPO §3.3): which of the groups drawn in a step's
rounds it trains on, laid out in a fixed number of rows.

A step draws rounds of B questions until B groups have a learning signal (rewards not all equal)
or the rounds run out; it trains on the first B informative groups in draw order, filled up with
non-informative ones in draw order. Group sizes differ per question (E3, DynaMO), so the B groups
hold a varying number of rows: they are padded to ``rows`` (static, so nothing recompiles) with
rows that carry no token (mask False) in an extra group ``B`` of their own (advantage 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.types import Rollouts


def informative_groups(rewards_R, group_ids_R, num_groups: int) -> np.ndarray:
  """bool[num_groups]: the group has rollouts and their rewards are not all equal (§1); rows of
  no group (ids ≥ num_groups: ``set_aside``) are left out."""
  rewards_R, group_ids_R = np.asarray(rewards_R, np.float64), np.asarray(group_ids_R)
  kept_R = group_ids_R < num_groups
  rewards_R, group_ids_R = rewards_R[kept_R], group_ids_R[kept_R]
  high = np.full(num_groups, -np.inf)
  low = np.full(num_groups, np.inf)
  np.maximum.at(high, group_ids_R, rewards_R)
  np.minimum.at(low, group_ids_R, rewards_R)
  return high > low


def select_groups(informative: np.ndarray, batch: int, present: np.ndarray | None = None):
  """Indices into the drawn groups (in draw order) of the ``batch`` groups a step trains on: the
  first informative ones, then, if fewer than ``batch``, the first non-informative ones with
  rows (``present``: not every answer set aside), then the empty ones."""
  informative = np.asarray(informative, bool)
  present = np.ones_like(informative) if present is None else np.asarray(present, bool)
  order = np.concatenate(
    [
      np.flatnonzero(informative),
      np.flatnonzero(~informative & present),
      np.flatnonzero(~informative & ~present),
    ]
  )
  return order[:batch].astype(np.int64)


def groups_present(group_ids_R, num_groups: int) -> np.ndarray:
  """bool[num_groups]: the group has rows (ids ≥ num_groups, set aside, are no group's)."""
  group_ids_R = np.asarray(group_ids_R)
  return np.bincount(group_ids_R[group_ids_R < num_groups], minlength=num_groups) > 0


def trained_rows(
  num_questions: int, max_count: int | None, rollouts: int, rounds: int, multiple: int
):
  """Rows of a dynamic-sampling step: B groups of at most ``max_count`` rollouts each (or all the
  rows of every round), rounded up to ``multiple`` (the update's mini/micro-batch and data-axis
  split; R is a multiple of it already)."""
  most = rollouts * rounds
  if max_count is not None:
    most = min(most, num_questions * max_count)
  return max(rollouts, -(-most // multiple) * multiple)


def gather_groups(rounds: list[Rollouts], picks: list[tuple[int, int]]) -> Rollouts:
  """The rows of the picked groups ``(round, group)`` in pick order, group ids renumbered 0..B-1."""
  parts = []
  for new_id, (r, g) in enumerate(picks):
    host = _host(rounds[r])
    rows_g = np.flatnonzero(host.group_ids_R == g)
    part = _take(host, rows_g)
    parts.append(dataclasses.replace(part, group_ids_R=np.full(len(rows_g), new_id, np.int32)))
  return _concat(parts)


def pad_rows(rollouts: Rollouts, rows: int, group: int, template: Rollouts | None = None):
  """``rollouts`` padded to ``rows`` with token-less copies of the first row of ``template``
  (default: ``rollouts``; a step whose chosen groups have no rows pads from a round's) in group
  ``group`` (a real prompt keeps the padding rows' attention finite; their mask keeps them out of
  the loss)."""
  pad = rows - len(rollouts.group_ids_R)
  if pad < 0:
    raise ValueError(f"{len(rollouts.group_ids_R)} rows of the chosen groups exceed {rows} rows")
  if pad == 0:
    return rollouts
  filler = _take(_host(template if template is not None else rollouts), np.zeros(pad, np.int64))
  zeros = {f: np.zeros_like(v) for f in _ZERO_ON_PAD if (v := getattr(filler, f)) is not None}
  filler = dataclasses.replace(filler, **zeros, group_ids_R=np.full(pad, group, np.int32))
  return _concat([_host(rollouts), filler])


# Per-token and per-row values of a padding row: nothing of the copied row may remain.
_ZERO_ON_PAD = (
  "mask_RxN",
  "loss_mask_RxN",
  "lengths_R",
  "behaviour_logp_RxN",
  "prox_logp_RxN",
  "entropy_RxN",
  "rewards_R",
  "finished_R",
  "turns_R",
  "tool_calls_R",
)


def overlong(
  rewards_R: np.ndarray, finished_R: np.ndarray, mode: str, reward: float
) -> tuple[np.ndarray, np.ndarray]:
  """(rewards_R, kept_R) under the ``rollout.overlong`` rule for responses the budget cut (not
  ``finished_R``): "keep" leaves them, "drop" marks them not kept (for ``set_aside``), "reward"
  gives them ``reward``."""
  cut_R = ~np.asarray(finished_R, bool)
  rewards_R = np.asarray(rewards_R, np.float32)
  if mode == "reward":
    rewards_R = np.where(cut_R, np.float32(reward), rewards_R)
  kept_R = ~cut_R if mode == "drop" else np.ones(len(cut_R), bool)
  return rewards_R, kept_R


def set_aside(rollouts: Rollouts, kept_R: np.ndarray, group: int) -> Rollouts:
  """``rollouts`` with the rows not ``kept_R`` moved out of the update: in group ``group`` (B,
  the group of no question), with no tokens and nothing of their own left (as padding rows)."""
  kept_R = np.asarray(kept_R, bool)
  if kept_R.all():
    return rollouts
  host = _host(rollouts)
  out_R = ~kept_R
  zeroed = {}
  for f in _ZERO_ON_PAD:
    if (v := getattr(host, f)) is not None:
      v = v.copy()
      v[out_R] = 0
      zeroed[f] = v
  group_ids_R = np.where(out_R, group, host.group_ids_R).astype(np.int32)
  return dataclasses.replace(host, **zeroed, group_ids_R=group_ids_R)


def _host(rollouts: Rollouts) -> Rollouts:
  return Rollouts(
    **{
      f.name: None if getattr(rollouts, f.name) is None else np.asarray(getattr(rollouts, f.name))
      for f in dataclasses.fields(Rollouts)
    }
  )


def _take(rollouts: Rollouts, index) -> Rollouts:
  return Rollouts(
    **{
      f.name: None if getattr(rollouts, f.name) is None else getattr(rollouts, f.name)[index]
      for f in dataclasses.fields(Rollouts)
    }
  )


def _concat(parts: list[Rollouts]) -> Rollouts:
  def join(name):
    values = [getattr(p, name) for p in parts]
    if any(v is None for v in values):
      if not all(v is None for v in values):
        raise ValueError(f"{name} is set on some rounds' rollouts and not on others")
      return None
    return np.concatenate(values)

  return Rollouts(**{f.name: join(f.name) for f in dataclasses.fields(Rollouts)})
