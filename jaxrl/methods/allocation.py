"""Rollout allocation: the rollouts G_i each question of a step gets (docs/algorithms.md §3, §4).

The reference functions (``e3_difficulty``, ``e3_allocate``, ``e3_bounds``, ``dynamo_priority``,
``dynamo_allocate``) are the only implementation of each formula; the optax-style allocators below
(``uniform_allocator``, ``e3_allocator``, ``dynamo_allocator``) only thread state around them.

Everything is jit-compatible at static shapes: the batch size B and the question count Q are
static, while bounds, budgets and statistics may be traced, so a new allocation never recompiles.
Every allocator keeps Σ counts_B = B·G, which keeps the rollout count R static for the sampler.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.types import Array, QuestionStats, pytree_dataclass


def e3_difficulty(reward_sum, seen) -> Array:
  """Normalised difficulty rank k ∈ [0, 1) per question: position in descending average reward."""
  reward_sum_N = jnp.asarray(reward_sum, jnp.float32)
  seen_N = jnp.asarray(seen)
  num = reward_sum_N.shape[0]
  avg_N = jnp.where(seen_N > 0, reward_sum_N / jnp.maximum(seen_N, 1).astype(jnp.float32), 0.0)
  # Stable sort: equal averages keep id order (the tie rule of docs/algorithms.md §3).
  order_N = jnp.argsort(avg_N, descending=True, stable=True)
  position_N = jnp.zeros((num,), jnp.int32).at[order_N].set(jnp.arange(num, dtype=jnp.int32))
  return position_N.astype(jnp.float32) / num


def e3_allocate(difficulty, group_size, g_min, g_max) -> Array:
  """E3 Algorithm 1: proportional-to-k shares, then leftovers to the hardest questions first."""
  k_B = jnp.asarray(difficulty, jnp.float32)
  num_b = k_B.shape[0]
  g_min = jnp.asarray(g_min, jnp.int32)
  g_max = jnp.asarray(g_max, jnp.int32)
  total = num_b * jnp.asarray(group_size, jnp.int32)
  rm = total - num_b * g_min
  k_sum = jnp.sum(k_B)
  # Step 1 without the authors' 1e-8 on Σk (it floors exact shares down), clamped at G_max.
  share_B = jnp.floor(rm.astype(jnp.float32) * k_B / jnp.where(k_sum > 0, k_sum, 1.0))
  share_B = jnp.where(k_sum > 0, share_B.astype(jnp.int32), 0)
  g_B = jnp.minimum(g_min + share_B, g_max)
  # Step 2 in closed form: walking in decreasing k, question j gets what is left after the
  # capacities of everyone before it, capped by its own capacity.
  rm = total - jnp.sum(g_B)
  order_B = jnp.argsort(k_B, descending=True, stable=True)
  cap_sorted_B = (g_max - g_B)[order_B]
  before_B = jnp.cumsum(cap_sorted_B) - cap_sorted_B
  give_sorted_B = jnp.clip(rm - before_B, 0, cap_sorted_B)
  return g_B.at[order_B].add(give_sorted_B)


def e3_bounds(epoch, group_size, step=2, g_min_floor=4, g_max_cap=12) -> tuple[Array, Array]:
  """Bounds curriculum (G_min, G_max) for a 0-based epoch: widen by ``step`` per epoch."""
  epoch = jnp.asarray(epoch, jnp.int32)
  g = jnp.asarray(group_size, jnp.int32)
  g_min = jnp.maximum(g - step * epoch, g_min_floor)
  g_max = jnp.minimum(g + step * epoch, g_max_cap)
  # A group size outside [floor, cap] would make Σg = B·G infeasible; keep G inside the bounds.
  return jnp.minimum(g_min, g), jnp.maximum(g_max, g)


def dynamo_priority(seen, correct, min_history=4, floor=0.01, mastered=0.85) -> Array:
  """Unbiased Bernoulli variance of each question's record; NaN while history is too short."""
  seen_B = jnp.asarray(seen)
  n_B = seen_B.astype(jnp.float32)
  k_B = jnp.asarray(correct).astype(jnp.float32)
  acc_B = k_B / jnp.maximum(n_B, 1.0)
  var_B = k_B * (n_B - k_B) / jnp.maximum(n_B * (n_B - 1.0), 1.0)
  p_B = jnp.where(acc_B >= mastered, floor, jnp.maximum(var_B, floor))
  return jnp.where(seen_B < min_history, jnp.nan, p_B).astype(jnp.float32)


