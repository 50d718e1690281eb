"""Jitted update steps: the GRPO update (``rl_update``), its gradient alone (``policy_grad``), the
supervised (SFT) update, and the train state they step.

Everything here is a pure function of arrays; ``jaxrl.run.loop`` owns the loop and side effects.
The update's structure is the static ``LossConfig``; the values schedules change (ε_low, ε_high,
KL and entropy coefficients, τ, DynaMO's α, γ, τ_s) arrive as traced arrays in ``LossHparams``,
so changing them never recompiles (docs/algorithms.md §1.5). The forwards are ``rl.scoring``'s,
the row chunks ``rl.micro_batches``'; EEPO's forgetting step is ``rl.forget``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxrl.nn import lora
from jaxrl.rl import advantages, behaviour, losses
from jaxrl.rl.losses import LossConfig, LossHparams
from jaxrl.rl.micro_batches import accumulate, packed_by_micro_batches, split_micro
from jaxrl.rl.packing import Packing
from jaxrl.rl.scoring import logp_responses, logprobs_entropies, packed_token_values
from jaxrl.types import Array, Rollouts, TrainState, pytree_dataclass, static_field


def sequential_chunks(rows: int, micro_batches: int) -> int:
  """How many sequential chunks the π_old rescoring and EEPO's forgetting step run ``rows`` rows
  in: ``loss.micro_batches`` when it divides them (R rows), else its largest divisor that does
  (the R/2 rows of an EEPO stage). The chunks are then at most as large as the update's
  micro-batches when ``loss.mini_batches`` <= 2 (larger ones have smaller micro-batches)."""
  return math.gcd(rows, micro_batches)


def apply_update(
  tx: optax.GradientTransformation, state: TrainState, grads, trainable: lora.Trainable = "all"
) -> TrainState:
  """One optimizer step: the transformed gradients (of the ``trainable`` part of the params, as
  ``lora.partition`` splits them) applied to that part, the step counted."""
  trained, frozen = lora.partition(state.params, trainable)
  updates, opt_state = tx.update(grads, state.opt_state, trained)
  params = lora.combine(optax.apply_updates(trained, updates), frozen)
  return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state)


def grad_of_part(fn, trainable: lora.Trainable):
  """``value_and_grad`` of ``fn(params, *args)`` with respect to the ``trainable`` part of
  params only: ``(params, *args) → (value, grads of that part)``. The frozen part gets no
  gradient at all (nothing is computed or stored for it)."""

  def of_part(trained, frozen, *args):
    return fn(lora.combine(trained, frozen), *args)

  grad_fn = jax.value_and_grad(of_part, has_aux=True)

  def value_and_grad(params, *args):
    trained, frozen = lora.partition(params, trainable)
    return grad_fn(trained, frozen, *args)

  return value_and_grad


@pytree_dataclass
class UpdateRows:
  """The per-row inputs of one GRPO update, split along R into mini- and micro-batches
  (``split_micro``). An optional field is None when the ``LossConfig`` has no use for it; None is
  part of the pytree's structure, so whether it is there is static."""

  prompt_ids_RxP: Array  # i32, left-padded
  prompt_mask_RxP: Array  # bool
  tokens_RxN: Array  # i32 response tokens
  mask_RxN: Array  # bool, every response token: what the forward attends to
  loss_mask_RxN: Array  # bool, the model's sampled tokens: what the loss reads (§11)
  old_logp_RxN: Array  # f32 ℓ_prox, under the params the update starts from (§9)
  adv_R: Array  # f32 group advantages, over the whole step's batch (§1.1)
  informative_R: Array  # bool: the row's group has rewards not all equal
  ref_logp_RxN: Array | None = None  # f32 the KL reference's log-probs (``use_kl``)
  behaviour_w_RxN: Array | None = None  # f32 §9's w̃ (a ``behaviour_correction`` other than none)
  # A packed forward (``rl.packing``): each row's buffer row and offset in its micro-batch's
  # ``pack_rows`` packed buffers; None: the padded forward.
  pack_slot_R: Array | None = None
  pack_offset_R: Array | None = None
  pack_rows: int = static_field(default=0)


