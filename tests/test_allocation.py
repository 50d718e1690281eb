"""Allocation (docs/algorithms.md §3, §4): worked examples, python-loop oracles, properties, policies.

The oracles below are written from the spec text with plain Python numbers and loops; the library
computes in float32 with sorts and cumulative sums. Random comparisons use inputs on which the two
precisions cannot disagree (exact grids, or continuous values whose only ties are identical values).
"""

import math
from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.methods.allocation import (
  dynamo_allocate,
  dynamo_allocator,
  dynamo_priority,
  e3_allocate,
  e3_allocator,
  e3_bounds,
  e3_difficulty,
  histogram,
  uniform_allocator,
)
from jaxrl.types import QuestionStats

B = 8
NAN = float("nan")
P1 = [0.258065, 0.193548, 0.01, 0.01]
U = float(np.finfo(np.float32).eps) / 2  # u = 2⁻²⁴, float32's unit roundoff


def oracle_e3_difficulty(reward_sum, seen):
  n = len(seen)
  avg = [Fraction(int(r)) / int(s) if s > 0 else Fraction(0) for r, s in zip(reward_sum, seen)]
  order = sorted(range(n), key=lambda i: (-avg[i], i))
  k = [0.0] * n
  for pos, i in enumerate(order):
    k[i] = pos / n
  return k


def oracle_e3_allocate(k, group_size, g_min, g_max):
  k = [float(x) for x in np.float32(k)]
  n = len(k)
  total = n * group_size
  g = [g_min] * n
  rm = total - n * g_min
  s = sum(k)
  if s > 0:
    g = [min(g[i] + math.floor(rm * k[i] / s), g_max) for i in range(n)]
  rm = total - sum(g)
  for i in sorted(range(n), key=lambda i: (-k[i], i)):
    if rm == 0:
      break
    give = min(rm, g_max - g[i])
    g[i] += give
    rm -= give
  return g


def oracle_dynamo_priority(seen, correct, min_history=4, floor=0.01, mastered=0.85):
  out = []
  for n, k in zip(seen, correct):
    if n < min_history:
      out.append(NAN)
    elif k / n >= mastered:
      out.append(floor)
    else:
      out.append(max(k * (n - k) / (n * (n - 1)), floor))
  return out


def oracle_dynamo_allocate(priority, budget, g_min, g_max):
  p = [float(x) for x in np.float32(priority)]
  n = len(p)
  known = [x for x in p if not math.isnan(x)]
  fill = sum(known) / len(known) if known else 1.0
  p = [fill if math.isnan(x) else x for x in p]
  budget = min(max(budget, n * g_min), n * g_max)
  g = [g_min] * n
  rm = budget - sum(g)
  while rm > 0:
    open_ = [i for i in range(n) if g[i] < g_max]
    w = {i: p[i] for i in open_}
    if sum(w.values()) == 0:
      w = {i: 1.0 for i in open_}
    total_w = sum(w.values())
    ideal = {i: rm * w[i] / total_w for i in open_}
    inc = {i: math.floor(ideal[i]) for i in open_}
    leftover = rm - sum(inc.values())
    for i in sorted(open_, key=lambda i: (-(ideal[i] - math.floor(ideal[i])), i))[:leftover]:
      inc[i] += 1
    for i in open_:
      give = min(inc[i], g_max - g[i])
      g[i] += give
      rm -= give
  return g


# Worked examples (docs/algorithms.md), eager and jitted.

_E3_EXAMPLES = [  # A1-A4
  ([0.1, 0.3, 0.6, 0.9], [6, 7, 9, 10]),
  ([0.5, 0.5, 0.5, 0.5], [8, 8, 8, 8]),
  ([0.0, 0.0, 0.2, 0.9], [6, 6, 10, 10]),
  ([0.0, 0.0, 0.0, 0.0], [10, 10, 6, 6]),
]


@pytest.mark.parametrize("k,expected", _E3_EXAMPLES)
@pytest.mark.parametrize("jit", [False, True])
def test_e3_allocate_examples(k, expected, jit):
  fn = jax.jit(e3_allocate) if jit else e3_allocate
  np.testing.assert_array_equal(fn(np.float32(k), 8, 6, 10), expected)
  assert oracle_e3_allocate(k, 8, 6, 10) == expected


