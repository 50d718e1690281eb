"""pass@k: the docs/algorithms.md §8 examples, an exact-fraction oracle, and the vectorised form."""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.rl.passk import pass_at_k, pass_at_k_array


def exact_pass_at_k(n, c, k):
  """1 − C(n−c,k)/C(n,k) in exact rational arithmetic (math.comb is 0 when k > n−c)."""
  return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize(
  "n,c,k,expected",
  [(16, 4, 1, 0.25), (16, 4, 8, 0.961538), (256, 3, 16, 0.176673)],
)
def test_algorithms_examples(n, c, k, expected):
  # The examples are printed to 6 decimals: within 5e-7 by their rounding (0.961538 is 4.6e-7
  # from 25/26); the float64 products add ~1e-16, and no CPU-dependent order enters a scalar loop.
  assert pass_at_k(n, c, k) == pytest.approx(expected, abs=5e-7)
  assert pass_at_k_array([n], [c], k)[0] == pytest.approx(expected, abs=5e-7)


def test_edge_cases():
  assert pass_at_k(8, 0, 3) == 0.0
  assert pass_at_k(8, 8, 3) == 1.0
  assert pass_at_k(8, 6, 3) == 1.0  # n − c < k: every 3-subset holds a correct sample
  assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)  # pass@1 is the accuracy
  for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
    with pytest.raises(ValueError):
      pass_at_k(*bad)
  with pytest.raises(ValueError):
    pass_at_k_array([4, 4], [2, 5], 1)


def test_large_n_is_stable():
  # C(1024, 512) overflows float64; the product form does not: 10 factors, ~20 roundings of
  # 2⁻⁵³ (2e-15 relative) against rel 1e-12.
  got = pass_at_k(1024, 10, 512)
  assert got == pytest.approx(float(exact_pass_at_k(1024, 10, 512)), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
  st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n)))
)
def test_matches_exact_fraction(nck):
  n, c, k = nck
  # 1 − Π (1 − k/i) over c ≤ 300 factors in float64: 2 roundings per factor, ≤ 600·2⁻⁵³ ≈ 7e-14
  # relative on a product ≤ 1 (in any order), plus the final subtraction: within abs 1e-12.
  assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12)


def test_array_matches_scalar_loop():
  rng = np.random.default_rng(0)
  n_Q = rng.integers(16, 64, size=200)
  c_Q = np.array([rng.integers(0, n + 1) for n in n_Q])
  for k in (1, 4, 16):
    got_Q = pass_at_k_array(n_Q, c_Q, k)
    want_Q = [float(exact_pass_at_k(int(n), int(c), k)) for n, c in zip(n_Q, c_Q)]
    # As above: ≤ 64 factors of 2 float64 roundings each, whatever order np.prod takes.
    np.testing.assert_allclose(got_Q, want_Q, rtol=0, atol=1e-12)
  # Scalar n broadcasts over questions; all-zero c gives an empty product.
  np.testing.assert_allclose(pass_at_k_array(16, [0, 4, 16], 8), [0.0, pass_at_k(16, 4, 8), 1.0])
  np.testing.assert_array_equal(pass_at_k_array(16, [0, 0], 2), [0.0, 0.0])


def test_heldout_evaluation_counts_turns_of_real_questions_only():
  """``heldout.evaluate`` over a fake multi-turn sampler: 3 questions in chunks of 2 (the last
  padded with its first question, whose samples count nowhere), n = 2 samples each. Question q's
  samples take q + 1 and q + 2 turns (one tool call fewer) and are correct from q = 1 on."""
  import jax

  from jaxrl.run.heldout import EvalResult, Sampled, evaluate

  def sample_fn(ids_BxP, mask_BxP, counts_B, key, greedy):
    group_ids_R = np.repeat(np.arange(len(counts_B)), counts_B)
    q_R = ids_BxP[group_ids_R, 0]
    turns_R = q_R + 1 + (np.arange(len(q_R)) % 2 if not greedy else 0)
    return Sampled([str(q) for q in q_R], group_ids_R, turns_R, turns_R - 1)

  ids_QxP = np.arange(3)[:, None]
  result = evaluate(
    sample_fn,
    ids_QxP,
    np.ones_like(ids_QxP, bool),
    np.array([0, 0, 1]),
    lambda responses, q: (np.asarray(q) >= 1).astype(np.float32),
    num_samples=2,
    ks=[1],
    questions_per_call=2,
    key=jax.random.PRNGKey(0),
  )
  # Per question: turns 1.5, 2.5, 3.5; tool calls one fewer.
  assert result.turns["turns"] == {0: 2.0, 1: 3.5, "all": 2.5}
  assert result.turns["tool_calls"] == {0: 1.0, 1: 2.5, "all": 1.5}
  # Correct with a call: question 0's samples are wrong, 1's and 2's correct with 1-3 calls.
  assert result.turns["solved_with_call"] == {0: 0.5, 1: 1.0, "all": 2 / 3}
  assert result.pass_at[1] == {0: 0.5, 1: 1.0, "all": 2 / 3}
  # Per question, by level: question 0 has no correct sample, 1 and 2 both of theirs.
  assert result.to_json()["questions"] == {"num_samples": 2, "correct": {"0": [0, 2], "1": [2]}}
  assert EvalResult.from_json(result.to_json()) == result
  single = evaluate(
    lambda *args: Sampled(*sample_fn(*args)[:2]),
    ids_QxP,
    np.ones_like(ids_QxP, bool),
    np.array([0, 0, 1]),
    lambda responses, q: np.zeros(len(q), np.float32),
    num_samples=2,
    ks=[1],
    questions_per_call=2,
    key=jax.random.PRNGKey(0),
  )
  assert single.turns == {} and "turns" not in single.to_json()
