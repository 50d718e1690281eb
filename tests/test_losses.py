"""GRPO loss and advantages against float64 Python-loop oracles (docs/algorithms.md §1).

The oracles loop over rollouts and tokens and share no code with jaxrl.losses; gradients are
checked against hand-derived per-token derivatives, and micro-batch accumulation against one batch.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rounding import U, sum_tol

from jaxrl.rl.advantages import group_advantages, informative_rollouts
from jaxrl.rl.losses import (
  LossConfig,
  LossHparams,
  LossMetrics,
  finalize_metrics,
  grpo_loss,
  loss_denominator,
)

EPS_LOW, EPS_HIGH, KL_COEF = 0.2, 0.28, 0.05
T_MAX = 9
# ---------------------------------------------------------------- oracles (float64, loops)


def oracle_advantages(rewards, gids, num_groups, scale_by_std=True, eps=1e-6, valid=None):
  R = len(rewards)
  valid = [True] * R if valid is None else list(valid)
  adv = [0.0] * R
  for g in range(num_groups):
    members = [j for j in range(R) if valid[j] and gids[j] == g]
    vals = [float(rewards[j]) for j in members]
    if len(vals) < 2 or max(vals) == min(vals):
      continue
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    for j in members:
      d = float(rewards[j]) - mean
      adv[j] = d / (std + eps) if scale_by_std else d
  return np.array(adv)


def oracle_informative(rewards, gids, valid):
  out = []
  for j in range(len(rewards)):
    group = [rewards[i] for i in range(len(rewards)) if valid[i] and gids[i] == gids[j]]
    out.append(bool(valid[j]) and max(group) != min(group))
  return np.array(out)


def oracle_loss(b, cfg, eps_low, eps_high, kl_coef, ent_coef):
  """Loss, d loss/d logp, d loss/d entropy and token metrics, one token at a time."""
  R, T = b["mask"].shape
  rows = [r for r in range(R) if (b["informative"][r] or not cfg.informative_only)]
  lens = {r: sum(b["mask"][r]) for r in range(R)}
  if cfg.aggregation == "token-mean":
    denom = sum(lens[r] for r in rows)
  else:
    denom = sum(1 for r in rows if lens[r] > 0)
  total = 0.0
  g_logp, g_ent = np.zeros((R, T)), np.zeros((R, T))
  m = dict(tokens=0, clipped=0, dual=0, ratio=0.0, kl=0.0, ent=0.0, pg=0.0)
  # Σ|term| of each sum, the scale of its float32 rounding: the loss's (every term it adds), the
  # policy-gradient part's, and the KL's (of exp(d), d and 1 for k3, where they cancel).
  m.update(loss_mag=0.0, pg_mag=0.0, kl_mag=0.0)
  for r in rows:
    norm = {
      "token-mean": 1.0,
      "seq-mean-token-mean": max(lens[r], 1),
      "seq-mean-token-sum-norm": cfg.max_response_len,
    }[cfg.aggregation]
    a = float(b["adv"][r])
    for t in range(T):
      if not b["mask"][r][t]:
        continue
      lp, old, ref, h = (float(b[k][r][t]) for k in ("logp", "old", "ref", "ent"))
      rho = math.exp(lp - old)
      unclipped = rho * a
      clipped = min(max(rho, 1 - eps_low), 1 + eps_high) * a
      obj, grad_obj = (clipped, 0.0) if clipped < unclipped else (unclipped, rho * a)
      dual = cfg.dual_clip > 0 and a < 0 and cfg.dual_clip * a > obj
      if dual:
        obj, grad_obj = cfg.dual_clip * a, 0.0
      kl = dkl = kl_mag = 0.0
      if cfg.use_kl:
        d = ref - lp
        kl, dkl, kl_mag = {
          "k1": (-d, 1.0, abs(d)),
          "k2": (0.5 * d * d, -d, 0.5 * d * d),
          "k3": (math.exp(d) - d - 1, 1 - math.exp(d), math.exp(d) + abs(d) + 1),
        }[cfg.kl_estimator]
      if denom > 0:
        total += (-obj + kl_coef * kl - ent_coef * h) / norm / denom
        g_logp[r, t] = (-grad_obj + kl_coef * dkl) / norm / denom
        g_ent[r, t] = -ent_coef / norm / denom
        m["pg"] += -obj / norm / denom
        m["pg_mag"] += abs(obj) / norm / denom
        m["loss_mag"] += (abs(obj) + kl_coef * kl_mag + ent_coef * abs(h)) / norm / denom
      m["kl_mag"] += kl_mag
      m["tokens"] += 1
      m["clipped"] += clipped < unclipped
      m["dual"] += dual
      m["ratio"] += rho
      m["kl"] += kl
      m["ent"] += h
  return total, g_logp, g_ent, denom, m


# ---------------------------------------------------------------- data


def make_batch(seed, R=12, T=7, pad_rows=2):
  """Uneven groups (mixed, all-equal, size 1, empty), ragged lengths, padding rows, -inf pads."""
  rng = np.random.default_rng(seed)
  base = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3]
  gids = np.array((base * (R // len(base) + 1))[: R - pad_rows] + [-1] * pad_rows, np.int32)
  num_groups = 6  # groups 4 and 5 are empty
  rewards = rng.integers(0, 2, R).astype(np.float32)
  rewards[gids == 1] = 1.0  # an all-correct group: not informative
  rewards[np.flatnonzero(gids == 0)[:2]] = [0.0, 1.0]
  rewards[np.flatnonzero(gids == 3)[:2]] = [1.0, 0.0]
  valid = gids >= 0
  lens = np.where(valid, rng.integers(1, T + 1, R), 0)
  lens[[0, 6]] = [1, T]  # a one-token row (seq-mean divides by 1) and a full-length row
  mask = np.arange(T)[None, :] < lens[:, None]
  logp = -rng.exponential(1.0, (R, T))
  old = logp + rng.normal(0, 0.5, (R, T))
  ref = logp + rng.normal(0, 0.3, (R, T))
  ent = rng.uniform(0, 3, (R, T))
  for x in (logp, old, ref):
    x[~mask] = -np.inf
  ent[~mask] = np.nan
  adv = oracle_advantages(rewards, gids, num_groups, valid=valid)
  return dict(
    rewards=rewards,
    gids=gids,
    num_groups=num_groups,
    valid=valid,
    mask=mask,
    logp=logp,
    old=old,
    ref=ref,
    ent=ent,
    adv=adv,
    informative=oracle_informative(rewards, gids, valid),
  )


def _as_float32(x):
  """A batch entry as the library gets it (float arrays rounded to float32), in float64."""
  x = np.asarray(x)
  return x.astype(np.float32).astype(np.float64) if x.dtype.kind == "f" else x


def as_jnp(b):
  f = lambda k: jnp.asarray(b[k], jnp.float32)
  return dict(
    logp=f("logp"),
    old=f("old"),
    ref=f("ref"),
    ent=f("ent"),
    adv=f("adv"),
    mask=jnp.asarray(b["mask"]),
    informative=jnp.asarray(b["informative"]),
  )


def run_loss(j, hp, cfg, denom=None):
  if denom is None:
    denom = loss_denominator(j["mask"], j["informative"], cfg)

  def f(logp, ent):
    return grpo_loss(
      logp, j["old"], j["adv"], j["mask"], ent, j["ref"], j["informative"], denom, hp, cfg
    )

  grad_fn = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
  (loss, metrics), grads = grad_fn(j["logp"], j["ent"])
  return loss, metrics, grads, denom


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_advantages_match_oracle(scale_by_std):
  for seed in range(5):
    b = make_batch(seed, R=16)
    got = group_advantages(
      b["rewards"], b["gids"], b["num_groups"], scale_by_std, valid_R=b["valid"]
    )
    want = oracle_advantages(
      b["rewards"], b["gids"], b["num_groups"], scale_by_std, valid=b["valid"]
    )
    # Integer rewards: counts and sums are exact in any order; the one rounded sum is Σ(r − mean)²
    # over a group's ≤ 6 members. With the mean, the difference, the square, the variance's
    # division, sqrt, + eps and the final division, an advantage is within ~20u ≈ 1.2e-6 of its
    # magnitude (≤ 2), inside rtol 1e-6 + atol 1e-6 (and the same on every CPU: XLA's scatter-add
    # runs in index order).
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(got)[~b["valid"]] == 0)


def test_group_advantages_small_cases():
  # Sizes 3, 1, 2 (uneven, one singleton) with default all-valid mask. Worked values: a handful
  # of float32 operations each, within a few u (rtol 1e-6 ≈ 17u).
  adv = np.asarray(group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 1.5], [0, 0, 0, 1, 2, 2], 3))
  s3, s2 = math.sqrt(1 / 3) + 1e-6, math.sqrt(0.5) + 1e-6
  np.testing.assert_allclose(
    adv, [(2 / 3) / s3, -(1 / 3) / s3, -(1 / 3) / s3, 0.0, -0.5 / s2, 0.5 / s2], rtol=1e-6
  )
  # A constant non-representable reward (0.1) must give exactly 0, not a rounding residue / eps.
  assert np.all(np.asarray(group_advantages([0.1] * 7 + [0.9] * 3, [0] * 7 + [1] * 3, 2)) == 0)
  # Padding rows do not count: without them group 0 is {1, 0}.
  adv = np.asarray(group_advantages([1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0], 1, valid_R=[1, 1, 0, 0]))
  np.testing.assert_allclose(adv, [0.5 / s2, -0.5 / s2, 0, 0], rtol=1e-6)


def test_informative_rollouts_match_oracle():
  for seed in range(5):
    b = make_batch(seed, R=16)
    got = informative_rollouts(b["rewards"], b["gids"], b["num_groups"], b["valid"])
    np.testing.assert_array_equal(np.asarray(got), b["informative"])


_R, _NG = 16, 5
_adv_jit = jax.jit(group_advantages, static_argnames=("num_groups", "scale_by_std"))


def _adv_error(max_abs_reward):
  """A bound on |float32 advantage − exact| for integer rewards of magnitude ≤ ``max_abs_reward``
  and ranges ≤ 5, in groups of n ≤ 16 (so σ ≥ 1/4 when not constant, |A| ≤ (n − 1)/√n < 3.75).
  Counts and sums are integers, exact; the mean rounds by ≤ u·max|r|, and r − mean by ≤ 5u more:
  Δd ≤ (max|r| + 5)·u. Σd² then moves by ≤ 2·Δd·Σ|d| + (n + 1)·u·Σd², and Σ|d| ≤ √(n·Σd²) with
  Σd² ≥ (n − 1)/16 gives Σ|d|/Σd² < 6: relatively ≤ 12·Δd + 17u; σ (a division, sqrt, + eps) ≤
  half that + 3u. So |ΔA| ≤ Δd/σ + |A|·Δσ/σ + u·|A| ≤ 4·Δd + 3.75·(6·Δd + 12.5u)."""
  dd = (max_abs_reward + 5) * U
  return 4 * dd + 3.75 * (6 * dd + 12.5 * U)


@settings(max_examples=150, deadline=None)
@given(
  gids=st.lists(st.integers(0, _NG - 1), min_size=_R, max_size=_R),
  rewards=st.lists(st.integers(-2, 3), min_size=_R, max_size=_R),
  valid=st.lists(st.booleans(), min_size=_R, max_size=_R),
  shift=st.integers(-5, 5),
)
def test_group_advantages_properties(gids, rewards, valid, shift):
  r = np.array(rewards, np.float32)
  g, v = np.array(gids, np.int32), np.array(valid)
  adv = np.asarray(_adv_jit(r, g, num_groups=_NG, scale_by_std=True, valid_R=v))
  dr = np.asarray(_adv_jit(r, g, num_groups=_NG, scale_by_std=False, valid_R=v))
  err = _adv_error(3)  # 1.5e-5; Dr.GRPO's r − mean is within its Δd alone
  np.testing.assert_allclose(adv, oracle_advantages(r, g, _NG, True, valid=v), rtol=0, atol=err)
  np.testing.assert_allclose(dr, oracle_advantages(r, g, _NG, False, valid=v), rtol=0, atol=err)
  for k in range(_NG):
    sel = v & (g == k)
    if sel.sum() >= 2 and r[sel].max() > r[sel].min():
      # Exactly, the advantages have mean 0 and std σ/(σ + eps) ≥ 1 − 4e-6 (integer rewards:
      # σ ≥ 0.25); each is within err of exact, which moves the mean by ≤ err and the std(ddof=1)
      # by ≤ √(n/(n − 1))·err ≤ 1.04·err.
      assert abs(adv[sel].mean()) <= err and abs(dr[sel].mean()) <= err
      assert abs(adv[sel].std(ddof=1) - 1.0) <= 4e-6 + 1.04 * err
    else:
      assert np.all(adv[sel] == 0) and np.all(dr[sel] == 0)
  assert np.all(adv[~v] == 0)
  # Shifting every reward leaves the advantages unchanged: each side within its bound of exact.
  shifted = np.asarray(_adv_jit(r + shift, g, num_groups=_NG, scale_by_std=True, valid_R=v))
  np.testing.assert_allclose(shifted, adv, rtol=0, atol=err + _adv_error(3 + abs(shift)))


# ---------------------------------------------------------------- loss vs oracle

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("dual_clip", [0.0, 1.6])  # 0: off
@pytest.mark.parametrize("kl", [None, "k1", "k2", "k3"])
@pytest.mark.parametrize("ent_coef", [0.0, 0.01])
@pytest.mark.parametrize("informative_only", [False, True])
def test_grpo_loss_matches_oracle(aggregation, dual_clip, kl, ent_coef, informative_only):
  cfg = LossConfig(
    aggregation=aggregation,
    dual_clip=dual_clip,
    kl_estimator=kl or "k3",
    use_kl=kl is not None,
    informative_only=informative_only,
    max_response_len=T_MAX,
  )
  b = make_batch(7, R=20)
  hp = LossHparams.create(EPS_LOW, EPS_HIGH, KL_COEF, ent_coef)
  loss, metrics, (g_logp, g_ent), denom = run_loss(as_jnp(b), hp, cfg)
  # The oracle on the float32 inputs the library gets, so only float32 arithmetic is measured.
  b32 = {k: _as_float32(v) for k, v in b.items()}
  w_loss, w_glogp, w_gent, w_denom, wm = oracle_loss(b32, cfg, EPS_LOW, EPS_HIGH, KL_COEF, ent_coef)
  assert wm["clipped"] > 0 and (not dual_clip or wm["dual"] > 0)  # the cases are exercised
  assert float(denom) == w_denom
  n = wm["tokens"]  # every sum below runs over at most the n tokens
  np.testing.assert_allclose(float(loss), w_loss, rtol=0, atol=sum_tol(n, wm["loss_mag"]))
  # Per token, no sum: TERM_ULPS·u ≈ 6e-7 of each value (k3's 1 − e^d cancels, but is scaled by
  # β/(norm·denom) far below atol).
  np.testing.assert_allclose(np.asarray(g_logp), w_glogp, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(g_ent), w_gent, rtol=1e-5, atol=1e-7)
  fin = finalize_metrics(metrics)
  assert float(fin["token_count"]) == n
  # Counts of the same float32 decisions (the oracle's inputs are the library's): one division.
  np.testing.assert_allclose(float(fin["clip_frac"]), wm["clipped"] / n, rtol=1e-6)
  np.testing.assert_allclose(float(fin["dual_clip_frac"]), wm["dual"] / n, rtol=1e-6)
  # Sums of positive terms (ρ, entropies) are within sum_tol of themselves; the KL's terms
  # cancel (k3, k1's signs): the scale is kl_mag; the surrogate's signs cancel too: pg_mag.
  np.testing.assert_allclose(float(fin["ratio_mean"]), wm["ratio"] / n, rtol=sum_tol(n, 1.0))
  kl_tol = sum_tol(n, wm["kl_mag"] / n)
  np.testing.assert_allclose(float(fin["kl"]), wm["kl"] / n, rtol=0, atol=kl_tol)
  np.testing.assert_allclose(float(fin["entropy"]), wm["ent"] / n, rtol=sum_tol(n, 1.0))
  np.testing.assert_allclose(float(fin["pg_loss"]), wm["pg"], rtol=0, atol=sum_tol(n, wm["pg_mag"]))
  # The loss is these three float32 values added in the program's order, which the eager sum
  # here repeats: the same additions of the same values, bit for bit.
  assert float(fin["pg_loss"] + fin["kl_loss"] + fin["entropy_loss"]) == float(loss)


@pytest.mark.parametrize("aggregation", AGGS)
def test_micro_batches_equal_one_batch(aggregation):
  cfg = LossConfig(
    aggregation=aggregation,
    dual_clip=2.0,
    kl_estimator="k3",
    use_kl=True,
    informative_only=True,
    max_response_len=T_MAX,
  )
  hp = LossHparams.create(EPS_LOW, EPS_HIGH, KL_COEF, 0.01)
  b = make_batch(3, R=16)
  j = as_jnp(b)
  loss, metrics, (g_logp, g_ent), denom = run_loss(j, hp, cfg)
  # Σ|term| of each sum, from the oracle on the same float32 inputs.
  b32 = {k: _as_float32(v) for k, v in b.items()}
  *_, wm = oracle_loss(b32, cfg, EPS_LOW, EPS_HIGH, KL_COEF, 0.01)
  n = wm["tokens"]
  acc_loss, acc_metrics = 0.0, LossMetrics.zeros()
  acc_glogp, acc_gent = [], []
  for i in range(4):
    part = {k: v[4 * i : 4 * i + 4] for k, v in j.items()}
    l, m, (gl, ge), _ = run_loss(part, hp, cfg, denom=denom)  # the global denominator
    acc_loss, acc_metrics = acc_loss + l, acc_metrics + m
    acc_glogp.append(gl)
    acc_gent.append(ge)
  # The same terms summed in 4 parts and then across them: each side within sum_tol (n + 3
  # terms for the accumulation) of exact, the two within twice it.
  assert abs(float(acc_loss) - float(loss)) <= 2 * sum_tol(n + 3, wm["loss_mag"])
  # Per-token gradients are elementwise (no sum crosses rows): the same operations on the same
  # values, hence equal bit for bit; the atol only states that.
  np.testing.assert_allclose(np.concatenate(acc_glogp), np.asarray(g_logp), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.concatenate(acc_gent), np.asarray(g_ent), rtol=0, atol=1e-6)
  # Metrics: sums over the tokens (finalize_metrics divides by the exact count), their scale the
  # oracle's: Σ|term| per sum, or the count itself for the counts and positive sums (ρ, H ≤ 3).
  scale = {
    "pg_loss": wm["pg_mag"],
    "kl_loss": KL_COEF * wm["kl_mag"] / float(denom),
    "entropy_loss": 0.01 * 3 * n / float(denom),
    "kl": wm["kl_mag"] / n,
    "ratio_mean": wm["ratio"] / n,
    "entropy": 3.0,
  }
  for k, v in finalize_metrics(metrics).items():
    atol = 2 * sum_tol(n + 3, scale.get(k, 1.0))
    np.testing.assert_allclose(
      float(finalize_metrics(acc_metrics)[k]), float(v), rtol=0, atol=atol, err_msg=k
    )


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("informative_only", [False, True])
def test_empty_batch_gives_zero_not_nan(aggregation, informative_only):
  cfg = LossConfig(
    aggregation=aggregation, use_kl=True, informative_only=informative_only, max_response_len=T_MAX
  )
  hp = LossHparams.create(EPS_LOW, EPS_HIGH, KL_COEF, 0.01)
  j = as_jnp(make_batch(1))
  if informative_only:  # tokens exist, but no group is informative
    j["informative"] = jnp.zeros_like(j["informative"])
  else:
    j["mask"] = jnp.zeros_like(j["mask"])
  loss, metrics, (g_logp, g_ent), denom = run_loss(j, hp, cfg)
  assert float(denom) == 0 and float(loss) == 0
  assert np.all(np.asarray(g_logp) == 0) and np.all(np.asarray(g_ent) == 0)
  assert all(np.isfinite(float(v)) for v in finalize_metrics(metrics).values())


def test_hparams_are_traced_compile_once():
  traces = []

  def counted(*args, cfg):
    traces.append(1)
    return grpo_loss(*args, cfg=cfg)

  jitted = jax.jit(counted, static_argnames=("cfg",))
  cfg = LossConfig(use_kl=True, informative_only=False)
  j = as_jnp(make_batch(2))
  denom = loss_denominator(j["mask"], j["informative"], cfg)
  losses = []
  grid = itertools.product([0.1, 0.2], [0.2, 0.28, 0.4], [0.0, 0.1], [0.0, 0.01])
  for eps_low, eps_high, beta, lam in grid:
    hp = LossHparams.create(eps_low, eps_high, beta, lam)
    loss, _ = jitted(
      j["logp"],
      j["old"],
      j["adv"],
      j["mask"],
      j["ent"],
      j["ref"],
      j["informative"],
      denom,
      hp,
      cfg=cfg,
    )
    losses.append(float(loss))
  assert len(traces) == 1  # one trace for all 24 hyperparameter sets: no retrace, no recompile
  assert len(set(losses)) == len(losses)  # every hyperparameter actually reached the loss


def test_config_validation():
  for bad in [
    dict(aggregation="mean"),
    dict(kl_estimator="k4"),
    dict(dual_clip=1.0),
    dict(aggregation="seq-mean-token-sum-norm"),
  ]:
    with pytest.raises(ValueError):
      LossConfig(**bad)
  hash(LossConfig(dual_clip=3.0))  # usable as a static jit argument
