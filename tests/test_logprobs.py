"""Tests for jaxrl.nn.logprobs: fused vs naive vs a float64 numpy oracle, traced τ, memory, sharding."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import contains_primitive

from jaxrl.nn.logprobs import (
  fused_logprobs_entropy,
  logprobs_entropy_from_logits,
  naive_logprobs_entropy,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAUS = (0.7, 1.0, 1.3)
# B·T = 135 and T = 45: neither is a multiple of the chunk, so padding is exercised.
B, T, D, V, CHUNK = 3, 45, 32, 512, 16


def _inputs(seed=0, b=B, t=T, d=D, v=V, dtype=jnp.float32):
  k_h, k_w, k_t, k_c = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(k_h, (b, t, d), jnp.float32).astype(dtype)
  # Scale so logits/τ span a few units: peaked but not one-hot distributions.
  # drawn [D, V] and stored [V, D], as the model's head
  lm_head = (jax.random.normal(k_w, (d, v), jnp.float32).T * 2.0 / np.sqrt(d)).astype(dtype)
  tokens = jax.random.randint(k_t, (b, t), 0, v)
  weights = jax.random.normal(k_c, (2, b, t), jnp.float32)
  return hidden, lm_head, tokens, weights


U = float(np.finfo(np.float32).eps) / 2  # u = 2⁻²⁴, float32's unit roundoff


def _error_bounds(hidden, lm_head, tokens, weights, tau):
  """Elementwise bounds on |float32 − exact| for the log-probs, entropies and the gradients (by
  hidden, by the head) of Σ w_logp·logp + w_ent·H, whatever order XLA's CPU kernels add in (they
  block and vectorise for the host's instruction set). A sum of n terms rounds within n·u·Σ|terms|
  in any order (Higham, Accuracy and Stability, §3.1); to first order, from the float64 values:
  - a logit z = h·Wᵀ/τ (D terms, a division): e_z = (D + 1)·u·Σ_d|h_d·W_vd|/τ;
  - log-sum-exp: the largest e_z of its row, its V-term sum of exps in (0, 1], the exps, the log
    and the max's addition: (V + 4)·u·max(1, |lse|); a log-prob z_o − lse adds u·|log p|;
  - H = −Σ p·log p: log-probs off by e move it by ≤ e·(H + 1), its V-term sum by (V + 2)·u·H;
  - dz = w_logp·(onehot − p) − w_ent·p·(log p + H), p = exp(log p) off by (e + 2u) relative,
    and the backward's own V-term sums (V + 8)·u·|dz|; then dh = dz·W/τ sums V terms and dW =
    dzᵀ·h/τ the N rows: their magnitudes times (V + 1)·u and (N + 1)·u.
  Returns (logp, entropy, grad_hidden, grad_head) bounds, shaped as the values."""
  d = hidden.shape[-1]
  h = np.asarray(hidden, np.float64).reshape(-1, d)
  w = np.asarray(lm_head, np.float64)  # [V, D]
  n, v = h.shape[0], w.shape[0]
  tok = np.asarray(tokens).reshape(-1)
  z = h @ w.T / tau
  m = z.max(-1, keepdims=True)
  lse = m + np.log(np.exp(z - m).sum(-1, keepdims=True))
  logp = z - lse
  p = np.exp(logp)
  ent = -(p * logp).sum(-1, keepdims=True)
  e_z = (d + 1) * U * (np.abs(h) @ np.abs(w).T) / tau
  e_lse = e_z.max(-1, keepdims=True) + (v + 4) * U * np.maximum(1.0, np.abs(lse))
  e_logp = e_z + e_lse + U * np.abs(logp)  # [N, V]
  e_ent = e_logp.max(-1, keepdims=True) * (ent + 1) + (v + 2) * U * ent  # [N, 1]
  w_lp = np.abs(np.asarray(weights[0], np.float64)).reshape(-1, 1)
  w_ent = np.abs(np.asarray(weights[1], np.float64)).reshape(-1, 1)
  onehot = np.zeros_like(z)
  onehot[np.arange(n), tok] = 1.0
  dz = np.reshape(weights[0], (-1, 1)) * (onehot - p) - np.reshape(weights[1], (-1, 1)) * p * (
    logp + ent
  )
  e_p = e_logp + 2 * U
  e_dz = p * (w_lp * e_p + w_ent * (e_p * np.abs(logp + ent) + e_logp + e_ent)) + (v + 8) * U * (
    np.abs(dz)
  )
  e_gh = (e_dz @ np.abs(w) + (v + 1) * U * (np.abs(dz) @ np.abs(w))) / tau
  e_gw = ((e_dz.T @ np.abs(h)) + (n + 1) * U * (np.abs(dz).T @ np.abs(h))) / tau
  shape = tokens.shape
  return (
    e_logp[np.arange(n), tok].reshape(shape),
    np.broadcast_to(e_ent, (n, 1)).reshape(shape),
    e_gh.reshape(hidden.shape),
    e_gw,
  )


def _assert_within(actual, expected, bound, what=""):
  """|actual − expected| ≤ bound, elementwise (``bound`` an array or a scalar)."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  excess = np.abs(actual - expected) - bound
  assert np.all(excess <= 0), (what, float(np.max(excess)))


