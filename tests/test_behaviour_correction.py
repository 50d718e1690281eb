"""Behaviour log-probs and their correction (docs/algorithms.md §9) through the public names: the worked
example, properties of the weights, the identity when μ = π_prox, traced thresholds, the config."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import tiny_config

from jaxrl import losses
from jaxrl.config import ConfigError, loss_config

DIFF = np.array([[0.0, 0.5, -1.0, 1.2]], np.float32)  # ℓ_prox − ℓ_μ of the worked example
BEHAVIOUR = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
PROX = BEHAVIOUR + DIFF
MASK = np.ones((1, 4), bool)


def _w(mode, prox=PROX, behaviour=BEHAVIOUR, mask=MASK):
  return np.asarray(losses.behaviour_weights(prox, behaviour, mask, mode))


def test_worked_example_weights():
  # The worked values are printed to 4 decimals (their rounding ≤ 5e-5): atol 1e-4 holds with a
  # float32 exp (an ulp) on any CPU. Exact ones (0, 1, 2) come out exact.
  np.testing.assert_allclose(np.exp(DIFF), [[1, 1.6487, 0.3679, 3.3201]], atol=1e-4)
  np.testing.assert_allclose(_w("none"), [[1, 1, 1, 1]])
  np.testing.assert_allclose(_w("tis"), [[1, 1.6487, 0.3679, 2]], atol=1e-4)
  np.testing.assert_allclose(_w("mis"), [[1, 1.6487, 0, 0]], atol=1e-4)
  np.testing.assert_allclose(_w("seq-mis"), [[1, 1, 1, 1]])  # s = exp(0.175) = 1.19125
  # A response with differences [0.9, 1.1]: s = e > 2, both tokens dropped.
  prox2 = np.array([[-1.0 + 0.9, -2.0 + 1.1]], np.float32)
  w2 = _w("seq-mis", prox2, np.array([[-1.0, -2.0]], np.float32), np.ones((1, 2), bool))
  np.testing.assert_array_equal(w2, [[0, 0]])


def test_worked_example_mismatch_and_metrics():
  # Means over 4 tokens of a few float32 operations each: within ~10u of values ≤ 3.3, i.e. 2e-6,
  # and 0.40918 is printed to 5 decimals (≤ 5e-6): atol 1e-5. The differences ℓ_prox − ℓ_μ
  # (PROX − BEHAVIOUR, rounded twice: ≤ 2 ulps of 3) are within 1e-6 of the decimals.
  np.testing.assert_allclose(float(losses.mismatch_kl(PROX, BEHAVIOUR, MASK)), 0.40918, atol=1e-5)
  m = {k: float(v) for k, v in losses.behaviour_metrics(PROX, BEHAVIOUR, MASK, "tis").items()}
  assert m["mismatch_kl"] == pytest.approx(0.40918, abs=1e-5)
  assert m["behaviour_logp_diff_max"] == pytest.approx(1.2, abs=1e-6)
  assert m["behaviour_logp_diff_mean"] == pytest.approx(0.675, abs=1e-6)
  assert m["behaviour_weight_mean"] == pytest.approx(np.exp(DIFF).mean(), abs=1e-5)
  assert m["behaviour_weight_dropped_frac"] == 0.25  # 3.32 > 2
  dropped = lambda mode: float(  # noqa: E731
    losses.behaviour_metrics(PROX, BEHAVIOUR, MASK, mode)["behaviour_weight_dropped_frac"]
  )
  assert dropped("mis") == 0.5 and dropped("seq-mis") == 0.0 and dropped("none") == 0.0


def _random(seed, r=6, t=9):
  rng = np.random.default_rng(seed)
  mask = np.arange(t)[None, :] < rng.integers(0, t + 1, (r, 1))  # row lengths 0..t
  behaviour = np.where(mask, -rng.random((r, t)) * 4, -np.inf).astype(np.float32)
  prox = np.where(mask, behaviour + rng.normal(0, 0.8, (r, t)), np.nan).astype(np.float32)
  return prox, behaviour, mask


@pytest.mark.parametrize("seed", range(5))
def test_weight_properties(seed):
  prox, behaviour, mask = _random(seed)
  cap, lo, hi = 1.7, 0.6, 1.9
  w = {
    m: np.asarray(losses.behaviour_weights(prox, behaviour, mask, m, cap, lo, hi))
    for m in ("none", "tis", "mis", "seq-mis")
  }
  for x in w.values():
    assert np.all(np.isfinite(x)) and np.all(x[~mask] == 0)  # padding holds -inf / NaN
  assert np.all(w["none"][mask] == 1)
  assert np.all(w["tis"][mask] <= np.float32(cap)) and np.all(w["tis"][mask] > 0)
  kept = w["mis"][mask]
  assert np.all((kept == 0) | ((kept >= lo) & (kept <= hi)))
  for row, on in zip(w["seq-mis"], mask):
    assert len(set(row[on].tolist())) <= 1 and set(row[on].tolist()) <= {0.0, 1.0}
  # No gradient flows into either log-prob through the weights.
  for mode in ("tis", "mis", "seq-mis"):
    grads = jax.grad(
      lambda a, b, mode=mode: jnp.sum(losses.behaviour_weights(a, b, mask, mode, cap, lo, hi)),
      argnums=(0, 1),
    )(jnp.where(mask, prox, 0.0), jnp.where(mask, behaviour, 0.0))
    assert all(np.all(np.asarray(g) == 0) for g in grads)


def _loss_inputs(seed):
  rng = np.random.default_rng(seed)
  r, t = 6, 7
  mask = np.arange(t)[None, :] < rng.integers(1, t + 1, (r, 1))
  logp = jnp.asarray(-rng.random((r, t)) * 3, jnp.float32)
  old = jnp.asarray(logp + rng.normal(0, 0.3, (r, t)), jnp.float32)  # ρ ≠ 1: the clip binds
  adv = jnp.asarray(rng.normal(size=r), jnp.float32)
  return logp, old, adv, mask


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-mis"])
def test_corrections_are_the_identity_when_behaviour_equals_prox(mode):
  logp, old, adv, mask = _loss_inputs(3)
  hp, cfg = losses.LossHparams.create(), losses.LossConfig(informative_only=False)
  denom = jnp.sum(mask.astype(jnp.float32))

  def loss(lp, w=None):
    return losses.grpo_loss(
      lp, old, adv, mask, None, None, None, denom, hp, cfg, behaviour_w_RxT=w
    )[0]

  w = losses.behaviour_weights(old, old, mask, mode)  # ℓ_μ = ℓ_prox
  plain, g_plain = jax.value_and_grad(loss)(logp)
  corrected, g_corrected = jax.value_and_grad(loss)(logp, w)
  # Bit for bit, on any CPU: ℓ_prox − ℓ_μ = 0 exactly, so every weight is exp(0) = 1 (0 off the
  # mask), the surrogate times 1 is itself and its gradient times 1 too; the rest runs the same
  # eager operations on the same values.
  assert np.all(np.asarray(w)[mask] == 1)
  np.testing.assert_array_equal(np.asarray(corrected), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(g_corrected), np.asarray(g_plain))


def test_weights_scale_the_surrogate_only():
  logp, old, adv, mask = _loss_inputs(4)
  hp = losses.LossHparams.create(kl_coef=0.1, entropy_coef=0.01)
  cfg = losses.LossConfig(use_kl=True, informative_only=False)
  denom = jnp.sum(mask.astype(jnp.float32))
  ent, ref = jnp.ones_like(logp), logp - 0.2
  zero = jnp.zeros_like(logp)
  full, m_full = losses.grpo_loss(logp, old, adv, mask, ent, ref, None, denom, hp, cfg)
  none, m_none = losses.grpo_loss(
    logp, old, adv, mask, ent, ref, None, denom, hp, cfg, behaviour_w_RxT=zero
  )
  assert float(m_none.pg_loss) == 0.0 and float(m_none.kl_loss) == float(m_full.kl_loss)
  assert float(m_none.entropy_loss) == float(m_full.entropy_loss)
  assert float(m_none.token_count) == float(m_full.token_count)  # the denominator is unchanged
  assert float(full) != float(none)


def test_thresholds_are_traced(tmp_path):
  prox, behaviour, mask = _random(7)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def weights(hp):
    return losses.behaviour_weights(
      prox, behaviour, mask, "mis", hp.tis_cap, hp.mis_low, hp.mis_high
    )

  a = weights(losses.LossHparams.create(mis_low=0.5, mis_high=2.0))
  b = weights(losses.LossHparams.create(mis_low=0.9, mis_high=1.1))
  assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_rl_update_with_tis(tmp_path):
  """One real update: tis with ℓ_μ = ℓ_prox equals none bit for bit; with ℓ_μ ≠ ℓ_prox it
  differs, and changing the cap recompiles nothing."""
  import optax
  from run_helpers import SMALL_MODEL, random_batch, update_hparams
  from run_helpers import rollouts as make_rollouts

  from jaxrl.nn import model
  from jaxrl.rl import step

  graphdef, params = model.create(SMALL_MODEL, 0)
  tx = optax.adam(1e-2)
  batch = random_batch(np.random.default_rng(0))

  def update(mode, b, hp):
    cfg = losses.LossConfig(behaviour_correction=mode, informative_only=False, num_groups=2)
    state = step.init_state(jax.tree.map(jnp.copy, params), tx)
    new, out = jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))(state, b, hp)
    return [np.asarray(x) for x in jax.tree.leaves(new.params)], out

  none, out_none = update("none", batch, update_hparams())
  tis, _ = update("tis", batch, update_hparams())
  # No tolerance could be derived through Adam's first step (a last-bit difference in a
  # near-zero gradient moves a weight by up to 2·lr), and none is needed: with ℓ_μ = ℓ_prox every
  # weight is exp(0) = 1, so the tis program's extra products (by exactly 1, in the surrogate and
  # in its gradient) change no bit, and the rest is the none program's arithmetic on the same
  # shapes, hence the same kernels on any CPU.
  for a, b in zip(none, tis):
    np.testing.assert_array_equal(a, b)
  assert float(out_none["mismatch_kl"]) == 0.0

  rng = np.random.default_rng(1)
  shifted = make_rollouts(
    batch.prompt_ids_RxP,
    batch.prompt_mask_RxP,
    batch.tokens_RxN,
    batch.mask_RxN,
    behaviour_logp_RxN=batch.behaviour_logp_RxN - rng.random(batch.mask_RxN.shape) * 1.5,
    rewards_R=batch.rewards_R,
    group_ids_R=batch.group_ids_R,
    prox_logp_RxN=batch.prox_logp_RxN,
  )
  off_none, out = update("none", shifted, update_hparams())
  off_tis, out_tis = update("tis", shifted, update_hparams())
  assert float(out["mismatch_kl"]) > 0.05 and float(out_tis["behaviour_weight_dropped_frac"]) > 0
  assert max(np.abs(a - b).max() for a, b in zip(off_none, off_tis)) > 1e-4


def test_config_resolves_auto_and_checks_thresholds():
  def resolved(**fields):
    return loss_config(tiny_config("test", **fields)).behaviour_correction

  assert resolved() == "none"
  assert resolved(**{"rollout.engine": "vllm"}) == "tis"
  assert resolved(**{"rollout.top_p": 0.9}) == "tis"  # drawn from the truncated distribution
  assert resolved(**{"rollout.top_p": 0.9, "loss.behaviour_correction": "none"}) == "none"
  assert resolved(**{"loss.behaviour_correction": "mis"}) == "mis"
  with pytest.raises(ConfigError, match="loss.mis_low"):
    tiny_config("test", **{"loss.mis_low": 1.5})
  with pytest.raises(ConfigError, match="behaviour_correction"):
    tiny_config("test", **{"loss.behaviour_correction": "is"})
