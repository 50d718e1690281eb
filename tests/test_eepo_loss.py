"""EEPO unlearning loss (docs/algorithms.md §5) and the fused log(1 − p) path it trains through.

Oracles are float64 numpy: log(1 − p) as log Σ_{j≠a} e^{z_j} − log Σ_j e^{z_j}, and its analytic
gradient (q_j − p_j off the token, −p_a on it, q = softmax over the other logits).
"""

import math

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import contains_primitive

from jaxrl.config import forget_config
from jaxrl.nn.logprobs import fused_log1m_p, logp_log1m_p_from_logits
from jaxrl.rl.losses import eepo_unlearning_loss, eepo_unlearning_loss_from_logp

EPS_L, EPS_R = 1e-3, 1e-2
B, T, D, V, CHUNK = 3, 29, 16, 96, 16  # B·T = 87: not a multiple of the chunk
U = float(np.finfo(np.float32).eps) / 2  # u = 2⁻²⁴, float32's unit roundoff


def _lse(x, axis=-1):
  m = np.max(x, axis=axis, keepdims=True)
  return (m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)))[..., 0]


def oracle_rows(z_NxV, tok_N):
  """Float64 log p, log(1 − p) and d log(1 − p)/dz per row."""
  z = np.asarray(z_NxV, np.float64)
  rows = np.arange(len(tok_N))
  lse = _lse(z)
  others = z.copy()
  others[rows, tok_N] = -np.inf
  lse_o = _lse(others)
  p = np.exp(z - lse[:, None])
  q = np.exp(others - lse_o[:, None])
  return z[rows, tok_N] - lse, lse_o - lse, q - p


def row_errors(z_NxV, tok_N, dot_err_NxV=None):
  """Bounds on |float32 − exact| of log p and log(1 − p) per row of logits z (float64, exact
  values of what the library computes from), whatever order XLA's CPU reduction sums in: to
  first order, from a sum of n terms rounding within n·u·Σ|terms| (Higham, Accuracy and
  Stability, §3.1). ``dot_err_NxV``: each logit's own error (a matmul's), else u·|z| (a division
  by τ). A log-sum-exp is off by the largest logit error, its V-term sum of exps in (0, 1] with
  their exps and the log (V + 3)·u, and u·|lse| where the max is added back; a log-prob adds its
  logit's error and u·|log p|. log(1 − p): for p < ½ the library takes log1p(−p), whose relative
  error is at most 1.44× that of p (|p·dlog(1 − p)/dp| ≤ 1.44·|log(1 − p)| there) plus 2u; for
  p ≥ ½ the difference of the two log-sum-exps (others, all), each off as above. Plus the float64
  oracle's own rounding: its lse_others − lse is off by up to 2⁻⁵²·(|lse| + |lse_others|) (V + 3
  roundings of 2⁻⁵³ each side), far below float32's but not where p ≈ 1e-16."""
  z = np.asarray(z_NxV, np.float64)
  e_z = np.abs(z) * U if dot_err_NxV is None else dot_err_NxV
  logp, log1m, _ = oracle_rows(z, tok_N)
  lse = _lse(z)
  others = z.copy()
  others[np.arange(len(tok_N)), tok_N] = -np.inf
  lse_o = _lse(others)
  v = z.shape[1]
  e_max = e_z.max(axis=1)
  e_lse = e_max + (v + 3) * U + U * np.abs(lse)
  e_lse_o = e_max + (v + 3) * U + U * np.abs(lse_o)
  e_logp = e_lse + e_z[np.arange(len(tok_N)), tok_N] + U * np.abs(logp)
  small = logp < np.log(0.5)
  e_log1m = np.where(
    small,
    (1.44 * (e_logp + 2 * U) + 2 * U) * np.abs(log1m),
    e_lse + e_lse_o + U * np.abs(log1m),
  )
  e_oracle = (v + 3) * 2.0**-53 * (np.abs(lse) + np.abs(lse_o))
  return e_logp + e_oracle, e_log1m + e_oracle