def _oracle(hidden, lm_head, tokens, weights, tau):
  """Float64 numpy values and analytic gradients of Σ w_logp·logp + w_ent·H."""
  h = np.asarray(hidden, np.float64)
  h_NxD = h.reshape(-1, h.shape[-1])
  w_DxV = np.asarray(lm_head, np.float64).T  # the head is stored [V, D]
  tok_N = np.asarray(tokens).reshape(-1)
  z_NxV = h_NxD @ w_DxV / tau
  m_N = z_NxV.max(-1, keepdims=True)
  logp_NxV = z_NxV - m_N - np.log(np.exp(z_NxV - m_N).sum(-1, keepdims=True))
  p_NxV = np.exp(logp_NxV)
  ent_N = -(p_NxV * logp_NxV).sum(-1)
  rows = np.arange(len(tok_N))
  logp_N = logp_NxV[rows, tok_N]
  onehot_NxV = np.zeros_like(z_NxV)
  onehot_NxV[rows, tok_N] = 1.0
  w_lp = np.asarray(weights[0], np.float64).reshape(-1, 1)
  w_ent = np.asarray(weights[1], np.float64).reshape(-1, 1)
  # d logp/dz = onehot − p ; dH/dz = −p·(log p + H), with z = logits/τ.
  dz_NxV = w_lp * (onehot_NxV - p_NxV) - w_ent * p_NxV * (logp_NxV + ent_N[:, None])
  dlogits_NxV = dz_NxV / tau
  grad_h = (dlogits_NxV @ w_DxV.T).reshape(h.shape)
  grad_w = (h_NxD.T @ dlogits_NxV).T
  return logp_N.reshape(tokens.shape), ent_N.reshape(tokens.shape), grad_h, grad_w


def _objective(fn):
  def objective(hidden, lm_head, tokens, weights, tau):
    logp, ent = fn(hidden, lm_head, tokens, tau)
    return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * ent), (logp, ent)

  return jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))


FUSED = _objective(lambda *a: fused_logprobs_entropy(*a, chunk_size=CHUNK))
NAIVE = _objective(naive_logprobs_entropy)


@pytest.mark.parametrize("tau", TAUS)
def test_fused_matches_naive_values_and_gradients(tau):
  hidden, lm_head, tokens, weights = _inputs()
  tau = jnp.float32(tau)
  (_, (logp_f, ent_f)), (gh_f, gw_f) = FUSED(hidden, lm_head, tokens, weights, tau)
  (_, (logp_n, ent_n)), (gh_n, gw_n) = NAIVE(hidden, lm_head, tokens, weights, tau)
  assert logp_f.shape == ent_f.shape == (B, T)
  # Chunks change the matmuls' shapes, so XLA may sum in other orders: each side within the
  # bounds of exact, the two within twice them.
  bounds = _error_bounds(hidden, lm_head, tokens, weights, float(tau))
  for got, want, bound, name in zip(
    (logp_f, ent_f, gh_f, gw_f), (logp_n, ent_n, gh_n, gw_n), bounds, ("logp", "H", "dh", "dW")
  ):
    _assert_within(got, want, 2 * bound, name)


@pytest.mark.parametrize("tau", TAUS)
def test_fused_matches_float64_oracle(tau):
  hidden, lm_head, tokens, weights = _inputs(seed=1)
  logp_o, ent_o, gh_o, gw_o = _oracle(hidden, lm_head, tokens, weights, tau)
  (_, (logp, ent)), (gh, gw) = FUSED(hidden, lm_head, tokens, weights, jnp.float32(tau))
  # τ as the library gets it (float32): the oracle divides by the same number.
  bounds = _error_bounds(hidden, lm_head, tokens, weights, tau)
  for got, want, bound, name in zip(
    (logp, ent, gh, gw), (logp_o, ent_o, gh_o, gw_o), bounds, ("logp", "H", "dh", "dW")
  ):
    _assert_within(got, want, bound, name)
  assert np.all(np.asarray(ent) >= 0) and np.all(np.asarray(ent) <= np.log(V) + bounds[1])


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 135, 1000])
def test_any_chunk_size_gives_the_same_answer(chunk_size):
  hidden, lm_head, tokens, _ = _inputs(seed=2)
  tau = jnp.float32(0.9)
  logp_n, ent_n = naive_logprobs_entropy(hidden, lm_head, tokens, tau)
  logp_f, ent_f = fused_logprobs_entropy(hidden, lm_head, tokens, tau, chunk_size=chunk_size)
  e_logp, e_ent, _, _ = _error_bounds(hidden, lm_head, tokens, np.zeros((2, B, T)), 0.9)
  _assert_within(logp_f, logp_n, 2 * e_logp, "logp")  # two float32 sides: twice the bound
  _assert_within(ent_f, ent_n, 2 * e_ent, "H")