def dynamo_allocate(priority, budget, g_min, g_max) -> Array:
  """Water-level allocation with largest-remainder rounding, repeated until the budget is spent."""
  p_B = jnp.asarray(priority, jnp.float32)
  num_b = p_B.shape[0]
  g_min = jnp.asarray(g_min, jnp.int32)
  g_max = jnp.asarray(g_max, jnp.int32)
  known_B = ~jnp.isnan(p_B)
  num_known = jnp.sum(known_B)
  mean_known = jnp.where(
    num_known > 0, jnp.sum(jnp.where(known_B, p_B, 0.0)) / jnp.maximum(num_known, 1), 1.0
  )
  p_B = jnp.where(known_B, p_B, mean_known)
  budget = jnp.clip(jnp.asarray(budget, jnp.int32), num_b * g_min, num_b * g_max)
  g_B = jnp.full((num_b,), g_min, jnp.int32)
  rank_of = jnp.arange(num_b, dtype=jnp.int32)

  def round_(carry):
    g_B, rm, it = carry
    open_B = g_B < g_max
    w_B = jnp.where(open_B, p_B, 0.0)
    w_B = jnp.where(jnp.sum(w_B) > 0, w_B, open_B.astype(jnp.float32))
    ideal_B = rm.astype(jnp.float32) * w_B / jnp.sum(w_B)
    floor_B = jnp.floor(ideal_B)
    frac_B = jnp.where(open_B, ideal_B - floor_B, -1.0)
    floor_B = floor_B.astype(jnp.int32)
    leftover = rm - jnp.sum(floor_B)
    order_B = jnp.argsort(frac_B, descending=True, stable=True)  # ties: lower index first
    rank_B = jnp.zeros((num_b,), jnp.int32).at[order_B].set(rank_of)
    inc_B = jnp.minimum(floor_B + (rank_B < leftover), g_max - g_B)
    return g_B + inc_B, rm - jnp.sum(inc_B), it + 1

  # Termination: a round in which no increment hits its cap hands out floors + leftover = Rm in
  # full; otherwise a capped question reaches G_max and closes. Every round therefore ends the loop
  # or closes a question, and an open one always exists while Rm > 0 (budget ≤ B·G_max), so B
  # rounds always suffice; the counter only makes that bound explicit to XLA.
  def cond(carry):
    _, rm, it = carry
    return (rm > 0) & (it < num_b)

  g_B, _, _ = jax.lax.while_loop(cond, round_, (g_B, budget - num_b * g_min, jnp.int32(0)))
  return g_B


class Allocator(NamedTuple):
  """An allocation policy as pure functions (optax style); hyperparameters live in the closure."""

  init: Callable[[int], object]  # num_questions -> state
  on_epoch_end: Callable[[object, QuestionStats, object], object]  # (state, stats, epoch) -> state
  allocate: Callable[[object, QuestionStats, Array], Array]  # (state, stats, ids_B) -> G_B
  # The largest G_i it ever gives (None: up to all R of a step): bounds the rows a step trains on
  # when dynamic sampling keeps groups from several rounds (docs/algorithms.md §10).
  max_count: int | None = None


@pytree_dataclass
class UniformAllocState:
  """Uniform allocation keeps no state."""


