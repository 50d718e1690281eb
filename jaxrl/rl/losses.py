"""GRPO objective: group advantages, clipped surrogate, KL and entropy (docs/algorithms.md §1).

Everything here is a pure function of arrays plus the static `LossConfig` (`jaxrl.config`); the
hyperparameters that schedules change every step (ε_low, ε_high, β, λ, τ, DynaMO's α, γ, τ_s, the
behaviour-weight thresholds) arrive as the traced `LossHparams` pytree, so a new value never
recompiles (docs/algorithms.md §1.5). The loss is written as numerator / denominator with the
denominator computed once over the whole step's batch (`loss_denominator`): summing `grpo_loss` over
micro-batches that share that denominator gives exactly the loss and gradient of one big batch.
Metrics are returned as additive sums and counts for the same reason; `finalize_metrics` turns
them into means once all micro-batches are summed.

The method extras sit at the end: DynaMO's token-level advantage modulation (§4), whose output
feeds `grpo_loss(..., adv_RxT=...)`, and EEPO's unlearning loss (§5) for the rollout copy θ'.

Every ``mask`` here is the **loss mask** (docs/algorithms.md §11): the model's own sampled tokens.
In a multi-turn response an environment's tokens are off it: no term, weight, statistic or token
count reads their values, so they carry exactly no gradient. Single-turn, it is the response mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl.config import LossConfig, LossSection, ModulationSection, RolloutSection
from jaxrl.nn.logprobs import logp_log1m_p_from_logits


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


def _f32_field(value):
  """A field defaulting to ``value`` as an f32 array (a Python float would be weak-typed: a second
  trace once an array arrives)."""
  return dataclasses.field(default_factory=functools.partial(jnp.float32, value))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossHparams:
  """The update's traced f32 scalars: a schedule or a controller may change any of them every
  step, and nothing recompiles (docs/algorithms.md §1.5). Defaults: the config sections' own."""

  eps_low: jax.Array = _f32_field(LossSection.eps_low)
  eps_high: jax.Array = _f32_field(LossSection.eps_high)
  kl_coef: jax.Array = _f32_field(LossSection.kl_coef)  # β
  entropy_coef: jax.Array = _f32_field(LossSection.entropy_coef)  # λ
  tis_cap: jax.Array = _f32_field(LossSection.tis_cap)  # §9's behaviour-weight thresholds
  mis_low: jax.Array = _f32_field(LossSection.mis_low)
  mis_high: jax.Array = _f32_field(LossSection.mis_high)
  # τ: divides the logits in every scoring pass (the rescoring, the reference and the update)
  tau: jax.Array = _f32_field(RolloutSection.temperature)
  modulation_alpha: jax.Array = _f32_field(ModulationSection.alpha)  # DynaMO's α, γ, τ_s (§4.3)
  modulation_gamma: jax.Array = _f32_field(ModulationSection.gamma)
  modulation_tau: jax.Array = _f32_field(ModulationSection.tau)

  @classmethod
  def create(cls, *values, **named) -> LossHparams:
    """From numbers, in field order (ε_low, ε_high, β, λ, …) or by name; each an f32 array, the
    rest at their defaults."""
    names = [f.name for f in dataclasses.fields(cls)]
    given = {**dict(zip(names, values)), **named}
    return cls(**{k: jnp.asarray(v, jnp.float32) for k, v in given.items()})

  @classmethod
  def from_config(cls, loss: LossSection, mod: ModulationSection, tau, eps_high) -> LossHparams:
    """A step's values: the loss and modulation sections', with the temperature τ and ε_high the
    controllers chose."""
    return cls.create(
      eps_low=loss.eps_low,
      eps_high=eps_high,
      kl_coef=loss.kl_coef,
      entropy_coef=loss.entropy_coef,
      tis_cap=loss.tis_cap,
      mis_low=loss.mis_low,
      mis_high=loss.mis_high,
      tau=tau,
      modulation_alpha=mod.alpha,
      modulation_gamma=mod.gamma,
      modulation_tau=mod.tau,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossMetrics:
  """Sums and counts, additive across micro-batches (`a + b`); see `finalize_metrics`."""

  pg_loss: jax.Array  # −(aggregated objective)/denom: already a share of the global loss
  kl_loss: jax.Array  # β·(aggregated KL)/denom
  entropy_loss: jax.Array  # −λ·(aggregated entropy)/denom
  token_count: jax.Array  # tokens that enter the loss
  clipped_count: jax.Array  # tokens where the clipped branch is the active min
  dual_clipped_count: jax.Array  # tokens where the dual clip c·A binds
  ratio_sum: jax.Array
  kl_sum: jax.Array
  entropy_sum: jax.Array

  def __add__(self, other):
    return jax.tree.map(jnp.add, self, other)

  @classmethod
  def zeros(cls):
    """All-zero metrics, the identity for accumulation."""
    return cls(*(jnp.zeros((), jnp.float32) for _ in dataclasses.fields(cls)))


def finalize_metrics(metrics):
  """Turn summed metrics into means: clip_frac, kl, entropy, ratio_mean, pg_loss, …."""
  n = metrics.token_count
  per_token = lambda s: jnp.where(n > 0, s / jnp.maximum(n, 1.0), 0.0)
  return {
    "pg_loss": metrics.pg_loss,
    "kl_loss": metrics.kl_loss,
    "entropy_loss": metrics.entropy_loss,
    "clip_frac": per_token(metrics.clipped_count),
    "dual_clip_frac": per_token(metrics.dual_clipped_count),
    "ratio_mean": per_token(metrics.ratio_sum),
    "kl": per_token(metrics.kl_sum),
    "entropy": per_token(metrics.entropy_sum),
    "token_count": n,
  }


def _rollout_weights(mask_RxT, informative_R, cfg):
  """Mask times the per-rollout weight (0 for non-informative rollouts if informative_only)."""
  mask_RxT = jnp.asarray(mask_RxT, jnp.float32)
  if cfg.informative_only:
    if informative_R is None:
      raise ValueError("informative_only needs informative_R")
    mask_RxT = mask_RxT * jnp.asarray(informative_R, jnp.float32)[:, None]
  return mask_RxT


def loss_denominator(mask_RxT, informative_R, cfg: LossConfig):
  """Global loss denominator for the whole step's batch (tokens or non-empty sequences), counted
  on the loss mask: the model's tokens, or the rows with at least one (docs/algorithms.md §11)."""
  w_RxT = _rollout_weights(mask_RxT, informative_R, cfg)
  if cfg.aggregation == "token-mean":
    return jnp.sum(w_RxT)
  # Padding rows have no tokens, so "sequences with ≥ 1 token" excludes them in both seq modes.
  return jnp.sum((jnp.sum(w_RxT, axis=1) > 0).astype(jnp.float32))


def _aggregate(x_RxT, w_RxT, mask_RxT, cfg):
  """Numerator of the chosen aggregation: a sum over rows, so additive across micro-batches.
  seq-mean-token-mean divides each row by its model tokens; seq-mean-token-sum-norm by the buffer
  length N whatever the row holds (docs/algorithms.md §11)."""
  xw_RxT = x_RxT * w_RxT
  if cfg.aggregation == "token-mean":
    return jnp.sum(xw_RxT)
  if cfg.aggregation == "seq-mean-token-mean":
    len_R = jnp.maximum(jnp.sum(mask_RxT, axis=1), 1.0)
    return jnp.sum(jnp.sum(xw_RxT, axis=1) / len_R)
  return jnp.sum(xw_RxT) / cfg.max_response_len


def _kl(logp_RxT, ref_logp_RxT, estimator):
  """Per-token KL(π_θ ‖ π_ref) estimate from log-probs of the sampled tokens."""
  d_RxT = ref_logp_RxT - logp_RxT
  if estimator == "k1":
    return -d_RxT
  if estimator == "k2":
    return 0.5 * d_RxT * d_RxT
  return jnp.exp(d_RxT) - d_RxT - 1.0


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def _policy_inputs(logp_RxT, old_logp_RxT, adv_R, adv_RxT, on_RxT):
  """(logp, old logp, advantage) per token, f32, 0 on masked positions; no gradient into the
  old log-probs or the advantages."""
  # Padded positions may hold -inf log-probs; select them away before exp so neither the value
  # nor the gradient sees a NaN.
  logp_RxT = jnp.where(on_RxT, _f32(logp_RxT), 0.0)
  old_RxT = jnp.where(on_RxT, jax.lax.stop_gradient(_f32(old_logp_RxT)), 0.0)
  if adv_RxT is None:
    adv_RxT = jnp.broadcast_to(_f32(adv_R)[:, None], on_RxT.shape)
  else:
    # Masked positions may hold anything; zero them so no NaN reaches the (zero-weighted) sum.
    adv_RxT = jnp.where(on_RxT, _f32(adv_RxT), 0.0)
  return logp_RxT, old_RxT, jax.lax.stop_gradient(adv_RxT)


def _clipped_objective(logp_RxT, old_RxT, adv_RxT, hp: LossHparams, cfg: LossConfig):
  """Per-token min(r·A, clip(r)·A), floored at c·A for A < 0 with a dual clip; also the ratio r
  and where the clip and the dual clip bind."""
  ratio_RxT = jnp.exp(logp_RxT - old_RxT)
  unclipped_RxT = ratio_RxT * adv_RxT
  clipped_RxT = jnp.clip(ratio_RxT, 1.0 - hp.eps_low, 1.0 + hp.eps_high) * adv_RxT
  obj_RxT = jnp.minimum(unclipped_RxT, clipped_RxT)
  is_clipped_RxT = clipped_RxT < unclipped_RxT
  is_dual_RxT = jnp.zeros_like(is_clipped_RxT)
  if cfg.dual_clip:
    floor_RxT = cfg.dual_clip * adv_RxT
    is_dual_RxT = (adv_RxT < 0) & (floor_RxT > obj_RxT)
    obj_RxT = jnp.where(is_dual_RxT, floor_RxT, obj_RxT)
  return obj_RxT, ratio_RxT, is_clipped_RxT, is_dual_RxT


def _kl_per_token(logp_RxT, ref_logp_RxT, on_RxT, cfg: LossConfig):
  """Per-token KL estimate against the reference policy (0 everywhere unless ``use_kl``)."""
  kl_RxT = jnp.zeros_like(logp_RxT)
  if cfg.use_kl:
    if ref_logp_RxT is None:
      raise ValueError("use_kl needs ref_logp_RxT")
    ref_RxT = jnp.where(on_RxT, jax.lax.stop_gradient(_f32(ref_logp_RxT)), 0.0)
    kl_RxT = _kl(logp_RxT, ref_RxT, cfg.kl_estimator)
  return kl_RxT


def _entropy_per_token(entropy_RxT, logp_RxT, on_RxT):
  """Per-token entropy, 0 on masked positions (0 everywhere when none is given)."""
  ent_RxT = jnp.zeros_like(logp_RxT)
  if entropy_RxT is not None:
    ent_RxT = jnp.where(on_RxT, _f32(entropy_RxT), 0.0)
  return ent_RxT


def _loss_metrics(
  w_RxT, pg_loss, kl_loss, entropy_loss, ratio_RxT, is_clipped_RxT, is_dual_RxT, kl_RxT, ent_RxT
) -> LossMetrics:
  """The additive metrics of one `grpo_loss` call, counted over the tokens that enter the loss."""
  tok = lambda x_RxT: jnp.sum(jnp.where(w_RxT > 0, _f32(x_RxT), 0.0))
  return LossMetrics(
    pg_loss=jax.lax.stop_gradient(pg_loss),
    kl_loss=jax.lax.stop_gradient(kl_loss),
    entropy_loss=jax.lax.stop_gradient(entropy_loss),
    token_count=tok(jnp.ones_like(w_RxT)),
    clipped_count=tok(is_clipped_RxT),
    dual_clipped_count=tok(is_dual_RxT),
    ratio_sum=jax.lax.stop_gradient(tok(ratio_RxT)),
    kl_sum=jax.lax.stop_gradient(tok(kl_RxT)),
    entropy_sum=jax.lax.stop_gradient(tok(ent_RxT)),
  )


def grpo_loss(
  logp_RxT,
  old_logp_RxT,
  adv_R,
  mask_RxT,
  entropy_RxT,
  ref_logp_RxT,
  informative_R,
  denom,
  hp: LossHparams,
  cfg: LossConfig,
  *,
  adv_RxT=None,
  behaviour_w_RxT=None,
):
  """Clipped GRPO surrogate + β·KL − λ·entropy, each aggregated and divided by `denom`.

  `mask_RxT` is the loss mask (docs/algorithms.md §11): at positions off it, `logp_RxT`,
  `old_logp_RxT`, `entropy_RxT`, `ref_logp_RxT`, `adv_RxT` and `behaviour_w_RxT` may hold anything
  finite; neither the loss, the metrics nor the gradient depends on them (the gradient there is 0).

  `adv_RxT`, if given, is a per-token advantage (e.g. `dynamo_modulate`'s) used in the surrogate
  and the dual clip instead of `adv_R` broadcast over tokens; `adv_R` is then ignored.
  `behaviour_w_RxT`, if given, is §9's corrected behaviour weight w̃ (`behaviour_weights`): it
  multiplies the per-token surrogate only (not the KL or entropy terms, not the denominator).
  """
  mask_RxT = _f32(mask_RxT)
  on_RxT = mask_RxT > 0
  w_RxT = _rollout_weights(mask_RxT, informative_R, cfg)
  logp_RxT, old_RxT, adv_RxT = _policy_inputs(logp_RxT, old_logp_RxT, adv_R, adv_RxT, on_RxT)
  obj_RxT, ratio_RxT, is_clipped_RxT, is_dual_RxT = _clipped_objective(
    logp_RxT, old_RxT, adv_RxT, hp, cfg
  )
  if behaviour_w_RxT is not None:
    obj_RxT = obj_RxT * jnp.where(on_RxT, jax.lax.stop_gradient(_f32(behaviour_w_RxT)), 0.0)

  safe_denom = jnp.where(denom > 0, denom, 1.0)  # empty batch: every numerator is 0 too
  pg_loss = -_aggregate(obj_RxT, w_RxT, mask_RxT, cfg) / safe_denom
  kl_RxT = _kl_per_token(logp_RxT, ref_logp_RxT, on_RxT, cfg)
  kl_loss = hp.kl_coef * _aggregate(kl_RxT, w_RxT, mask_RxT, cfg) / safe_denom
  ent_RxT = _entropy_per_token(entropy_RxT, logp_RxT, on_RxT)
  entropy_loss = -hp.entropy_coef * _aggregate(ent_RxT, w_RxT, mask_RxT, cfg) / safe_denom

  loss = pg_loss + kl_loss + entropy_loss
  metrics = _loss_metrics(
    w_RxT,
    pg_loss,
    kl_loss,
    entropy_loss,
    ratio_RxT=ratio_RxT,
    is_clipped_RxT=is_clipped_RxT,
    is_dual_RxT=is_dual_RxT,
    kl_RxT=kl_RxT,
    ent_RxT=ent_RxT,
  )
  return loss, metrics


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


def eepo_unlearning_loss_from_logp(
  logp_RxT, log1m_p_RxT, mask_RxT, eps_l, eps_r, paper_clip: bool = False
):
  """EEPO's L = mean_k (1/T_k)·Σ_t m_t·[p_t ≥ ε_L]·log(1 − p_t), from log p and log(1 − p).

  The caller ascends L (θ' ← θ' + η·∇L). Value: each log(1 − p) term is floored at log ε_R.
  Gradient (docs/algorithms.md §5.2): by default straight-through, that of the unfloored
  `log1m_p_RxT` (−p on the token's logit when it comes from `logp_log1m_p_from_logits`), so a
  dominant token keeps a gradient; ``paper_clip``: the paper's clip of p to [ε_L, 1 − ε_R] (its
  Eq. 8–9), under which a token with p > 1 − ε_R gets none. Tokens with p < ε_L contribute 0 in
  value and gradient. T_k counts the valid tokens of sequence k; rows with none (padding) are left
  out of the mean. Valid is ``mask_RxT``, the loss mask: the model's own tokens (§11).
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  mask_RxT = f32(mask_RxT)
  logp_RxT = f32(logp_RxT)
  log1m_p_RxT = f32(log1m_p_RxT)
  active_RxT = (mask_RxT > 0) & (jax.lax.stop_gradient(jnp.exp(logp_RxT)) >= eps_l)
  term_RxT = jnp.where(active_RxT, log1m_p_RxT, 0.0)
  floored_RxT = jnp.maximum(term_RxT, jnp.log(f32(eps_r)))
  if paper_clip:  # the floor's own gradient: 0 where it binds
    term_RxT = floored_RxT
  else:  # forward: exactly the floored value (term − sg(term) is exactly 0); backward: d term
    term_RxT = jax.lax.stop_gradient(floored_RxT) + (term_RxT - jax.lax.stop_gradient(term_RxT))
  term_RxT = jnp.where(active_RxT, term_RxT, 0.0)
  len_R = jnp.sum(mask_RxT, axis=1)
  seq_R = jnp.sum(term_RxT, axis=1) / jnp.maximum(len_R, 1.0)
  num_seqs = jnp.sum((len_R > 0).astype(jnp.float32))
  return jnp.sum(seq_R) / jnp.maximum(num_seqs, 1.0)


def eepo_unlearning_loss(logits, tokens, mask, eps_l, eps_r, paper_clip: bool = False):
  """EEPO unlearning loss from logits f[R,T,V] at τ = 1 (divide by τ first); see `_from_logp`."""
  R, T, V = logits.shape
  logp_N, log1m_p_N = logp_log1m_p_from_logits(
    jnp.reshape(logits, (R * T, V)), jnp.reshape(jnp.asarray(tokens), (R * T,)), 1.0
  )
  return eepo_unlearning_loss_from_logp(
    logp_N.reshape(R, T), log1m_p_N.reshape(R, T), mask, eps_l, eps_r, paper_clip
  )
