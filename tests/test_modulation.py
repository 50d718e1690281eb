"""DynaMO advantage modulation (docs/algorithms.md §4, Eq. 8–14) against a float64 Python-loop oracle.

Also checks that `grpo_loss(..., adv_RxT=...)` uses per-token advantages: the broadcast sequence
advantage gives exactly the adv_R path, a non-uniform one matches a token loop of the surrogate;
and that α changes between two steps of the run's update without a recompile (§1.5).
"""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import rollouts, tiny_config

from jaxrl.config import loss_config
from jaxrl.nn import model
from jaxrl.parallel import sharding
from jaxrl.rl import optim
from jaxrl.rl.advantages import DynamoStats, dynamo_modulate, dynamo_statistics
from jaxrl.rl.losses import LossConfig, LossHparams, grpo_loss, loss_denominator
from jaxrl.rl.programs import Programs
from jaxrl.run.context import compile_counter

R, T = 6, 7


def oracle_modulate(adv, logp, old, ent, mask, eps_low, eps_high, alpha=0.4, gamma=50.0, tau=0.9):
  """Eq. 8–14 one token at a time in float64, straight from the spec's wording."""
  n_rows, n_tok = len(mask), len(mask[0])
  valid = [(i, t) for i in range(n_rows) for t in range(n_tok) if mask[i][t]]
  t1, big_xi = {}, {}
  for i, t in valid:
    t1[i, t] = math.exp(logp[i][t]) * (logp[i][t] + ent[i][t])
  for i, t in valid:
    a = float(adv[i])
    rho = math.exp(logp[i][t] - old[i][t])
    on = (a > 0 and rho <= 1 + eps_high) or (a < 0 and rho >= 1 - eps_low)
    xi = rho * a if on else 0.0
    row = [t1[i, s] for s in range(n_tok) if mask[i][s]]
    big_xi[i, t] = abs(xi * (t1[i, t] - sum(row) / len(row)))
  xi_max = max(big_xi.values(), default=0.0)
  hs = [ent[i][t] for i, t in valid]
  out = np.zeros((n_rows, n_tok))
  for i, t in valid:
    x = big_xi[i, t] / (xi_max + 1e-8)
    lam = 1 - alpha
    f = lam + (1 - lam) / (1 + math.exp(gamma * (x - tau)))
    g = 1 + alpha * (max(hs) - ent[i][t]) / (max(hs) - min(hs) + 1e-8) if adv[i] > 0 else 1.0
    out[i, t] = adv[i] * f * g
  return out


MODULATE = jax.jit(dynamo_modulate)
U = float(np.finfo(np.float32).eps) / 2  # u = 2⁻²⁴, float32's unit roundoff


def _f32(x):
  """Values (arrays or scalars) as the library gets them: rounded to float32, held in float64."""
  return np.asarray(np.asarray(x, np.float32), np.float64)


def _assert_within(actual, expected, bound, what=""):
  """|actual − expected| ≤ bound, elementwise (``bound`` an array or a scalar)."""
  excess = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64)) - bound
  assert np.all(excess <= 0), (what, float(np.max(excess)))