def test_tau_is_traced_one_compile_for_two_values():
  hidden, lm_head, tokens, _ = _inputs()
  traces = []

  @jax.jit
  def f(hidden, lm_head, tokens, tau):
    traces.append(1)  # Python side effect: runs once per trace, not per call
    return fused_logprobs_entropy(hidden, lm_head, tokens, tau, chunk_size=CHUNK)

  logp_a, ent_a = f(hidden, lm_head, tokens, jnp.float32(0.7))
  logp_b, ent_b = f(hidden, lm_head, tokens, jnp.float32(1.3))
  assert len(traces) == 1  # the second τ reused the first trace: no recompilation
  # And τ really is used: the two results differ and each matches its own oracle.
  for tau, logp, ent in [(0.7, logp_a, ent_a), (1.3, logp_b, ent_b)]:
    logp_o, ent_o, _, _ = _oracle(hidden, lm_head, tokens, jnp.zeros((2, B, T)), tau)
    e_logp, e_ent, _, _ = _error_bounds(hidden, lm_head, tokens, np.zeros((2, B, T)), tau)
    _assert_within(logp, logp_o, e_logp, "logp")
    _assert_within(ent, ent_o, e_ent, "H")
  assert not np.allclose(ent_a, ent_b)


def test_from_logits_single_position_and_masked_vocab():
  """The sampler's use: one row per sequence, with −inf on masked (e.g. padded) vocab ids."""
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(5, 50)) * 4.0
  logits[:, 40:] = -np.inf
  logits[0] *= 100.0  # near one-hot row: entropy must stay ≥ 0 and finite
  tokens = np.array([0, 3, 39, 7, 12])
  tau = 0.8
  logp, ent = logprobs_entropy_from_logits(
    jnp.asarray(logits, jnp.float32), jnp.asarray(tokens), jnp.float32(tau)
  )
  assert logp.dtype == ent.dtype == jnp.float32
  # The oracle takes the float32 logits and τ the library gets. In float32, z = x/τ rounds by
  # u·|z|, so z − max z by u·(|z| + |max z|) ≤ 2u·|z|max, each exp(z − max z) by that relative
  # and 2u more; the row's sum over its n = 40 finite terms by n·u (in any order: Higham,
  # Accuracy and Stability, §3.1); the log, the max added back and the log-prob's subtraction by
  # u·(1 + |lse| + |log p|): a log-prob is within e = (5·|z|max + n + 4 + |lse|)·u of exact (the
  # near one-hot row's |z| ~ 10³ dominates its e), and H = −Σ p·log p within e·(1 + H) + n·u·H.
  x32 = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)
  tau32 = float(np.float32(tau))
  for i in range(5):  # per-row Python loop over the finite entries
    z = x32[i, :40] / tau32
    lse = np.log(np.sum(np.exp(z - z.max()))) + z.max()
    p = np.exp(z - lse)
    want_ent = -np.sum(p * (z - lse))
    e = (5 * np.max(np.abs(z)) + 40 + 4 + abs(lse)) * U
    np.testing.assert_allclose(logp[i], z[tokens[i]] - lse, rtol=0, atol=e)
    np.testing.assert_allclose(
      ent[i], want_ent, rtol=0, atol=e * (1 + want_ent) + 40 * U * want_ent
    )

  def total(lg):
    lp, h = logprobs_entropy_from_logits(lg, jnp.asarray(tokens), jnp.float32(tau))
    return jnp.sum(lp) + jnp.sum(h)

  grad = np.asarray(jax.grad(total)(jnp.asarray(logits, jnp.float32)))
  assert np.all(np.isfinite(grad)) and np.all(grad[:, 40:] == 0)