def _row_inputs(
  graphdef, cfg: LossConfig, batch: Rollouts, hp: LossHparams, ref_params, pack: Packing | None
):
  """Per-row inputs of the GRPO loss: advantages and informative flags over the whole batch
  (groups may straddle mini- and micro-batches), the KL reference's log-probs and §9's weights
  (over the model's tokens: the loss mask, docs/algorithms.md §11), the packed layout if any."""
  adv_R = advantages.group_advantages(
    batch.rewards_R, batch.group_ids_R, cfg.num_groups, scale_by_std=cfg.scale_by_std
  )
  ref_logp_RxN = None
  rows = (batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN, batch.mask_RxN)
  if cfg.use_kl and pack is None:
    ref_logp_RxN, _ = logp_responses(graphdef, ref_params, *rows, hp.tau, cfg.logprob_chunk)
  elif cfg.use_kl:  # packed as the update packs them: micro-batch by micro-batch, in sequence
    fused = logprobs_entropies(hp.tau, cfg.logprob_chunk)
    ref_logp_RxN = packed_by_micro_batches(
      lambda chunk: packed_token_values(graphdef, ref_params, *chunk, pack.rows, fused)[0],
      (*rows, pack.slot_R, pack.offset_R),
      cfg.mini_batches,
      cfg.micro_batches,
    )
  if ref_logp_RxN is not None:
    ref_logp_RxN = jax.lax.stop_gradient(ref_logp_RxN)
  behaviour_w_RxN = None
  if cfg.behaviour_correction != "none":  # "none" leaves the objective exactly as it was
    behaviour_w_RxN = behaviour.behaviour_weights(
      batch.prox_logp_RxN, batch.behaviour_logp_RxN, batch.loss_mask_RxN, **_behaviour_args(cfg, hp)
    )
  return UpdateRows(
    prompt_ids_RxP=batch.prompt_ids_RxP,
    prompt_mask_RxP=batch.prompt_mask_RxP,
    tokens_RxN=batch.tokens_RxN,
    mask_RxN=batch.mask_RxN,
    loss_mask_RxN=batch.loss_mask_RxN,
    old_logp_RxN=batch.prox_logp_RxN,
    adv_R=adv_R,
    informative_R=advantages.informative_rollouts(
      batch.rewards_R, batch.group_ids_R, cfg.num_groups
    ),
    ref_logp_RxN=ref_logp_RxN,
    behaviour_w_RxN=behaviour_w_RxN,
    pack_slot_R=None if pack is None else pack.slot_R,
    pack_offset_R=None if pack is None else pack.offset_R,
    pack_rows=0 if pack is None else pack.rows,
  )


def _behaviour_args(cfg: LossConfig, hp: LossHparams) -> dict:
  return dict(mode=cfg.behaviour_correction, cap=hp.tis_cap, m_low=hp.mis_low, m_high=hp.mis_high)


def _micro_loss(graphdef, cfg: LossConfig, hp: LossHparams):
  """``loss(params, rows, denom, stats) → (loss, metrics)`` of one micro-batch: a partial sum of
  its mini-batch's loss (the denominator is the mini-batch's, and so are DynaMO's statistics
  ``stats``: None computes them from this call's rows, the whole mini-batch when it is one
  micro-batch). The forward reads every response token; every term of the loss only the model's
  (the loss mask, docs/algorithms.md §11)."""

  def loss(params, mb: UpdateRows, denom, stats):
    logp_RxN, ent_RxN = _forward(graphdef, cfg, hp, params, mb)
    adv_RxN = None
    if cfg.modulation:  # DynaMO (§4.3), normalised by the mini-batch's max Ξ and H range
      adv_RxN = advantages.dynamo_modulate(
        adv=mb.adv_R,
        logp=logp_RxN,
        old_logp=mb.old_logp_RxN,
        entropy=ent_RxN,
        mask=mb.loss_mask_RxN,
        eps_low=hp.eps_low,
        eps_high=hp.eps_high,
        alpha=hp.modulation_alpha,
        gamma=hp.modulation_gamma,
        tau=hp.modulation_tau,
        stats=stats,
      )
    return losses.grpo_loss(
      logp_RxT=logp_RxN,
      old_logp_RxT=mb.old_logp_RxN,
      adv_R=mb.adv_R,
      mask_RxT=mb.loss_mask_RxN,
      entropy_RxT=ent_RxN,
      ref_logp_RxT=mb.ref_logp_RxN,
      informative_R=mb.informative_R,
      denom=denom,
      hp=hp,
      cfg=cfg,
      adv_RxT=adv_RxN,
      behaviour_w_RxT=mb.behaviour_w_RxN,
    )

  return loss


