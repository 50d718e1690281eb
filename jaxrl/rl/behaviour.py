"""The correction for rollouts sampled by another policy μ (docs/algorithms.md §9): the corrected
behaviour weights w̃ from w = exp(ℓ_prox − ℓ_μ) (``behaviour_weights``, which multiply the
surrogate per token) and the per-step metrics of the mismatch (``mismatch_kl``,
``behaviour_metrics``).

Pure functions of arrays, stop-gradient; ``mask`` is the loss mask, the tokens μ sampled
(docs/algorithms.md §11).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def _log_ratio(logp_prox, logp_behaviour, mask):
  """(ℓ_prox − ℓ_μ, valid) per token, f32, stop-gradient, 0 where masked (padding may hold -inf)."""
  on_RxT = jnp.asarray(mask) > 0
  prox_RxT = jnp.where(on_RxT, _f32(logp_prox), 0.0)
  behaviour_RxT = jnp.where(on_RxT, _f32(logp_behaviour), 0.0)
  return jax.lax.stop_gradient(prox_RxT - behaviour_RxT), on_RxT


def _kept_RxT(d_RxT, on_RxT, mode, cap, m_low, m_high):
  """Where the chosen correction keeps w as it is (True) or truncates / masks it (False)."""
  w_RxT = jnp.exp(d_RxT)
  if mode == "tis":
    return w_RxT <= cap
  if mode == "mis":
    return (w_RxT >= m_low) & (w_RxT <= m_high)
  if mode == "seq-mis":
    s_R = jnp.exp(jnp.sum(d_RxT, axis=1) / jnp.maximum(jnp.sum(on_RxT, axis=1), 1))
    return jnp.broadcast_to(((s_R >= m_low) & (s_R <= m_high))[:, None], d_RxT.shape)
  if mode == "none":
    return jnp.ones_like(on_RxT)
  raise ValueError(f"behaviour correction {mode!r}: not a correction (config.Correction)")


def behaviour_weights(
  logp_prox, logp_behaviour, mask, mode, cap=2.0, m_low=0.5, m_high=2.0
) -> jax.Array:
  """§9's corrected behaviour weights w̃ f32[R,T] from w = exp(ℓ_prox − ℓ_μ), stop-gradient.

  ``mode`` (static): ``none`` → 1; ``tis`` → min(w, cap); ``mis`` → w inside [m_low, m_high], else
  0; ``seq-mis`` → 1 for every token of a response whose s = exp(mean_t(ℓ_prox − ℓ_μ)) is inside
  [m_low, m_high], else 0. Positions off ``mask`` (padding, an environment's tokens, whose ℓ_μ
  does not exist: docs/algorithms.md §11) get 0 and take no part in s. Thresholds may be traced
  scalars."""
  d_RxT, on_RxT = _log_ratio(logp_prox, logp_behaviour, mask)
  kept_RxT = _kept_RxT(d_RxT, on_RxT, mode, cap, m_low, m_high)
  if mode == "tis":
    w_RxT = jnp.minimum(jnp.exp(d_RxT), _f32(cap))
  elif mode == "mis":
    w_RxT = jnp.where(kept_RxT, jnp.exp(d_RxT), 0.0)
  else:  # none, seq-mis: the whole response counts once, or not at all
    w_RxT = kept_RxT.astype(jnp.float32)
  return jnp.where(on_RxT, w_RxT, 0.0)


def _token_mean(x_RxT, on_RxT):
  return jnp.sum(jnp.where(on_RxT, x_RxT, 0.0)) / jnp.maximum(jnp.sum(on_RxT), 1)


def mismatch_kl(logp_prox, logp_behaviour, mask) -> jax.Array:
  """k3 estimate of KL(μ ‖ π_prox) from tokens sampled by μ: token mean of (w − 1) − log w over
  ``mask`` (the loss mask: the tokens μ sampled, docs/algorithms.md §11)."""
  d_RxT, on_RxT = _log_ratio(logp_prox, logp_behaviour, mask)
  return _token_mean(jnp.expm1(d_RxT) - d_RxT, on_RxT)


def behaviour_metrics(
  logp_prox, logp_behaviour, mask, mode, cap=2.0, m_low=0.5, m_high=2.0
) -> dict:
  """§9's per-step metrics over the valid tokens: the mismatch and what the correction did."""
  d_RxT, on_RxT = _log_ratio(logp_prox, logp_behaviour, mask)
  any_on = jnp.any(on_RxT)
  dropped_RxT = ~_kept_RxT(d_RxT, on_RxT, mode, cap, m_low, m_high)
  return {
    "mismatch_kl": mismatch_kl(logp_prox, logp_behaviour, mask),
    "behaviour_logp_diff_mean": _token_mean(jnp.abs(d_RxT), on_RxT),
    "behaviour_logp_diff_max": jnp.where(any_on, jnp.max(jnp.abs(d_RxT)), 0.0),
    "behaviour_weight_mean": jnp.where(any_on, _token_mean(jnp.exp(d_RxT), on_RxT), 1.0),
    "behaviour_weight_dropped_frac": _token_mean(dropped_RxT.astype(jnp.float32), on_RxT),
  }