def test_bfloat16_inputs_compute_in_float32():
  hidden, lm_head, tokens, weights = _inputs(seed=4, dtype=jnp.bfloat16)
  tau = 1.0
  (_, (logp, ent)), (gh, gw) = FUSED(hidden, lm_head, tokens, weights, jnp.float32(tau))
  assert logp.dtype == ent.dtype == jnp.float32
  assert gh.dtype == gw.dtype == jnp.bfloat16
  # Oracle on the bf16-rounded inputs: only float32 rounding separates them, not bf16's 3 digits
  # (the matmul's products of bf16 values are exact in float32, its sums accumulate in float32).
  h32, w32 = hidden.astype(jnp.float32), lm_head.astype(jnp.float32)
  logp_o, ent_o, _, _ = _oracle(h32, w32, tokens, weights, tau)
  e_logp, e_ent, _, _ = _error_bounds(h32, w32, tokens, weights, tau)
  _assert_within(logp, logp_o, e_logp, "logp")
  _assert_within(ent, ent_o, e_ent, "H")


def test_no_gather_on_the_vocab_axis():
  hidden, lm_head, tokens, weights = _inputs()

  def objective(hidden, lm_head, tau):
    logp, ent = fused_logprobs_entropy(hidden, lm_head, tokens, tau, chunk_size=CHUNK)
    return jnp.sum(logp) + jnp.sum(ent)

  args = (hidden, lm_head, jnp.float32(1.0))
  grad_jaxpr = jax.make_jaxpr(jax.value_and_grad(objective, argnums=(0, 1)))(*args).jaxpr
  assert not contains_primitive(grad_jaxpr, "gather")
  assert contains_primitive(jax.make_jaxpr(objective)(*args).jaxpr, "remat2")  # jax.checkpoint


def _temp_bytes(fn, b, t, d, v):
  hidden, lm_head, tokens, _ = _inputs(b=b, t=t, d=d, v=v)

  def objective(hidden, lm_head, tau):
    logp, ent = fn(hidden, lm_head, tokens, tau)
    return jnp.sum(logp) + jnp.sum(ent)

  grad_fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))
  compiled = grad_fn.lower(hidden, lm_head, jnp.float32(0.7)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_fused_gradient_temp_memory_is_far_below_naive_and_flat_in_t():
  fused = lambda *a: fused_logprobs_entropy(*a, chunk_size=64)
  fused_mib = _temp_bytes(fused, 4, 400, 64, 4096) / 2**20
  fused_long_mib = _temp_bytes(fused, 4, 1600, 64, 4096) / 2**20
  naive_mib = _temp_bytes(naive_logprobs_entropy, 4, 400, 64, 4096) / 2**20
  # Observed on this machine (jax 0.10.2 CPU, highest precision): fused 5.0 MiB at T=400 and
  # 5.0 MiB at T=1600; naive 100 MiB at T=400 (20x).
  assert fused_mib < naive_mib / 10
  assert fused_long_mib < 1.25 * fused_mib


@pytest.mark.slow
def test_vocab_sharded_over_tensor_axis_matches_and_never_gathers_logits():
  """Two fake CPU devices (own process: the device count is fixed at JAX start-up)."""
  script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_num_cpu_devices", 2)
        jax.config.update("jax_default_matmul_precision", "highest")
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        from jaxrl.nn.logprobs import fused_logprobs_entropy, naive_logprobs_entropy
        k = jax.random.split(jax.random.key(0), 3)
        h = jax.random.normal(k[0], (2, 37, 16))
        w = jax.random.normal(k[1], (16, 256)).T * 0.5  # the head [V, D]
        tok = jax.random.randint(k[2], (2, 37), 0, 256)
        tau = jnp.float32(0.7)
        def loss(fn, h, w, tau):
            lp, ent = fn(h, w, tok, tau)
            return jnp.sum(lp) + 0.3 * jnp.sum(ent)
        fused = lambda *a: fused_logprobs_entropy(*a, chunk_size=16)
        ref = jax.value_and_grad(lambda *a: loss(naive_logprobs_entropy, *a), (0, 1))(h, w, tau)
        # Sharding splits the vocabulary's sums into two partial sums and an all-reduce: another
        # order. Each side rounds within its chain of sums, D (logits) + V (log-sum-exp, the
        # entropy, the backward's vocabulary sums) + N (the head's gradient over the 74 rows)
        # terms, + 8 for exps, logs and divisions, times u of the values' scale; two sides.
        rtol = 2 * (16 + 256 + 74 + 8) * 2.0**-24
        for mode in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((2,), ("tensor",), axis_types=(mode,))
            with jax.set_mesh(mesh):
                w_sharded = jax.device_put(w, NamedSharding(mesh, P("tensor", None)))
                step = jax.jit(jax.value_and_grad(lambda *a: loss(fused, *a), (0, 1)))
                hlo = step.lower(h, w_sharded, tau).compile().as_text()
                out = step(h, w_sharded, tau)
            assert "all-gather" not in hlo, mode
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
                a, b = np.asarray(a), np.asarray(b)
                assert np.max(np.abs(a - b)) <= rtol * np.max(np.abs(b)), mode
        print("OK")
    """)
  env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