def _forward(graphdef, cfg: LossConfig, hp: LossHparams, params, mb: UpdateRows):
  """ℓ and H at τ of a micro-batch's response tokens under ``params``: (logp_RxN, ent_RxN), from
  the packed forward when the rows carry a packed layout."""
  rows = (mb.prompt_ids_RxP, mb.prompt_mask_RxP, mb.tokens_RxN, mb.mask_RxN)
  if mb.pack_slot_R is None:
    return logp_responses(graphdef, params, *rows, hp.tau, cfg.logprob_chunk)
  fused = logprobs_entropies(hp.tau, cfg.logprob_chunk)
  layout = (mb.pack_slot_R, mb.pack_offset_R, mb.pack_rows)
  return packed_token_values(graphdef, params, *rows, *layout, fused)


def _modulation_stats(graphdef, cfg: LossConfig, hp: LossHparams, params, rows: UpdateRows):
  """DynaMO's max Ξ, H_min and H_max over a whole mini-batch (docs/algorithms.md §4.3), from a
  forward (no backward) over the same strided chunks the gradient accumulates over, before it.

  The pass is extra work (one forward per micro-batch) because no quantity at hand holds these
  values: Ξ reads ℓ (through ρ, the clip indicator and exp(ℓ)) and H under the params being
  optimised, which move with every optimizer update of the step. ℓ_prox equals ℓ only at the
  first mini-batch, and even there the rollouts' entropies need not be under these params (EEPO's
  second stage has θ''s) nor the update's forward's numbers (the JAX sampler's decode gives them). Every micro-batch's gradient needs the
  maxima over all of them, so they come first: per chunk, then reduced (max and min add no
  rounding, so the split changes nothing but the forward's own)."""

  def chunk_stats(mb: UpdateRows):
    logp_RxN, ent_RxN = _forward(graphdef, cfg, hp, params, mb)
    return advantages.dynamo_statistics(
      mb.adv_R, logp_RxN, mb.old_logp_RxN, ent_RxN, mb.loss_mask_RxN, hp.eps_low, hp.eps_high
    )

  return advantages.DynamoStats.reduce(
    jax.lax.map(chunk_stats, split_micro(rows, cfg.micro_batches))
  )


def _minibatch_grads(graphdef, cfg: LossConfig, hp: LossHparams, grad_fn, params, rows: UpdateRows):
  """((loss, metrics), grads) of one mini-batch at ``params``: its denominator and DynaMO's
  statistics first, then the gradient accumulated over its micro-batches."""
  denom = losses.loss_denominator(rows.loss_mask_RxN, rows.informative_R, cfg)
  stats = None  # one micro-batch: the loss's own forward covers the mini-batch
  if cfg.modulation and cfg.micro_batches > 1:
    stats = _modulation_stats(graphdef, cfg, hp, params, rows)
  return accumulate(lambda mb: grad_fn(params, mb, denom, stats), rows, cfg.micro_batches)


def policy_grad(
  graphdef,
  cfg: LossConfig,
  params,
  batch: Rollouts,
  hp: LossHparams,
  ref_params=None,
  pack: Packing | None = None,
  *,
  trainable: lora.Trainable = "all",
):
  """The gradient of the GRPO loss of ``batch`` at ``params`` with the whole batch as one
  mini-batch (the gradient of ``rl_update``'s first update when ``loss.mini_batches`` = 1), of the
  ``trainable`` part: what the gradient-variance diagnostic compares (docs/algorithms.md §12.1).
  Nothing is updated."""
  if cfg.use_kl and ref_params is None:
    ref_params = lora.without_adapters(params)
  rows = _row_inputs(graphdef, cfg, batch, hp, ref_params, pack)
  grad_fn = grad_of_part(_micro_loss(graphdef, cfg, hp), trainable)
  _, grads = _minibatch_grads(graphdef, cfg, hp, grad_fn, params, rows)
  return grads