def oracle_loss(logits, tokens, mask, eps_l, eps_r):
  """L and dL/dlogits by loops over sequences and tokens (float64)."""
  R, Tn, Vn = logits.shape
  logp, log1m, dz = oracle_rows(logits.reshape(-1, Vn), tokens.reshape(-1))
  logp, log1m, dz = logp.reshape(R, Tn), log1m.reshape(R, Tn), dz.reshape(R, Tn, Vn)
  seqs = [k for k in range(R) if sum(mask[k]) > 0]
  total, grad = 0.0, np.zeros_like(dz)
  for k in seqs:
    t_k = sum(mask[k])
    for t in range(Tn):
      if mask[k][t] and math.exp(logp[k, t]) >= eps_l:
        total += max(log1m[k, t], math.log(eps_r)) / t_k / len(seqs)
        grad[k, t] = dz[k, t] / t_k / len(seqs)  # straight-through: the unfloored gradient
  return total, grad


# ------------------------------------------------------------------------- worked examples


# Worked examples: values printed to 6-7 digits (their rounding ≤ 5e-7) of a handful of float32
# operations (a few u): atol 1e-5 holds with room on any CPU.


def test_worked_example_e1():
  logits = jnp.array([[[2.0, 0.0, 0.0]]])
  tokens, mask = jnp.array([[0]]), jnp.array([[1]])
  loss, grad = jax.value_and_grad(eepo_unlearning_loss)(logits, tokens, mask, EPS_L, EPS_R)
  np.testing.assert_allclose(float(loss), -1.5463976, rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(grad)[0, 0], [-0.786986, 0.393493, 0.393493], atol=1e-5)
  p = jax.nn.softmax(logits + 1.0 * grad, axis=-1)[0, 0, 0]  # one ascent step of size 1
  assert round(float(p), 4) == 0.5316


def test_worked_example_e2_a_dominant_token():
  """docs/algorithms.md §5.2: p > 1 − ε_R. Both rules give the floored value; straight-through
  pushes the token down (−p on its logit), the paper's clip gives it no gradient."""
  logits = jnp.array([[[10.0, 0.0, 0.0]]])
  tokens, mask = jnp.array([[0]]), jnp.array([[1]])
  want = {False: [-0.9999092, 0.4999546, 0.4999546], True: [0.0, 0.0, 0.0]}
  for paper_clip, grad_want in want.items():
    loss, grad = jax.value_and_grad(eepo_unlearning_loss)(
      logits, tokens, mask, EPS_L, EPS_R, paper_clip
    )
    np.testing.assert_allclose(float(loss), -4.6051702, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[0, 0], grad_want, atol=1e-5)


def test_the_paper_clip_moves_nothing_else():
  """Below 1 − ε_R both rules are log(1 − p) with its gradient (E1 under the paper's clip)."""
  logits = jnp.array([[[2.0, 0.0, 0.0]]])
  tokens, mask = jnp.array([[0]]), jnp.array([[1]])
  loss, grad = jax.value_and_grad(eepo_unlearning_loss)(logits, tokens, mask, EPS_L, EPS_R, True)
  np.testing.assert_allclose(float(loss), -1.5463976, rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(grad)[0, 0], [-0.786986, 0.393493, 0.393493], atol=1e-5)