@pytest.mark.parametrize("jit", [False, True])
def test_e3_difficulty_example_k1(jit):
  fn = jax.jit(e3_difficulty) if jit else e3_difficulty
  k = fn(np.float32([3, 0, 8, 8, 1]), np.int32([8, 8, 8, 8, 0]))
  np.testing.assert_array_equal(k, np.float32([0.4, 0.6, 0.0, 0.2, 0.8]))


def test_e3_bounds_table():
  got = [tuple(int(x) for x in e3_bounds(e, 8)) for e in range(4)]
  assert got == [(8, 8), (6, 10), (4, 12), (4, 12)]
  jitted = jax.jit(e3_bounds, static_argnums=1)
  assert [tuple(int(x) for x in jitted(jnp.int32(e), 8)) for e in range(4)] == got
  assert tuple(int(x) for x in e3_bounds(1, 8, step=1, g_min_floor=2, g_max_cap=9)) == (7, 9)


@pytest.mark.parametrize("jit", [False, True])
def test_dynamo_priority_example_p1(jit):
  fn = jax.jit(dynamo_priority) if jit else dynamo_priority
  p = fn(np.int32([32, 32, 32, 32]), np.int32([16, 8, 30, 0]))
  # k·(n − k)/(n·(n − 1)): integer products, exact in float32, and one division, correctly
  # rounded (≤ u relative; the floor 0.01 rounds by as much): rtol 2u, on any CPU. P1 itself is
  # printed to 6 digits, 2.0e-6 relative from 192/992: an rtol derived from its digits would
  # have to exceed that, so the exact fractions are compared.
  np.testing.assert_allclose(p, [256 / 992, 192 / 992, 0.01, 0.01], rtol=2 * U)
  np.testing.assert_allclose(p, P1, rtol=2.1e-6)  # the worked example's 6 digits (≤ 2.0e-6)
  p = fn(np.int32([3, 0, 4, 20]), np.int32([1, 0, 2, 17]))  # 17/20 == mastered exactly
  np.testing.assert_allclose(p, [NAN, NAN, 1 / 3, 0.01], rtol=2 * U)


_DYNAMO_EXAMPLES = [  # D1, D2, D5, D6
  (P1, 64, [24, 22, 9, 9]),
  ([NAN] * 4, 64, [16, 16, 16, 16]),
  (P1, 70, [24, 24, 11, 11]),
  (P1[:2], 100, [24, 24]),
]


@pytest.mark.parametrize("p,budget,expected", _DYNAMO_EXAMPLES)
@pytest.mark.parametrize("jit", [False, True])
def test_dynamo_allocate_examples(p, budget, expected, jit):
  fn = jax.jit(dynamo_allocate) if jit else dynamo_allocate
  np.testing.assert_array_equal(fn(np.float32(p), budget, 8, 24), expected)
  assert oracle_dynamo_allocate(p, budget, 8, 24) == expected


# Random inputs against the oracles, many cases per compile.

_e3_batch = jax.jit(jax.vmap(e3_allocate, in_axes=(0, None, 0, 0)))
_dynamo_batch = jax.jit(jax.vmap(dynamo_allocate))


def _random_bounds(rng, n, group_size):
  return (
    rng.integers(1, group_size + 1, n).astype(np.int32),
    rng.integers(group_size, 3 * group_size, n).astype(np.int32),
  )


def test_e3_difficulty_matches_oracle():
  rng = np.random.default_rng(0)
  fn = jax.jit(e3_difficulty)
  for _ in range(20):
    seen = rng.integers(0, 6, 16)
    reward_sum = rng.integers(0, seen + 1)  # small integers: many equal averages (ties)
    np.testing.assert_array_equal(
      fn(np.float32(reward_sum), np.int32(seen)), np.float32(oracle_e3_difficulty(reward_sum, seen))
    )


