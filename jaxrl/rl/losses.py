"""The loss functions: GRPO's clipped surrogate, KL and entropy (docs/algorithms.md §1), with the
update's traced hyperparameters (`LossHparams`), its additive metrics and its aggregation; and
EEPO's unlearning loss (§5) for the rollout copy θ'.

Everything here is a pure function of arrays plus the static `LossConfig` (`rl.program_configs`); the
hyperparameters that schedules change every step (ε_low, ε_high, β, λ, τ, DynaMO's α, γ, τ_s, the
behaviour-weight thresholds) arrive as the traced `LossHparams` pytree, so a new value never
recompiles (docs/algorithms.md §1.5). The loss is written as numerator / denominator with the
denominator computed once over the whole step's batch (`loss_denominator`): summing `grpo_loss` over
micro-batches that share that denominator gives exactly the loss and gradient of one big batch.
Metrics are returned as additive sums and counts for the same reason; `finalize_metrics` turns
them into means once all micro-batches are summed.

The advantages the surrogate reads (group advantages, DynaMO's modulation, §4) are
`rl.advantages`'; §9's behaviour weights, which multiply it, `rl.behaviour`'s.

Every ``mask`` here is the **loss mask** (docs/algorithms.md §11): the model's own sampled tokens.
In a multi-turn response an environment's tokens are off it: no term, weight, statistic or token
count reads their values, so they carry exactly no gradient. Single-turn, it is the response mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl.nn.logprobs import logp_log1m_p_from_logits
from jaxrl.rl.program_configs import LossConfig
from jaxrl.rl.sections import LossSection, ModulationSection


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
  tau: jax.Array = _f32_field(1.0)  # the logits as they are (rollout.temperature's default)
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


def _rollout_weights(mask_RxT, informative_R, cfg: LossConfig):
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


def _aggregate(x_RxT, w_RxT, mask_RxT, cfg: LossConfig):
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