def test_worked_example_e3():
  tiny = 1e-12
  probs = np.array(
    [
      [[0.9, 0.1, tiny], [0.5, 0.5, tiny], [1 / 3, 1 / 3, 1 / 3]],  # last position is padding
      [[0.99, 0.01, tiny], [0.2, 0.8, tiny], [0.1, 0.9, tiny]],
    ]
  )
  mask = jnp.array([[1, 1, 0], [1, 1, 1]])
  loss = eepo_unlearning_loss(
    jnp.asarray(np.log(probs), jnp.float32), jnp.zeros((2, 3), jnp.int32), mask, EPS_L, EPS_R
  )
  np.testing.assert_allclose(float(loss), -1.5712121, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ loss against the loop oracle


def _loss_batch(seed):
  rng = np.random.default_rng(seed)
  R, Tn, Vn = 5, 6, 11
  logits = rng.normal(0.0, 2.0, (R, Tn, Vn))
  tokens = rng.integers(0, Vn, (R, Tn))
  mask = (rng.uniform(size=(R, Tn)) < 0.8).astype(np.int32)
  mask[4] = 0  # padding row: not in the mean
  # Dominant tokens (floor binds, gradient must survive) and negligible ones (below ε_L).
  logits[0, 0, tokens[0, 0]] = 12.0
  logits[1, 1, tokens[1, 1]] = 40.0  # p rounds to 1 in float32
  logits[2, 2, tokens[2, 2]] = -12.0
  mask[:3, :3] = 1
  return logits, tokens, mask


LOSS_AND_GRAD = jax.jit(jax.value_and_grad(eepo_unlearning_loss))


def _as_float32(x):
  return np.asarray(np.asarray(x, np.float32), np.float64)


def _loss_bounds(logits, tokens, mask):
  """(atol of the loss, elementwise bound of its gradient's error) against the float64 loop
  oracle. The loss is a mean over sequences of means over tokens of max(log(1 − p), log ε_R):
  each term within its row's log(1 − p) error (``row_errors``; the floor is exact), the sums over
  the ≤ R·T terms within (R·T + 4)·u of their magnitude (≤ |log ε_R|). A gradient entry
  (q_j − p_j)/(T_k·n) takes p_j and q_j (exps of a logit minus a log-sum-exp) within that
  log-sum-exp's error + 2u relative, and rounds 3u more."""
  r, t, v = logits.shape
  z, tok = logits.reshape(-1, v), np.asarray(tokens).reshape(-1)
  e_logp, e_log1m = row_errors(z, tok)
  m = np.asarray(mask).reshape(r, t)
  on = m.reshape(-1) > 0
  atol = e_log1m[on].max() + (r * t + 4) * U * abs(np.log(EPS_R))
  others = z.copy()
  others[np.arange(len(tok)), tok] = -np.inf
  p, q = np.exp(z - _lse(z)[:, None]), np.exp(others - _lse(others)[:, None])
  seqs = max(int(np.sum(m.sum(1) > 0)), 1)
  weight = (1.0 / (np.maximum(m.sum(1), 1)[:, None] * seqs)) * np.ones((1, t))  # 1/(T_k·n)
  e_grad = ((e_logp[:, None] + 2 * U) * (p + q) + 3 * U * np.abs(q - p)) * weight.reshape(-1, 1)
  return atol, e_grad.reshape(r, t, v)


def _assert_within(actual, expected, bound, what=""):
  """|actual − expected| ≤ bound, elementwise (``bound`` an array or a scalar)."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  excess = np.abs(actual - expected) - bound
  assert np.all(excess <= 0), (what, float(np.max(excess)))


@pytest.mark.parametrize("seed", range(4))
def test_loss_and_gradient_match_loop_oracle(seed):
  logits, tokens, mask = _loss_batch(seed)
  logits = _as_float32(logits)  # the oracle on the library's inputs: only its arithmetic counts
  expected, expected_grad = oracle_loss(logits, tokens, mask, EPS_L, EPS_R)
  loss, grad = LOSS_AND_GRAD(
    jnp.asarray(logits, jnp.float32), jnp.asarray(tokens), jnp.asarray(mask), EPS_L, EPS_R
  )
  atol, e_grad = _loss_bounds(logits, tokens, mask)
  np.testing.assert_allclose(float(loss), expected, rtol=0, atol=atol)
  assert np.all(np.isfinite(grad))
  _assert_within(grad, expected_grad, e_grad, "grad")
  # The floor binds at the dominant tokens yet their gradient is −p_a/(T_k·n), not 0.
  assert np.asarray(grad)[1, 1, tokens[1, 1]] < -0.9 * expected_grad[1, 1].max()
  assert np.all(np.asarray(grad)[2, 2] == 0)  # p < ε_L: no gradient
  assert np.all(np.asarray(grad)[mask == 0] == 0)


def test_floor_is_value_only_straight_through():
  logp = jnp.log(jnp.array([[0.999, 0.5]]))
  log1m = jnp.log(jnp.array([[0.001, 0.5]]))
  mask = jnp.ones((1, 2))
  loss, (g_logp, g_log1m) = jax.value_and_grad(eepo_unlearning_loss_from_logp, argnums=(0, 1))(
    logp, log1m, mask, EPS_L, EPS_R
  )
  np.testing.assert_allclose(float(loss), (math.log(EPS_R) + math.log(0.5)) / 2, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(g_log1m), [[0.5, 0.5]])
  np.testing.assert_array_equal(np.asarray(g_logp), [[0.0, 0.0]])  # the ε_L gate carries none


def test_eps_are_traced():
  logits, tokens, mask = _loss_batch(5)
  args = (jnp.asarray(logits, jnp.float32), jnp.asarray(tokens), jnp.asarray(mask))
  chex.clear_trace_counter()
  fn = jax.jit(chex.assert_max_traces(eepo_unlearning_loss, n=1))  # a second trace raises
  logits = _as_float32(logits)
  atol, _ = _loss_bounds(logits, tokens, mask)  # |log ε_R| ≤ |log 1e-2| in both settings
  for eps_l, eps_r in [(1e-3, 1e-2), (0.05, 0.2)]:
    # ε as the library gets them (float32), so the gates and the floor are the same numbers.
    expected, _ = oracle_loss(
      logits, tokens, mask, float(np.float32(eps_l)), float(np.float32(eps_r))
    )
    got = fn(*args, jnp.float32(eps_l), jnp.float32(eps_r))
    np.testing.assert_allclose(float(got), expected, rtol=0, atol=atol)


# ------------------------------------------------------------------------ fused log(1 − p)


def _inputs(seed=0, b=B, t=T, d=D, v=V):
  k_h, k_w, k_t, k_m = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(k_h, (b, t, d), jnp.float32)
  # drawn [D, V] and stored [V, D], as the model's head
  lm_head = (jax.random.normal(k_w, (d, v), jnp.float32) * 3.0 / np.sqrt(d)).T
  tokens = jax.random.randint(k_t, (b, t), 0, v)
  mask = (jax.random.uniform(k_m, (b, t)) < 0.85).astype(jnp.float32)
  return hidden, lm_head, tokens, mask


def _oracle_fused(hidden, lm_head, tokens, w_logp, w_log1m, tau):
  """Float64 values and gradients of Σ w_logp·log p + w_log1m·log(1 − p)."""
  h = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1])
  w = np.asarray(lm_head, np.float64).T  # the head is stored [V, D]
  tok = np.asarray(tokens).reshape(-1)
  z = h @ w / tau
  logp, log1m, dlog1m = oracle_rows(z, tok)
  p = np.exp(z - _lse(z)[:, None])
  onehot = np.zeros_like(z)
  onehot[np.arange(len(tok)), tok] = 1.0
  dz = np.reshape(w_logp, (-1, 1)) * (onehot - p) + np.reshape(w_log1m, (-1, 1)) * dlog1m
  dlogits = dz / tau
  shape = tokens.shape
  return (
    logp.reshape(shape),
    log1m.reshape(shape),
    (dlogits @ w.T).reshape(hidden.shape),
    (h.T @ dlogits).T,
  )


def _fused_bounds(hidden, lm_head, tokens, w_logp, w_log1m, tau, naive=False):
  """Elementwise bounds on |float32 − exact| of log p, log(1 − p) and the gradients (by hidden,
  by the head) of Σ w_logp·log p + w_log1m·log(1 − p), in any order of the sums: a logit is a
  dot of D terms and a division, (D + 1)·u·Σ_d|h_d·W_vd|/τ; the rows as in ``row_errors``. The
  gradient's dz = w_logp·(onehot − p) + w_log1m·(q − p) takes p and q within their row's error
  + 4u relative (the log1p branch's factor p/(1 − p) ≤ 1 at most triples it), the backward's
  V-term sums (V + 8)·u·|dz|; dh = dz·W/τ sums V terms, dW = dzᵀ·h/τ the N rows. ``naive``: the
  bounds of log1p(−exp(log p)) instead, whose error is its log-prob's amplified by p/(1 − p)."""
  d = hidden.shape[-1]
  h = np.asarray(hidden, np.float64).reshape(-1, d)
  w = np.asarray(lm_head, np.float64)  # [V, D]
  tok = np.asarray(tokens).reshape(-1)
  n, v = h.shape[0], w.shape[0]
  z = h @ w.T / tau
  e_z = (d + 1) * U * (np.abs(h) @ np.abs(w).T) / tau
  e_logp, e_log1m = row_errors(z, tok, e_z)
  logp, log1m, dlog1m = oracle_rows(z, tok)
  p_tok = np.exp(logp)
  if naive:
    e_log1m = p_tok / (1 - p_tok) * (e_logp + 2 * U) + 2 * U * np.abs(log1m)
  others = z.copy()
  others[np.arange(n), tok] = -np.inf
  p, q = np.exp(z - _lse(z)[:, None]), np.exp(others - _lse(others)[:, None])
  onehot = np.zeros_like(z)
  onehot[np.arange(n), tok] = 1.0
  wl = np.reshape(w_logp, (-1, 1))
  w1 = np.reshape(w_log1m, (-1, 1))
  dz = wl * (onehot - p) + w1 * dlog1m
  gain = 3 + (1 / (1 - p_tok[:, None]) if naive else 0)  # naive: d/dz of log1p(−p) has 1/(1 − p)
  e_dz = (np.abs(wl) + gain * np.abs(w1)) * (e_logp[:, None] + 4 * U) * (p + q + onehot)
  e_dz += (v + 8) * U * np.abs(dz)
  e_gh = (e_dz @ np.abs(w) + (v + 1) * U * (np.abs(dz) @ np.abs(w))) / tau
  e_gw = (e_dz.T @ np.abs(h) + (n + 1) * U * (np.abs(dz).T @ np.abs(h))) / tau
  shape = tokens.shape
  return e_logp.reshape(shape), e_log1m.reshape(shape), e_gh.reshape(hidden.shape), e_gw


def _weighted(fn):
  def objective(hidden, lm_head, tokens, w_logp, w_log1m, tau):
    logp, log1m = fn(hidden, lm_head, tokens, tau)
    return jnp.sum(w_logp * logp) + jnp.sum(w_log1m * log1m), (logp, log1m)

  return jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))