@pytree_dataclass
class E3AllocState:
  """Difficulty snapshot of the last finished epoch and the current bounds."""

  rank_Q: Array  # f32[Q] normalised rank k, frozen for the epoch
  g_min: Array  # i32[]
  g_max: Array  # i32[]


@pytree_dataclass
class DynamoAllocState:
  """DynaMO reads live statistics; only its bounds are state (traced, so they can change)."""

  g_min: Array  # i32[]
  g_max: Array  # i32[]


def _check_bounds(group_size: int, g_min: int, g_max: int) -> None:
  if not g_min <= group_size <= g_max:
    raise ValueError(
      f"need g_min <= group_size <= g_max for a fixed rollout count, got "
      f"{g_min} <= {group_size} <= {g_max}"
    )


def uniform_allocator(group_size: int) -> Allocator:
  """Every question gets ``group_size`` rollouts."""

  def init(num_questions):
    del num_questions
    return UniformAllocState()

  def on_epoch_end(state, stats, epoch):
    del stats, epoch
    return state

  def allocate(state, stats, question_ids_B):
    del state, stats
    return jnp.full(jnp.shape(question_ids_B), group_size, jnp.int32)

  return Allocator(init, on_epoch_end, allocate, max_count=group_size)


def e3_allocator(
  group_size: int, step: int = 2, g_min_floor: int = 4, g_max_cap: int = 12, curriculum: bool = True
) -> Allocator:
  """E3 allocation from per-epoch difficulty snapshots, with or without the bounds curriculum."""

  def init(num_questions):
    # No difficulty is known before the first pass, so the first epoch is uniform either way.
    g = jnp.asarray(group_size, jnp.int32)
    return E3AllocState(rank_Q=jnp.zeros((num_questions,), jnp.float32), g_min=g, g_max=g)

  def on_epoch_end(state, stats, epoch):
    if curriculum:
      g_min, g_max = e3_bounds(jnp.asarray(epoch) + 1, group_size, step, g_min_floor, g_max_cap)
    else:
      g_min, g_max = (
        jnp.asarray(min(g_min_floor, group_size), jnp.int32),
        jnp.asarray(max(g_max_cap, group_size), jnp.int32),
      )
    return dataclasses.replace(
      state, rank_Q=e3_difficulty(stats.reward_sum_Q, stats.seen_Q), g_min=g_min, g_max=g_max
    )

  def allocate(state, stats, question_ids_B):
    del stats  # E3 uses the epoch snapshot, not the live statistics.
    return e3_allocate(state.rank_Q[question_ids_B], group_size, state.g_min, state.g_max)

  return Allocator(init, on_epoch_end, allocate, max_count=max(g_max_cap, group_size))


def dynamo_allocator(
  group_size: int,
  g_min: int,
  g_max: int,
  min_history: int = 4,
  floor: float = 0.01,
  mastered: float = 0.85,
) -> Allocator:
  """DynaMO allocation from live per-question statistics, budget B·G every step."""
  _check_bounds(group_size, g_min, g_max)

  def init(num_questions):
    del num_questions
    return DynamoAllocState(
      g_min=jnp.asarray(g_min, jnp.int32), g_max=jnp.asarray(g_max, jnp.int32)
    )

  def on_epoch_end(state, stats, epoch):
    del stats, epoch
    return state

  def allocate(state, stats, question_ids_B):
    priority_B = dynamo_priority(
      stats.seen_Q[question_ids_B], stats.correct_Q[question_ids_B], min_history, floor, mastered
    )
    budget = priority_B.shape[0] * group_size
    return dynamo_allocate(priority_B, budget, state.g_min, state.g_max)

  return Allocator(init, on_epoch_end, allocate, max_count=g_max)


def histogram(counts_B, max_count: int) -> Array:
  """How many questions got 0..max_count rollouts (larger counts land in the last bin)."""
  counts_B = jnp.clip(jnp.asarray(counts_B, jnp.int32), 0, max_count)
  return jnp.bincount(counts_B, length=max_count + 1)