def modulate_error_bound(adv, logp, old, ent, mask, eps_low, eps_high, alpha, gamma, tau):
  """Elementwise |float32 dynamo_modulate − exact| for float32 inputs, to first order, step by
  step as the library computes (a float32 operation rounds within u of its result; XLA's exp
  within 3u; the row mean of t1 is a sum of ≤ T terms, within T·u·Σ|t1| in any order: Higham,
  Accuracy and Stability, §3.1 — the one sum here whose order a CPU may change). Maxima, minima
  and the masks are exact. f's sigmoid of slope γ amplifies the error of x = Ξ/max Ξ by |f'(x)| =
  (1 − λ)·γ·s·(1 − s). Also asserts that no token's clip decision (ρ against 1 ± ε) lies within
  ρ's rounding of its threshold, so the branches taken are the oracle's on any CPU."""
  a = np.asarray(adv, np.float64)[:, None] * np.ones_like(mask)
  on = mask > 0
  lp, o, h = (np.where(on, x, 0.0) for x in (logp, old, ent))
  rho = np.exp(lp - o)
  e_rho = (np.abs(lp - o) + 4) * U * rho
  hi, lo = 1 + eps_high, 1 - eps_low
  near = on & (((a > 0) & (np.abs(rho - hi) <= e_rho)) | ((a < 0) & (np.abs(rho - lo) <= e_rho)))
  assert not near.any(), "a clip decision lies within rounding of its threshold"
  keep = ((a > 0) & (rho <= hi)) | ((a < 0) & (rho >= lo))
  xi = np.where(keep, rho * a, 0.0)
  e_xi = np.where(keep, (e_rho + U * rho) * np.abs(a), 0.0)
  t1 = np.exp(lp) * (lp + h)
  e_t1 = 5 * U * np.abs(t1)
  n = np.maximum(mask.sum(1, keepdims=True), 1)
  mean = (t1 * mask).sum(1, keepdims=True) / n
  e_mean = (
    (e_t1 * mask).sum(1, keepdims=True) + n * U * (np.abs(t1) * mask).sum(1, keepdims=True)
  ) / n
  e_mean += U * np.abs(mean)
  dev = t1 - mean
  e_dev = e_t1 + e_mean + U * np.abs(dev)
  big = np.abs(xi * dev) * mask
  e_big = (np.abs(xi) * e_dev + np.abs(dev) * e_xi + U * big) * mask
  den = big.max() + 1e-8
  x = big / den
  e_x = (e_big + x * (e_big.max() + U * den)) / den + U * x
  s = 1 / (1 + np.exp(gamma * (x - tau)))
  f = (1 - alpha) + alpha * s
  e_f = alpha * gamma * s * (1 - s) * (e_x + U * np.abs(x - tau)) + 8 * U * f
  h_on = h[on]
  rng = h_on.max() - h_on.min() + 1e-8 if on.any() else 1.0
  g = np.where(a > 0, 1 + alpha * (h_on.max() - h) / rng if on.any() else 1.0, 1.0)
  e_g = np.where(a > 0, 4 * U * g, 0.0)
  out = a * f * g
  return (np.abs(a) * (e_f * g + f * e_g) + 2 * U * np.abs(out)) * mask


def _random_batch(seed, equal_entropy=False):
  rng = np.random.default_rng(seed)
  logp = -rng.exponential(1.0, (R, T))
  # Ratios around 1 with some well outside [1−ε_low, 1+ε_high], so both I branches are exercised.
  old = logp + rng.normal(0.0, 0.25, (R, T))
  ent = rng.uniform(0.0, 3.0, (R, T))
  if equal_entropy:
    ent[:] = 1.25
  mask = (rng.uniform(size=(R, T)) < 0.8).astype(np.float64)
  mask[0, 4:] = 0.0  # a response that ended early
  mask[1] = 0.0  # an empty (padding) row
  adv = rng.normal(size=R)
  adv[2] = 0.0  # a constant group
  adv[3] = -abs(adv[3])
  adv[4] = abs(adv[4])
  # Padding garbage: the sampler may leave −inf log-probs and NaN-free junk behind the mask.
  logp_in = np.where(mask > 0, logp, -np.inf)
  ent_in = np.where(mask > 0, ent, 123.0)
  return adv, logp, old, ent, mask, logp_in, ent_in


def _call(
  adv, logp, old, ent, mask, eps_low=0.2, eps_high=0.28, alpha=0.4, gamma=50.0, tau=0.9, fn=MODULATE
):
  f = lambda x: jnp.asarray(x, jnp.float32)
  hyper = (f(eps_low), f(eps_high), f(alpha), f(gamma), f(tau))
  return fn(f(adv), f(logp), f(old), f(ent), f(mask), *hyper)


def test_worked_example_m1():
  out = dynamo_modulate(
    jnp.array([1.0, -0.5]),
    jnp.array([[-0.1, -1.0, -0.05], [-0.2, -2.0, 0.0]]),
    jnp.array([[-0.1, -1.2, -0.05], [-0.25, -2.0, 0.0]]),
    jnp.array([[0.3, 1.5, 0.2], [0.6, 2.0, 0.0]]),
    jnp.array([[1, 1, 1], [1, 1, 0]]),
    0.2,
    0.28,
  )
  expected = [[1.377778, 1.111111, 1.4], [-0.301339, -0.314332, 0.0]]
  # Worked values printed to 6 decimals (≤ 5e-7), a few float32 operations each (the sigmoid's
  # slope γ·α/4 = 5 times a few u): atol 1e-5 holds with room on any CPU.
  np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("equal_entropy", [False, True])