FUSED = _weighted(lambda *a: fused_log1m_p(*a, chunk_size=CHUNK))


@pytest.mark.parametrize("tau", [0.6, 1.0, 1.4])
def test_fused_matches_float64_oracle_and_naive_autodiff(tau):
  hidden, lm_head, tokens, _ = _inputs(seed=1)
  w = jax.random.normal(jax.random.key(9), (2, B, T))
  (_, (logp, log1m)), (gh, gw) = FUSED(hidden, lm_head, tokens, w[0], w[1], jnp.float32(tau))
  # τ as the library gets it (float32): the oracle divides by the same number.
  tau = float(np.float32(tau))
  logp_o, log1m_o, gh_o, gw_o = _oracle_fused(hidden, lm_head, tokens, w[0], w[1], tau)
  assert logp.shape == log1m.shape == (B, T)
  bounds = _fused_bounds(hidden, lm_head, tokens, w[0], w[1], tau)
  for got, want, bound, name in zip(
    (logp, log1m, gh, gw), (logp_o, log1m_o, gh_o, gw_o), bounds, ("logp", "log1m", "dh", "dW")
  ):
    _assert_within(got, want, bound, name)

  # The textbook formula log(1 − exp(log p)) on materialised logits, where p is far from 1.
  def naive(hidden, lm_head, tokens, tau):
    z = jnp.einsum("btd,vd->btv", hidden, lm_head) / tau
    lp = jnp.take_along_axis(jax.nn.log_softmax(z), tokens[..., None], axis=-1)[..., 0]
    return lp, jnp.log1p(-jnp.exp(lp))

  (_, (_, log1m_n)), (gh_n, gw_n) = _weighted(naive)(hidden, lm_head, tokens, w[0], w[1], tau)
  assert float(jnp.max(jnp.exp(logp))) < 0.99  # well-conditioned regime for the naive formula
  # Each side within its own bounds of exact: their sum.
  naive_bounds = _fused_bounds(hidden, lm_head, tokens, w[0], w[1], tau, naive=True)
  for got, want, i, name in (
    (log1m, log1m_n, 1, "log1m"),
    (gh, gh_n, 2, "dh"),
    (gw, gw_n, 3, "dW"),
  ):
    _assert_within(got, want, bounds[i] + naive_bounds[i], name)