def rl_update(
  graphdef,
  tx: optax.GradientTransformation,
  cfg: LossConfig,
  state: TrainState,
  batch: Rollouts,
  hp: LossHparams,
  ref_params=None,
  pack: Packing | None = None,
  *,
  trainable: lora.Trainable = "all",
):
  """GRPO on one step's rollouts: ``cfg.mini_batches`` optimizer updates, each over one strided
  mini-batch of rows, each accumulating gradients over ``cfg.micro_batches`` micro-batches.

  ``trainable`` (``lora.Trainable``) says which params move; the KL reference is ``ref_params``,
  or with LoRA and none given, the policy with its adapters switched off. ``pack``
  (``rl.packing.plan`` for these mini- and micro-batches) runs the update's forwards packed: the
  same objective, one program per ``pack.rows``.

  Each mini-batch has its own loss denominator, and with DynaMO's modulation its own max Ξ and
  entropy range (``_modulation_stats``), computed before its micro-batches, so a micro-batch loss
  is a partial sum of the mini-batch loss and the accumulated gradient equals the mini-batch
  gradient, however many micro-batches there are. With one mini-batch the update is on-policy
  (ρ = 1, the clip never binds); later mini-batches see ρ ≠ 1, where ε_low/ε_high act.
  """
  if cfg.num_groups < 1:
    raise ValueError("rl_update: LossConfig.num_groups must count the batch's groups (>= 1)")
  if cfg.use_kl and ref_params is None:
    ref_params = lora.without_adapters(state.params)
  per_row = _row_inputs(graphdef, cfg, batch, hp, ref_params, pack)
  grad_fn = grad_of_part(_micro_loss(graphdef, cfg, hp), trainable)
  one_update = _finite_update(graphdef, tx, cfg, hp, grad_fn, trainable)
  state, out = _over_mini_batches(one_update, state, per_row, cfg.mini_batches)
  out["informative_frac"] = jnp.mean(per_row.informative_R.astype(jnp.float32))
  # docs/algorithms.md §9: how far the engine's policy μ is from the update's start, every mode,
  # over the tokens μ sampled (an environment's have no ℓ_μ, §11)
  out.update(
    behaviour.behaviour_metrics(
      batch.prox_logp_RxN, batch.behaviour_logp_RxN, batch.loss_mask_RxN, **_behaviour_args(cfg, hp)
    )
  )
  return state, out


def _finite_update(graphdef, tx, cfg: LossConfig, hp: LossHparams, grad_fn, trainable):
  """``one_update(state, rows) → (state, metrics)``: one optimizer update on a mini-batch's rows,
  skipped when its loss or gradient is not finite."""

  def one_update(state, rows: UpdateRows):
    (loss, metrics), grads = _minibatch_grads(graphdef, cfg, hp, grad_fn, state.params, rows)
    grad_norm = optax.global_norm(grads)
    # A non-finite loss or gradient (an overflow, a NaN reward) is never applied: the update is
    # skipped (state unchanged, so never checkpointed) and counted; the loop decides when to stop.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old),
      apply_update(tx, state, grads, trainable),
      state,
    )
    return new_state, dict(
      losses.finalize_metrics(metrics),
      loss=loss,
      grad_norm=grad_norm,
      nonfinite_updates=1 - finite.astype(jnp.int32),
    )

  return one_update


def _over_mini_batches(one_update, state: TrainState, per_row: UpdateRows, mini_batches: int):
  """``one_update`` over the strided mini-batches of ``per_row`` in sequence (``lax.scan``): the
  last state, and the metrics averaged over the updates, the skipped updates summed."""
  if mini_batches == 1:
    return one_update(state, per_row)
  state, outs = jax.lax.scan(one_update, state, split_micro(per_row, mini_batches))
  skipped = jnp.sum(outs.pop("nonfinite_updates"))
  out = jax.tree.map(lambda x: jnp.mean(x, axis=0), outs)  # metrics averaged over the updates
  out["nonfinite_updates"] = skipped
  return state, out


def sft_update(
  graphdef,
  tx: optax.GradientTransformation,
  chunk: int,
  state: TrainState,
  prompt_ids_BxP,
  prompt_mask_BxP,
  target_ids_BxN,
  target_mask_BxN,
  loss_mask_BxN=None,
  *,
  trainable: lora.Trainable = "all",
):
  """One supervised step: mean negative log-likelihood of the target (completion) tokens at τ=1.

  ``loss_mask_BxN`` (None: the target mask) says which target tokens are learned: a multi-turn
  example's environment tokens are read (``target_mask_BxN``) but not learned.
  """
  one = jnp.ones((), jnp.float32)

  def nll(params):
    logp, _ = logp_responses(
      graphdef, params, prompt_ids_BxP, prompt_mask_BxP, target_ids_BxN, target_mask_BxN, one, chunk
    )
    if loss_mask_BxN is not None:
      logp = logp * loss_mask_BxN.astype(logp.dtype)
      return -jnp.sum(logp) / jnp.maximum(jnp.sum(loss_mask_BxN), 1), None
    count = jnp.maximum(jnp.sum(target_mask_BxN), 1)
    return -jnp.sum(logp) / count, None

  (loss, _), grads = grad_of_part(nll, trainable)(state.params)
  new_state = apply_update(tx, state, grads, trainable)
  return new_state, dict(loss=loss, grad_norm=optax.global_norm(grads))


def init_state(params, tx, trainable: lora.Trainable = "all") -> TrainState:
  """Step 0: AdamW moments for the ``trainable`` part of the params only."""
  moments = tx.init(lora.partition(params, trainable)[0])
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=moments)