@pytest.mark.parametrize("gamma,tau", [(50.0, 0.9), (5.0, 0.3)])  # the soft one varies f widely
def test_matches_python_loop_oracle(seed, equal_entropy, gamma, tau):
  adv, logp, old, ent, mask, logp_in, ent_in = _random_batch(seed, equal_entropy)
  # The oracle on the float32 inputs and hyperparameters the library gets: only float32
  # arithmetic separates them, within ``modulate_error_bound``.
  args = tuple(_f32(x) for x in (adv, logp, old, ent)) + (mask,)
  hyper = tuple(float(_f32(x)) for x in (0.2, 0.28, 0.4, gamma, tau))
  expected = oracle_modulate(*args, *hyper)
  out = np.asarray(_call(adv, logp_in, old, ent_in, mask, gamma=gamma, tau=tau))
  assert out.shape == (R, T) and np.all(np.isfinite(out))
  _assert_within(out, expected, modulate_error_bound(*args, *hyper))
  assert np.all(out[mask == 0] == 0) and np.all(out[2] == 0)  # masked tokens and A = 0
  assert np.all(np.sign(out[mask > 0]) == np.sign(np.broadcast_to(adv[:, None], (R, T))[mask > 0]))
  # f ∈ [1−α, 1] and g ∈ [1, 1+α]: |A_final/A| ∈ [0.6, 1.4]; A < 0 gets no compensation (≤ 1).
  on = (mask > 0) & (adv[:, None] != 0)
  ratio = out[on] / np.broadcast_to(adv[:, None], (R, T))[on]
  # f·g within its bounds exactly; A·f·g rounds twice, A/adv once more (float32 vs float64 adv),
  # and f, g a few times each: 1e-6 ≈ 17u leaves room for all of them.
  assert np.all(ratio >= 0.6 - 1e-6) and np.all(ratio <= 1.4 + 1e-6)
  assert np.all(out[3][mask[3] > 0] / adv[3] <= 1 + 1e-6)
  if equal_entropy:  # no entropy range: g ≡ 1, so nothing grows
    assert np.all(ratio <= 1 + 1e-6)


def test_hyperparameters_are_traced_and_used():
  adv, logp, old, ent, mask, _, _ = _random_batch(7)
  chex.clear_trace_counter()
  modulate = jax.jit(chex.assert_max_traces(dynamo_modulate, n=1))  # a second trace raises
  args = tuple(_f32(x) for x in (adv, logp, old, ent)) + (mask,)
  for eps_low, eps_high, alpha in [(0.2, 0.28, 0.4), (0.1, 0.1, 0.2), (0.3, 0.5, 0.0)]:
    out = np.asarray(_call(adv, logp, old, ent, mask, eps_low, eps_high, alpha, fn=modulate))
    hyper = tuple(float(_f32(x)) for x in (eps_low, eps_high, alpha, 50.0, 0.9))
    expected = oracle_modulate(*args, *hyper)
    _assert_within(out, expected, modulate_error_bound(*args, *hyper))
  # α = 0: both factors are exactly 1 (f = 1 + 0·s, g = 1 + 0·…), so A·f·g is float32(A) exactly.
  out = np.asarray(_call(adv, logp, old, ent, mask, 0.2, 0.28, 0.0))
  np.testing.assert_allclose(out, _f32(adv)[:, None] * mask, rtol=0, atol=0)


def test_all_masked_batch_is_zero_and_finite():
  adv, logp, old, ent, _, _, _ = _random_batch(8)
  out = np.asarray(_call(adv, logp, old, ent, np.zeros((R, T))))
  assert np.all(out == 0)