def test_fused_is_stable_as_p_goes_to_one():
  """Logit gap 30 (and 60): naive float32 log(1 − p) is −inf or far off; fused matches float64."""
  n, v = 6, 12
  z = np.random.default_rng(0).normal(size=(n, v))
  tok = np.arange(n) % v
  z[np.arange(n), tok] = z.max(axis=1) + np.array([30.0, 30.0, 45.0, 60.0, 5.0, 0.0])
  hidden = jnp.asarray(z, jnp.float32)[None]  # lm_head = I: the hidden state is the logit row
  lm_head = jnp.eye(v, dtype=jnp.float32)
  tokens = jnp.asarray(tok)[None]
  w = jnp.ones((2, 1, n), jnp.float32).at[0].set(0.0)
  for tau in (1.0, 0.7):
    (_, (logp, log1m)), (gh, _) = FUSED(hidden, lm_head, tokens, w[0], w[1], jnp.float32(tau))
    tau = float(np.float32(tau))
    _, log1m_o, gh_o, _ = _oracle_fused(hidden, lm_head, tokens, w[0], w[1], tau)
    _, e_log1m, e_gh, _ = _fused_bounds(hidden, lm_head, tokens, w[0], w[1], tau)
    # Relatively accurate where p → 1: within e_log1m, at most 3e-6 of |log(1 − p)| here.
    _assert_within(log1m, log1m_o, e_log1m, "log1m")
    assert np.all(np.isfinite(gh))
    _assert_within(gh, gh_o, e_gh, "dh")
    # d log(1 − p_a)/dz_a = −p_a ≈ −1/τ per logit (1 − p_a < 1e-13), not 0 and not inf.
    diag = np.asarray(gh)[0, :4, tok[:4]].diagonal()
    _assert_within(diag, -1.0 / tau, e_gh[0, :4, tok[:4]].diagonal() + U / tau, "-1/tau")
    with np.errstate(divide="ignore"):  # log1p(−1) = −inf is the point being made
      naive = np.log1p(-np.exp(np.asarray(logp, np.float32)))
    assert not np.all(np.abs(naive[0, :4] - log1m_o[0, :4]) < 1.0)


