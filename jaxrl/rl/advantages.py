"""Advantages, the per-row and per-token weights the surrogate gives each token: GRPO's group
advantages and informative flags (docs/algorithms.md §1.1), and DynaMO's token-level modulation of
them (§4.3), whose output feeds ``grpo_loss(..., adv_RxT=...)``.

Pure functions of arrays; every ``mask`` is the loss mask (docs/algorithms.md §11): an
environment's tokens enter no statistic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def _valid_or_all(valid_R, n):
  return jnp.ones((n,), bool) if valid_R is None else jnp.asarray(valid_R, bool)


def _group_extremes(rewards_R, group_ids_R, num_groups, valid_R):
  """Per-group max and min over valid rows (empty group: -inf, +inf)."""
  r_max = jnp.where(valid_R, rewards_R, -jnp.inf)
  r_min = jnp.where(valid_R, rewards_R, jnp.inf)
  max_G = jax.ops.segment_max(r_max, group_ids_R, num_segments=num_groups)
  min_G = jax.ops.segment_min(r_min, group_ids_R, num_segments=num_groups)
  return max_G, min_G


def _gather(values_G, group_ids_R, valid_R):
  # Padding rows may carry any id (even -1); clamp them to a real group, their value is masked.
  return values_G[jnp.where(valid_R, group_ids_R, 0)]


def informative_rollouts(rewards_R, group_ids_R, num_groups, valid_R=None):
  """True where the rollout is valid and its group's valid rewards are not all equal."""
  rewards_R = jnp.asarray(rewards_R, jnp.float32)
  group_ids_R = jnp.asarray(group_ids_R, jnp.int32)
  valid_R = _valid_or_all(valid_R, rewards_R.shape[0])
  max_G, min_G = _group_extremes(rewards_R, group_ids_R, num_groups, valid_R)
  return valid_R & _gather(max_G > min_G, group_ids_R, valid_R)