def test_no_gradient_flows_through_the_modulation():
  adv, logp, old, ent, mask, _, _ = _random_batch(9)
  f = lambda x: jnp.asarray(x, jnp.float32)

  def total(logp, ent):
    return jnp.sum(dynamo_modulate(f(adv), logp, f(old), ent, f(mask), 0.2, 0.28))

  g_logp, g_ent = jax.grad(total, argnums=(0, 1))(f(logp), f(ent))
  assert np.all(np.asarray(g_logp) == 0) and np.all(np.asarray(g_ent) == 0)


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_with_the_mini_batch_statistics_give_the_mini_batch_modulation(chunks):
  """docs/algorithms.md §4.3: max Ξ, H_min and H_max are the mini-batch's. Per-chunk statistics
  reduced and handed to each chunk's call give the one-call result; every other value of Ξ, f and
  g is row-local (a row's own mean E_i), so the chunks' outputs are the same float32 operations
  on the same values: equal bit for bit. A chunk with no valid token (row 1 alone) changes
  nothing. Without the statistics, each chunk normalises by its own and the result differs."""
  adv, _, old, _, mask, logp_in, ent_in = _random_batch(11)
  f = lambda x: jnp.asarray(x, jnp.float32)
  args = lambda rows: (f(adv[rows]), f(logp_in[rows]), f(old[rows]), f(ent_in[rows]), f(mask[rows]))
  whole = np.asarray(dynamo_modulate(*args(slice(None)), 0.2, 0.28))
  parts = [np.arange(R)[c::chunks] for c in range(chunks)] + [np.array([1])]
  stats = DynamoStats.reduce(
    jax.tree.map(
      lambda *x: jnp.stack(x), *(dynamo_statistics(*args(rows), 0.2, 0.28) for rows in parts)
    )
  )
  own = np.zeros_like(whole)
  for rows in parts:
    got = np.asarray(dynamo_modulate(*args(rows), 0.2, 0.28, stats=stats))
    np.testing.assert_array_equal(got, whole[rows])
    own[rows] = np.asarray(dynamo_modulate(*args(rows), 0.2, 0.28))
  assert np.max(np.abs(own - whole)) > 0.01  # the split would matter without the statistics


def test_statistics_of_no_valid_token_are_the_identities():
  adv, logp, old, ent, _, _, _ = _random_batch(12)
  f = lambda x: jnp.asarray(x, jnp.float32)
  stats = dynamo_statistics(f(adv), f(logp), f(old), f(ent), jnp.zeros((R, T)), 0.2, 0.28)
  assert (float(stats.xi_max), float(stats.h_min), float(stats.h_max)) == (0.0, np.inf, -np.inf)


# ------------------------------------------------------------ grpo_loss with per-token advantages


def _loss_inputs(seed):
  adv, logp, old, ent, mask, _, _ = _random_batch(seed)
  f = lambda x: jnp.asarray(x, jnp.float32)
  informative = np.ones(R, bool)
  informative[2] = False
  ref = logp + np.random.default_rng(seed).normal(0.0, 0.1, (R, T))
  return f(adv), f(logp), f(old), f(ent), f(mask), f(ref), jnp.asarray(informative)