@pytest.mark.parametrize("tau", [0.7, 1.3])
def test_loss_gradient_through_fused_equals_logits_version(tau):
  hidden, lm_head, tokens, mask = _inputs(seed=2)
  tau = jnp.float32(tau)

  def via_fused(hidden, lm_head):
    logp, log1m = fused_log1m_p(hidden, lm_head, tokens, tau, chunk_size=CHUNK)
    return eepo_unlearning_loss_from_logp(logp, log1m, mask, EPS_L, EPS_R)

  def via_logits(hidden, lm_head):
    logits = jnp.einsum("btd,vd->btv", hidden, lm_head) / tau
    return eepo_unlearning_loss(logits, tokens, mask, EPS_L, EPS_R)

  loss_f, grads_f = jax.jit(jax.value_and_grad(via_fused, argnums=(0, 1)))(hidden, lm_head)
  loss_n, grads_n = jax.jit(jax.value_and_grad(via_logits, argnums=(0, 1)))(hidden, lm_head)
  # The loss weighs token (k, t)'s log(1 − p) by 1/(T_k·n): the gradients' bounds with those
  # weights (the ε gates only zero entries); the loss within its largest term's error and its
  # sums' (R·T + 4)·u·|log ε_R|. Each side within them of exact, the two within twice them.
  m = np.asarray(mask)
  weight = m / (np.maximum(m.sum(1, keepdims=True), 1) * max(int(np.sum(m.sum(1) > 0)), 1))
  _, e_log1m, e_gh, e_gw = _fused_bounds(hidden, lm_head, tokens, 0 * weight, weight, float(tau))
  e_loss = float(e_log1m[m > 0].max()) + (m.size + 4) * U * abs(np.log(EPS_R))
  np.testing.assert_allclose(float(loss_f), float(loss_n), rtol=0, atol=2 * e_loss)
  for a, b, bound in zip(grads_f, grads_n, (e_gh, e_gw)):
    _assert_within(a, b, 2 * bound)
  # And both equal the loop oracle on float64 logits.
  z = np.einsum("btd,vd->btv", np.asarray(hidden, np.float64), np.asarray(lm_head, np.float64))
  expected, _ = oracle_loss(z / float(tau), np.asarray(tokens), np.asarray(mask), EPS_L, EPS_R)
  np.testing.assert_allclose(float(loss_f), expected, rtol=0, atol=e_loss)