def test_e3_allocate_matches_oracle():
  rng = np.random.default_rng(1)
  n = 600
  grid = rng.integers(0, 16, (n // 3, B)) / 16  # exact in float32, with ties
  ranks = np.stack([rng.permutation(B) / B for _ in range(n // 3)])  # what e3_difficulty yields
  continuous = rng.random((n // 3, B))
  continuous[::7] = 0.0
  k = np.float32(np.concatenate([grid, ranks, continuous]))
  g_min, g_max = _random_bounds(rng, n, 8)
  got = np.asarray(_e3_batch(k, 8, g_min, g_max))
  for i in range(n):
    assert got[i].tolist() == oracle_e3_allocate(k[i], 8, int(g_min[i]), int(g_max[i])), i


def test_dynamo_allocate_matches_oracle():
  rng = np.random.default_rng(2)
  n = 600
  pool = rng.random((n, 4))  # drawing from a small pool gives identical values (index ties)
  p = np.float32(np.take_along_axis(pool, rng.integers(0, 4, (n, B)), axis=1))
  p[rng.random((n, B)) < 0.2] = np.nan
  p[::11] = np.nan
  p[5::13] = 0.0
  g_min, g_max = _random_bounds(rng, n, 8)
  budget = rng.integers(0, 3 * 8 * B, n).astype(np.int32)
  got = np.asarray(_dynamo_batch(p, budget, g_min, g_max))
  for i in range(n):
    want = oracle_dynamo_allocate(p[i], int(budget[i]), int(g_min[i]), int(g_max[i]))
    assert got[i].tolist() == want, i


def test_dynamo_priority_matches_oracle():
  rng = np.random.default_rng(3)
  seen = rng.integers(0, 40, 256)
  correct = rng.integers(0, seen + 1)
  got = jax.jit(dynamo_priority)(np.int32(seen), np.int32(correct))
  # Exact integer products and one correctly rounded division (≤ u relative), the same bits on
  # every CPU: rtol 1e-6 ≈ 17u.
  np.testing.assert_allclose(
    got, oracle_dynamo_priority(seen.tolist(), correct.tolist()), rtol=1e-6
  )


# Properties at a fixed shape (B = 8): one compile each for all examples.

_e3_jit = jax.jit(e3_allocate, static_argnums=1)
_dynamo_jit = jax.jit(dynamo_allocate)
_bounds = st.tuples(st.integers(1, 8), st.integers(8, 20))


# XLA on CPU flushes subnormal floats to zero, so a subnormal k is a tie with 0 there; difficulty
# ranks are multiples of 1/Q and never subnormal.
_difficulty = st.floats(0.0, 1.0, exclude_max=True, width=32, allow_subnormal=False)


@settings(max_examples=200, deadline=None)
@given(k=st.lists(_difficulty, min_size=B, max_size=B), bounds=_bounds)
def test_e3_allocate_properties(k, bounds):
  g_min, g_max = bounds
  k = np.float32(k)
  g = np.asarray(_e3_jit(k, 8, g_min, g_max))
  assert g.sum() == B * 8
  assert g.min() >= g_min and g.max() <= g_max
  harder = k[:, None] > k[None, :]
  assert not np.any(harder & (g[:, None] < g[None, :])), (k, g)


@settings(max_examples=200, deadline=None)
@given(
  j=st.lists(st.integers(0, 32), min_size=B, max_size=B), budget=st.integers(0, 300), bounds=_bounds
)
def test_dynamo_allocate_properties(j, budget, bounds):
  g_min, g_max = bounds
  j = np.array(j)
  p = np.where(j == 0, np.nan, j / 32).astype(np.float32)  # 0 encodes "unknown"
  g = np.asarray(_dynamo_jit(p, budget, g_min, g_max))
  assert g.sum() == min(max(budget, B * g_min), B * g_max)
  assert g.min() >= g_min and g.max() <= g_max
  known = j > 0
  higher = known[:, None] & known[None, :] & (p[:, None] > p[None, :])
  assert not np.any(higher & (g[:, None] < g[None, :])), (p, g)


# Policies.


def _stats(seen, correct, reward_sum=None):
  seen = np.int32(seen)
  reward_sum = correct if reward_sum is None else reward_sum
  return QuestionStats(
    seen_Q=seen,
    correct_Q=np.int32(correct),
    reward_sum_Q=np.float32(reward_sum),
    last_step_Q=np.zeros_like(seen),
  )


def test_uniform_allocator():
  alloc = uniform_allocator(8)
  state = alloc.init(20)
  stats = _stats(np.zeros(20), np.zeros(20))
  state = alloc.on_epoch_end(state, stats, 0)
  np.testing.assert_array_equal(jax.jit(alloc.allocate)(state, stats, np.arange(B)), [8] * B)


def test_e3_allocator_snapshots_ranks_and_widens_bounds():
  rng = np.random.default_rng(4)
  num_q = 32
  alloc = e3_allocator(8)
  chex.clear_trace_counter()
  # One trace each for the whole run (new ranks, bounds, epochs and statistics are values only):
  # a second trace raises.
  allocate = jax.jit(chex.assert_max_traces(alloc.allocate, n=1))
  on_epoch_end = jax.jit(chex.assert_max_traces(alloc.on_epoch_end, n=1))
  state = alloc.init(num_q)
  ids = np.int32(rng.choice(num_q, B, replace=False))
  stats = _stats(np.zeros(num_q), np.zeros(num_q))
  np.testing.assert_array_equal(allocate(state, stats, ids), [8] * B)  # epoch 0: no difficulty yet
  bounds_seen = [(int(state.g_min), int(state.g_max))]
  for epoch in range(3):
    seen = rng.integers(0, 10, num_q)
    stats = _stats(seen, rng.integers(0, seen + 1))
    state = on_epoch_end(state, stats, jnp.int32(epoch))
    bounds_seen.append((int(state.g_min), int(state.g_max)))
    ranks = np.float32(oracle_e3_difficulty(stats.reward_sum_Q, stats.seen_Q))
    np.testing.assert_array_equal(state.rank_Q, ranks)
    want = oracle_e3_allocate(ranks[ids], 8, *bounds_seen[-1])
    np.testing.assert_array_equal(allocate(state, stats, ids), want)
    # Live statistics moving within the epoch do not change the allocation.
    later = _stats(stats.seen_Q + 5, stats.correct_Q + rng.integers(0, 6, num_q))
    np.testing.assert_array_equal(allocate(state, later, ids), want)
  assert bounds_seen == [(8, 8), (6, 10), (4, 12), (4, 12)]


def test_e3_allocator_without_curriculum():
  alloc = e3_allocator(8, curriculum=False)
  state = alloc.init(16)
  assert (int(state.g_min), int(state.g_max)) == (8, 8)
  seen, correct = np.full(16, 4), np.arange(16) % 5
  state = alloc.on_epoch_end(state, _stats(seen, correct), 0)
  np.testing.assert_array_equal(state.rank_Q, np.float32(oracle_e3_difficulty(correct, seen)))
  assert (int(state.g_min), int(state.g_max)) == (4, 12)


def test_dynamo_allocator_uses_live_stats_and_compiles_once():
  rng = np.random.default_rng(5)
  num_q = 40
  alloc = dynamo_allocator(8, 4, 16)
  chex.clear_trace_counter()
  allocate = jax.jit(chex.assert_max_traces(alloc.allocate, n=1))  # a second trace raises
  state = alloc.on_epoch_end(alloc.init(num_q), None, 0)
  assert (int(state.g_min), int(state.g_max)) == (4, 16)  # the bounds, kept at the epoch end
  ids = np.int32(rng.choice(num_q, B, replace=False))
  results = []
  for _ in range(6):
    seen = rng.integers(0, 30, num_q)
    stats = _stats(seen, rng.integers(0, seen + 1))
    p = oracle_dynamo_priority(seen[ids].tolist(), stats.correct_Q[ids].tolist())
    got = np.asarray(allocate(state, stats, ids))
    assert got.tolist() == oracle_dynamo_allocate(p, B * 8, 4, 16)
    assert got.sum() == B * 8
    results.append(got.tolist())
  assert len({tuple(r) for r in results}) > 1  # the allocation follows the statistics
  with pytest.raises(ValueError):
    dynamo_allocator(8, 10, 16)


def test_histogram():
  counts = np.int32([6, 7, 9, 10, 10, 4, 12, 8])
  got = jax.jit(histogram, static_argnums=1)(counts, 12)
  np.testing.assert_array_equal(got, np.bincount(counts, minlength=13))
  assert int(histogram(counts, 9).sum()) == B  # counts above max_count land in the last bin