@pytest.mark.parametrize(
  "cfg",
  [
    LossConfig(informative_only=False),
    LossConfig(
      aggregation="seq-mean-token-mean", dual_clip=3.0, use_kl=True, informative_only=False
    ),
    LossConfig(aggregation="seq-mean-token-sum-norm", max_response_len=T, informative_only=True),
  ],
)
def test_grpo_broadcast_adv_rxt_equals_adv_r_path(cfg):
  adv, logp, old, ent, mask, ref, informative = _loss_inputs(10)
  hp = LossHparams.create(kl_coef=0.05, entropy_coef=0.01)
  denom = loss_denominator(mask, informative, cfg)

  def run(adv_rxt):
    def loss(logp, ent):
      return grpo_loss(logp, old, adv, mask, ent, ref, informative, denom, hp, cfg, adv_RxT=adv_rxt)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(logp, ent)

  (loss_a, met_a), grads_a = run(None)
  (loss_b, met_b), grads_b = run(jnp.broadcast_to(adv[:, None], (R, T)))
  assert float(loss_a) == float(loss_b)
  for a, b in zip(jax.tree.leaves((met_a, grads_a)), jax.tree.leaves((met_b, grads_b))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grpo_uses_per_token_advantages():
  adv, logp, old, ent, mask, ref, informative = _loss_inputs(11)
  adv_rxt = dynamo_modulate(adv, logp, old, ent, mask, 0.2, 0.28)
  cfg, hp = LossConfig(informative_only=False), LossHparams.create()
  denom = loss_denominator(mask, informative, cfg)
  # Padding garbage in adv_RxT must not leak: NaN on masked positions.
  adv_in = jnp.where(mask > 0, adv_rxt, jnp.nan)

  def loss(logp):
    return grpo_loss(logp, old, None, mask, None, None, None, denom, hp, cfg, adv_RxT=adv_in)[0]

  value, grad = jax.value_and_grad(loss)(logp)
  a, lp, lo, m = (np.asarray(x, np.float64) for x in (adv_rxt, logp, old, mask))
  total, magnitude, g = 0.0, 0.0, np.zeros((R, T))
  for i in range(R):
    for t in range(T):
      if not m[i, t]:
        continue
      rho = math.exp(lp[i, t] - lo[i, t])
      clipped = min(max(rho, 0.8), 1.28)
      total += min(rho * a[i, t], clipped * a[i, t])
      magnitude += abs(min(rho * a[i, t], clipped * a[i, t]))
      # The unclipped branch is the active min (or ties) iff the clip does not bind.
      if rho * a[i, t] <= clipped * a[i, t]:
        g[i, t] = -rho * a[i, t] / m.sum()
  # The same float32 inputs on both sides. The value sums n signed per-token terms (ρ = exp of a
  # difference, the clip, ·A: ≤ 6u each): within (n + 6)·u·Σ|terms| in any order (Higham,
  # Accuracy and Stability, §3.1), divided by the exact count. A gradient entry is elementwise,
  # −ρ·A/n: within a few u of itself (rtol 1e-5 ≈ 170u).
  n = m.sum()
  atol = (n + 6) * U * magnitude / n
  np.testing.assert_allclose(float(value), -total / n, rtol=0, atol=atol)
  np.testing.assert_allclose(np.asarray(grad), g, rtol=1e-5, atol=1e-7)


def test_alpha_changes_between_steps_without_a_recompile():
  """DynaMO's α, γ and τ_s are traced (``LossHparams``, docs/algorithms.md §1.5): a new α between
  two steps of the run's update program reaches the loss and compiles nothing."""
  cfg = tiny_config("test", **{"modulation.enabled": True, "rollout.max_new_tokens": 5})
  mcfg = model.ModelConfig(
    vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16,
  )  # fmt: skip
  graphdef, params = model.create(mcfg, 0)
  programs = Programs(graphdef, params, sharding.make_mesh(1, 1, 1), optim.from_config(cfg.optim))
  update = programs.update(loss_config(cfg))
  rng = np.random.default_rng(3)
  rows, p, n = cfg.num_rollouts, 4, 5
  mask = np.arange(n)[None, :] < rng.integers(2, n + 1, (rows, 1))
  batch = rollouts(
    prompt_ids_RxP=rng.integers(0, 32, (rows, p)).astype(np.int32),
    prompt_mask_RxP=np.ones((rows, p), bool),
    tokens_RxN=rng.integers(0, 32, (rows, n)).astype(np.int32),
    mask_RxN=mask,
    behaviour_logp_RxN=np.where(mask, -rng.random((rows, n)) * 3 - 0.5, 0.0),
    rewards_R=np.tile([1.0, 0.0, 0.0, 1.0], rows // 4),  # every group informative
    group_ids_R=np.repeat(np.arange(cfg.batch_questions), cfg.rollout.group_size),
  )
  counter = compile_counter().start()
  pg_losses = []
  try:
    for alpha in (0.4, 0.8):
      step_cfg = dataclasses.replace(
        cfg, modulation=dataclasses.replace(cfg.modulation, alpha=alpha)
      )
      hp = LossHparams.from_config(step_cfg.loss, step_cfg.modulation, 1.0, cfg.loss.eps_high)
      _, metrics = update(programs.init_state(params), batch, hp)  # the state is donated
      pg_losses.append(float(metrics["pg_loss"]))
  finally:
    counter.stop()
  assert pg_losses[0] != pg_losses[1], pg_losses  # α reached the modulated advantages
  assert update._cache_size() == 1
  assert counter.counts()["compiles_update"] == 1