@pytest.mark.parametrize("chunk_size", [1, 7, 87, 500])
def test_any_chunk_size_gives_the_same_answer(chunk_size):
  hidden, lm_head, tokens, _ = _inputs(seed=3)
  tau = jnp.float32(0.9)
  z = np.asarray(hidden, np.float64).reshape(-1, D) @ np.asarray(lm_head, np.float64).T / 0.9
  logp_o, log1m_o, _ = oracle_rows(z, np.asarray(tokens).reshape(-1))
  logp, log1m = fused_log1m_p(hidden, lm_head, tokens, tau, chunk_size=chunk_size)
  zeros = np.zeros((B, T))
  e_logp, e_log1m, _, _ = _fused_bounds(hidden, lm_head, tokens, zeros, zeros, float(tau))
  _assert_within(logp, logp_o.reshape(B, T), e_logp, "logp")
  _assert_within(log1m, log1m_o.reshape(B, T), e_log1m, "log1m")


def _loss_via_fused(chunk_size):
  def loss(hidden, lm_head, tokens, mask, tau):
    logp, log1m = fused_log1m_p(hidden, lm_head, tokens, tau, chunk_size=chunk_size)
    return eepo_unlearning_loss_from_logp(logp, log1m, mask, EPS_L, EPS_R)

  return loss


def _loss_via_logits(hidden, lm_head, tokens, mask, tau):
  return eepo_unlearning_loss(hidden @ lm_head.T / tau, tokens, mask, EPS_L, EPS_R)


def test_no_gather_on_the_vocab_axis():
  hidden, lm_head, tokens, mask = _inputs()
  args = (hidden, lm_head, tokens, mask, jnp.float32(1.0))
  loss = _loss_via_fused(CHUNK)
  grad_jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(*args).jaxpr
  assert not contains_primitive(grad_jaxpr, "gather")
  assert contains_primitive(jax.make_jaxpr(loss)(*args).jaxpr, "remat2")  # jax.checkpoint