def group_advantages(rewards_R, group_ids_R, num_groups, scale_by_std=True, eps=1e-6, valid_R=None):
  """GRPO advantages (r − mean_g)/(std_g + eps), or Dr.GRPO's r − mean_g, by segment sums."""
  rewards_R = jnp.asarray(rewards_R, jnp.float32)
  group_ids_R = jnp.asarray(group_ids_R, jnp.int32)
  valid_R = _valid_or_all(valid_R, rewards_R.shape[0])
  w_R = valid_R.astype(jnp.float32)
  count_G = jax.ops.segment_sum(w_R, group_ids_R, num_segments=num_groups)
  sum_G = jax.ops.segment_sum(rewards_R * w_R, group_ids_R, num_segments=num_groups)
  mean_G = sum_G / jnp.maximum(count_G, 1.0)
  dev_R = (rewards_R - _gather(mean_G, group_ids_R, valid_R)) * w_R
  if scale_by_std:
    # Two-pass (centred) variance: no cancellation for large reward offsets.
    sq_G = jax.ops.segment_sum(dev_R * dev_R, group_ids_R, num_segments=num_groups)
    std_G = jnp.sqrt(sq_G / jnp.maximum(count_G - 1.0, 1.0))
    dev_R = dev_R / (_gather(std_G, group_ids_R, valid_R) + eps)
  # Constant groups (incl. size 1) have advantage exactly 0 in exact arithmetic; rounding in the
  # mean would otherwise leave ~1e-8/eps residues, so zero them explicitly.
  keep_R = informative_rollouts(rewards_R, group_ids_R, num_groups, valid_R)
  return jnp.where(keep_R, dev_R, 0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamoStats:
  """The statistics DynaMO's modulation normalises by (docs/algorithms.md §4.3): max Ξ and the
  entropy range over the valid tokens of a mini-batch. Over no valid token: max Ξ 0, H_min +inf,
  H_max −inf, the identities of ``reduce``, so an empty chunk leaves its mini-batch's values as
  they are."""

  xi_max: jax.Array  # f32[], ≥ 0
  h_min: jax.Array  # f32[]
  h_max: jax.Array  # f32[]

  @staticmethod
  def reduce(stats_M: DynamoStats) -> DynamoStats:
    """One chunk's statistics from per-chunk ones stacked on a leading axis M: those of the
    chunks' union (max, min, max are exact in floating point: no rounding, no order)."""
    return DynamoStats(
      xi_max=jnp.max(stats_M.xi_max, axis=0),
      h_min=jnp.min(stats_M.h_min, axis=0),
      h_max=jnp.max(stats_M.h_max, axis=0),
    )


def _dynamo_terms(adv, logp, old_logp, entropy, mask, eps_low, eps_high):
  """Per-token (A, m, valid, H, Ξ) of Eq. 8–11, f32[R,T], 0 on masked tokens."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  mask_RxT = f32(mask)
  on_RxT = mask_RxT > 0
  # Padded positions may hold −inf log-probs or garbage entropies: zero them before any arithmetic.
  logp_RxT = jnp.where(on_RxT, f32(logp), 0.0)
  old_RxT = jnp.where(on_RxT, f32(old_logp), 0.0)
  ent_RxT = jnp.where(on_RxT, f32(entropy), 0.0)
  adv_RxT = jnp.broadcast_to(f32(adv)[:, None], mask_RxT.shape)

  # Ξ estimates |ΔH| of Eq. 10–11 from the sampled token only.
  ratio_RxT = jnp.exp(logp_RxT - old_RxT)
  unclipped_RxT = ((adv_RxT > 0) & (ratio_RxT <= 1.0 + eps_high)) | (
    (adv_RxT < 0) & (ratio_RxT >= 1.0 - eps_low)
  )
  xi_RxT = jnp.where(unclipped_RxT, ratio_RxT * adv_RxT, 0.0)
  t1_RxT = jnp.exp(logp_RxT) * (logp_RxT + ent_RxT)
  len_Rx1 = jnp.maximum(jnp.sum(mask_RxT, axis=1, keepdims=True), 1.0)
  mean_t1_Rx1 = jnp.sum(t1_RxT * mask_RxT, axis=1, keepdims=True) / len_Rx1
  big_xi_RxT = jnp.abs(xi_RxT * (t1_RxT - mean_t1_Rx1)) * mask_RxT
  return adv_RxT, mask_RxT, on_RxT, ent_RxT, big_xi_RxT


def _stats_of(on_RxT, ent_RxT, big_xi_RxT) -> DynamoStats:
  return DynamoStats(
    xi_max=jnp.max(big_xi_RxT),
    h_min=jnp.min(jnp.where(on_RxT, ent_RxT, jnp.inf)),
    h_max=jnp.max(jnp.where(on_RxT, ent_RxT, -jnp.inf)),
  )


def dynamo_statistics(adv, logp, old_logp, entropy, mask, eps_low, eps_high) -> DynamoStats:
  """max Ξ, H_min and H_max over the valid tokens of the arrays given (arguments as
  ``dynamo_modulate``'s), no gradient. Per chunk of a mini-batch, then ``DynamoStats.reduce``:
  the mini-batch's statistics whatever the split (docs/algorithms.md §4.3)."""
  _, _, on_RxT, ent_RxT, big_xi_RxT = _dynamo_terms(
    adv, logp, old_logp, entropy, mask, eps_low, eps_high
  )
  return jax.lax.stop_gradient(_stats_of(on_RxT, ent_RxT, big_xi_RxT))


def dynamo_modulate(
  adv, logp, old_logp, entropy, mask, eps_low, eps_high, alpha=0.4, gamma=50.0, tau=0.9, stats=None
):
  """DynaMO per-token advantage A·f·g (Eq. 8–14), f32[R,T], no gradient, 0 on masked tokens.

  `adv` is the sequence advantage f[R]; `logp`, `old_logp`, `entropy` and `mask` are [R,T] (entropy
  of the full softmax at τ). The normaliser max Ξ and the entropy range H_min/H_max are those of
  the mini-batch (docs/algorithms.md §4.3): ``stats`` (``dynamo_statistics`` over the whole
  mini-batch) when the arrays are one micro-batch of it, else (None) over the valid tokens of the
  arrays given. Valid is ``mask``, the loss mask: an environment's tokens enter neither max Ξ,
  H_min, H_max nor a row's mean E_i (docs/algorithms.md §11). Every hyperparameter may be a traced
  scalar.
  """
  adv_RxT, mask_RxT, on_RxT, ent_RxT, big_xi_RxT = _dynamo_terms(
    adv, logp, old_logp, entropy, mask, eps_low, eps_high
  )
  if stats is None:
    stats = _stats_of(on_RxT, ent_RxT, big_xi_RxT)
  alpha = jnp.asarray(alpha, jnp.float32)

  # Stabilisation f.
  x_RxT = big_xi_RxT / (stats.xi_max + 1e-8)
  lam_min = 1.0 - alpha
  f_RxT = lam_min + (1.0 - lam_min) * jax.nn.sigmoid(-gamma * (x_RxT - tau))

  # Compensation g for A > 0; a mini-batch with no valid token has no entropy range (H_min +inf,
  # H_max −inf): use 0 for both there, so every factor stays finite (and is masked to 0).
  has_range = stats.h_min <= stats.h_max
  h_max = jnp.where(has_range, stats.h_max, 0.0)
  h_min = jnp.where(has_range, stats.h_min, 0.0)
  g_pos_RxT = 1.0 + alpha * (h_max - ent_RxT) / (h_max - h_min + 1e-8)
  g_RxT = jnp.where(adv_RxT > 0, g_pos_RxT, 1.0)
  return jax.lax.stop_gradient(adv_RxT * f_RxT * g_RxT) * mask_RxT