def _temp_bytes(loss, t):
  hidden, lm_head, tokens, mask = _inputs(b=4, t=t, d=64, v=4096)
  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  compiled = grad_fn.lower(hidden, lm_head, tokens, mask, jnp.float32(0.7)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_fused_gradient_temp_memory_is_far_below_naive_and_flat_in_t():
  fused_mib = _temp_bytes(_loss_via_fused(64), 400) / 2**20
  fused_long_mib = _temp_bytes(_loss_via_fused(64), 1600) / 2**20
  naive_mib = _temp_bytes(_loss_via_logits, 400) / 2**20
  # Observed here (jax 0.10.2 CPU): fused 5.0 MiB at T=400 and T=1600, naive 75 MiB at T=400.
  assert fused_mib < naive_mib / 10, (fused_mib, naive_mib)
  assert fused_long_mib < 1.25 * fused_mib, (fused_mib, fused_long_mib)


def test_row_function_on_masked_vocab():
  """−inf logits (masked vocab ids) stay out of both sums, with finite gradients."""
  z = np.random.default_rng(4).normal(size=(4, 10)) * 3
  z[:, 7:] = -np.inf
  tok = np.array([0, 3, 6, 2])
  logp, log1m = logp_log1m_p_from_logits(jnp.asarray(z, jnp.float32), jnp.asarray(tok), 1.0)
  logp_o, log1m_o, _ = oracle_rows(z[:, :7], tok)
  # float64 logits: their rounding to float32 (u·|z|) is each logit's error in ``row_errors``.
  e_logp, e_log1m = row_errors(z[:, :7], tok)
  _assert_within(logp, logp_o, e_logp, "logp")
  _assert_within(log1m, log1m_o, e_log1m, "log1m")
  grad = jax.grad(lambda x: jnp.sum(logp_log1m_p_from_logits(x, jnp.asarray(tok), 1.0)[1]))(
    jnp.asarray(z, jnp.float32)
  )
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[:, 7:] == 0)


def test_log1m_p_is_relatively_accurate_for_every_p():
  """Relatively accurate from p ≈ 1e-7 to p = 1 − 1e-17, within ``row_errors`` (≤ 3e-5 of
  |log(1 − p)| here): neither form alone achieves this (lse_others − lse is off by ~ulp(lse), 1e-7
  absolute, where log(1 − p) ≈ −p ≈ −1e-7; log1p(−p) is −inf where p rounds to 1)."""
  v = 50
  z = np.random.default_rng(5).normal(size=(41, v))
  z[:, 0] = np.linspace(-12.0, 45.0, 41) + _lse(z[:, 1:])  # token 0's logit sweeps p over (0, 1)
  logp, log1m = logp_log1m_p_from_logits(jnp.asarray(z, jnp.float32), jnp.zeros(41, int), 1.0)
  # Float64 oracle on the float32-rounded logits, so input rounding is not counted as error.
  logp_o, log1m_o, dz_o = oracle_rows(np.asarray(jnp.asarray(z, jnp.float32), np.float64), [0] * 41)
  assert np.exp(logp_o).min() < 1e-5 and np.exp(logp_o).max() > 1 - 1e-15
  z32 = np.asarray(jnp.asarray(z, jnp.float32), np.float64)
  _, e_log1m = row_errors(z32, np.zeros(41, int), np.zeros_like(z32))  # τ = 1: z exact
  assert np.max(e_log1m / np.abs(log1m_o)) <= 3e-5  # the claim, derived
  _assert_within(log1m, log1m_o, e_log1m, "log1m")
  grad = jax.grad(lambda x: jnp.sum(logp_log1m_p_from_logits(x, jnp.zeros(41, int), 1.0)[1]))(
    jnp.asarray(z, jnp.float32)
  )
  _, _, e_grad, _ = _fused_bounds(z32, np.eye(v), np.zeros(41, int), np.zeros(41), np.ones(41), 1.0)
  assert np.all(np.isfinite(grad))
  _assert_within(grad, dz_o, e_grad, "grad")


def test_the_config_chooses_the_forgetting_steps_clip():
  from run_helpers import tiny_config

  paper_cfg, ours_cfg = (
    tiny_config("eepo,test", **{"eepo.unlearn_clip": "paper"}),
    tiny_config("eepo,test"),
  )
  paper = forget_config(paper_cfg.eepo, paper_cfg.loss)
  assert paper.paper_clip and not forget_config(ours_cfg.eepo, ours_cfg.loss).paper_clip
