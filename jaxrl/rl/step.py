"""Jitted steps: scoring responses, the GRPO update, and the supervised (SFT) update.

Everything here is a pure function of arrays; ``jaxrl.run.train`` owns the loop and side effects.
The update's structure is the static ``LossConfig``; the values schedules change (ε_low, ε_high,
KL and entropy coefficients, τ, DynaMO's α, γ, τ_s) arrive as traced arrays in ``LossHparams``,
so changing them never recompiles (docs/algorithms.md §1.5).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxrl.nn import lora, model
from jaxrl.nn.logprobs import fused_log1m_p, fused_logprobs_entropy
from jaxrl.rl import losses, packing
from jaxrl.rl.losses import LossConfig, LossHparams
from jaxrl.rl.packing import Packing
from jaxrl.types import Array, Rollouts, TrainState, pytree_dataclass, static_field


def response_hidden(
  graphdef, params, prompt_ids_RxP, prompt_mask_RxP, response_ids_RxN, response_mask_RxN
):
  """Hidden states that predict each response token, and the LM head: (hidden_RxNxD, lm_head_VxD).

  One forward over prompt ++ response; a token is predicted by the hidden state of the last real
  token before it. Without gaps that is the one just before it, so the response tokens are
  predicted by hidden states P-1 .. P+N-2. A multi-turn response has gaps inside it (masked
  positions: a row waiting for the others' turns, an observation's padding, docs/algorithms.md
  §11): a real token after one is predicted across it (``_predictors``).
  """
  p = prompt_ids_RxP.shape[1]
  tokens = jnp.concatenate([prompt_ids_RxP, response_ids_RxN], axis=1)
  valid = jnp.concatenate([prompt_mask_RxP, response_mask_RxN], axis=1)
  positions = model.positions_from_mask(valid)
  hidden, lm_head, _ = model.forward(graphdef, params, tokens, positions, valid)
  index_RxN = _predictors(valid, p)
  return jnp.take_along_axis(hidden, index_RxN[:, :, None], axis=1), lm_head


def _predictors(valid_RxT: Array, p: int) -> Array:
  """For response token j (position P + j of prompt ++ response), the position whose hidden state
  predicts it: the last real position before it where token j is real, P + j - 1 elsewhere (a
  masked token's prediction is never read). Without gaps inside the response (single-turn) this
  is P + j - 1 everywhere: the same rows as the slice of hidden states P-1 .. P+N-2."""
  t = valid_RxT.shape[1]
  at_T = jnp.arange(t, dtype=jnp.int32)
  last_real_RxT = jax.lax.cummax(jnp.where(valid_RxT, at_T, 0), axis=1)
  before_RxN = last_real_RxT[:, p - 1 : t - 1]
  return jnp.where(valid_RxT[:, p:], before_RxN, at_T[p - 1 : t - 1])


def logp_responses(
  graphdef,
  params,
  prompt_ids_RxP,
  prompt_mask_RxP,
  response_ids_RxN,
  response_mask_RxN,
  tau,
  chunk_size: int,
):
  """Log-probs and entropies at τ of each response token given its prompt: (logp_RxN, ent_RxN)."""
  hidden_RxNxD, lm_head = response_hidden(
    graphdef, params, prompt_ids_RxP, prompt_mask_RxP, response_ids_RxN, response_mask_RxN
  )
  logp, ent = fused_logprobs_entropy(
    hidden_RxNxD, lm_head, response_ids_RxN, tau, chunk_size=chunk_size
  )
  mask = response_mask_RxN.astype(logp.dtype)
  return logp * mask, ent * mask


def packed_token_values(
  graphdef,
  params,
  prompt_ids_XxP,
  prompt_mask_XxP,
  response_ids_XxN,
  response_mask_XxN,
  slot_X,
  offset_X,
  rows: int,
  fused,
):
  """Per-token values of X rows' response tokens, ``fused(hidden_BxTxD, lm_head, targets_BxT)``
  (a tuple of [B, T] arrays: ``fused_logprobs_entropy``'s, ``fused_log1m_p``'s), from one forward
  over their sequences packed into ``rows`` buffers of P + N positions (``rl.packing``; the rows'
  buffer rows and offsets ``slot_X``, ``offset_X``); returned in the padded [X, N] layout, 0 off
  ``response_mask_XxN``.

  Only real tokens are packed, so a response token's predictor is the packed token just before
  it, a token of its own sequence (its prompt's last or its response's previous real one: the
  padded path's ``_predictors``). ``fused`` runs at every packed position against the next packed
  token; the values are read back at each response token's predictor, so a position whose next
  token starts another sequence is never read."""
  p = prompt_ids_XxP.shape[1]
  valid_XxT = jnp.concatenate([prompt_mask_XxP, response_mask_XxN], axis=1)
  dest_XxT = packing.destinations(valid_XxT, slot_X, offset_X, rows)
  place = lambda v_XxT: packing.scatter(v_XxT, dest_XxT, rows)  # noqa: E731
  tokens_XxT = jnp.concatenate([prompt_ids_XxP, response_ids_XxN], axis=1)
  tokens_BxT = place(tokens_XxT.astype(jnp.int32))
  positions_BxT = place(model.positions_from_mask(valid_XxT))
  x, t = valid_XxT.shape
  # row x's sequence is segment x + 1; 0 is padding
  segments_BxT = place(jnp.broadcast_to(jnp.arange(1, x + 1, dtype=jnp.int32)[:, None], (x, t)))
  hidden_BxTxD, lm_head, _ = model.forward(
    graphdef, params, tokens_BxT, positions_BxT, segments_BxT
  )
  next_BxT = jnp.roll(tokens_BxT.reshape(-1), -1).reshape(rows, t)  # the last wraps: never read
  values = fused(hidden_BxTxD, lm_head, next_BxT)
  # A response token's predictor sits just before it; a masked token's index is out of range.
  read_XxN = jnp.clip(dest_XxT[:, p:] - 1, 0, rows * t - 1)
  mask = response_mask_XxN.astype(jnp.float32)
  return tuple(jnp.take(v_BxT.reshape(-1), read_XxN, axis=0) * mask for v_BxT in values)


def logprobs_entropies(tau, chunk_size: int):
  """``packed_token_values``' ``fused`` for ``logp_responses``' values: (logp, ent) at τ of each
  target token (``fused_logprobs_entropy``); the packed forward gives them up to rounding."""

  def fused(hidden_BxTxD, lm_head, targets_BxT):
    return fused_logprobs_entropy(hidden_BxTxD, lm_head, targets_BxT, tau, chunk_size=chunk_size)

  return fused


def logp_responses_chunked(
  graphdef,
  params,
  prompt_ids_RxP,
  prompt_mask_RxP,
  response_ids_RxN,
  response_mask_RxN,
  tau,
  chunk_size: int,
  micro: int,
  pack: Packing | None = None,
):
  """``logp_responses`` over ``micro`` strided row chunks in sequence (``lax.map``): the same
  values, with the activation memory of R/micro rows (π_old rescoring of a whole step's rollouts).
  ``pack`` (``rl.packing.plan`` for one mini-batch of ``micro`` micro-batches) packs each chunk."""
  rows = (prompt_ids_RxP, prompt_mask_RxP, response_ids_RxN, response_mask_RxN)
  if pack is not None:
    fused = logprobs_entropies(tau, chunk_size)
    return _packed_by_micro_batches(
      lambda chunk: packed_token_values(graphdef, params, *chunk, pack.rows, fused),
      (*rows, pack.slot_R, pack.offset_R),
      1,
      micro,
    )
  if micro == 1:
    return logp_responses(graphdef, params, *rows, tau, chunk_size)
  logp_MxXxN, ent_MxXxN = jax.lax.map(
    lambda chunk: logp_responses(graphdef, params, *chunk, tau, chunk_size),
    _split_micro(rows, micro),
  )
  return _merge_micro(logp_MxXxN), _merge_micro(ent_MxXxN)


def _merge_micro(x_MxXx):
  """Inverse of ``_split_micro`` for one array: [micro, R/micro, ...] → [R, ...]."""
  return jnp.swapaxes(x_MxXx, 0, 1).reshape(-1, *x_MxXx.shape[2:])


def sequential_chunks(rows: int, micro_batches: int) -> int:
  """How many sequential chunks the π_old rescoring and EEPO's forgetting step run ``rows`` rows
  in: ``loss.micro_batches`` when it divides them (R rows), else its largest divisor that does
  (the R/2 rows of an EEPO stage). The chunks are then at most as large as the update's
  micro-batches when ``loss.mini_batches`` <= 2 (larger ones have smaller micro-batches)."""
  return math.gcd(rows, micro_batches)


def _split_micro(tree, micro: int):
  """[R, ...] → [micro, R/micro, ...] taking every micro-th row (row r goes to chunk r % micro).

  Rows are sharded over the data axes in contiguous blocks, one per device; a strided split gives
  every chunk an equal share of every device's block, so each chunk stays data-parallel. (A
  contiguous split put a whole chunk on 1/micro of the devices: measured with --plan on the 7B
  config, 745 → 165 GiB of XLA temp per device.)
  """
  return jax.tree.map(
    lambda x: jnp.swapaxes(x.reshape(x.shape[0] // micro, micro, *x.shape[1:]), 0, 1), tree
  )


def accumulate(value_and_grad, rows, micro: int):
  """Σ of ``value_and_grad(chunk)`` (any pytree: values, metrics, gradients) over ``micro``
  strided row chunks (``_split_micro``), in sequence (``lax.scan``): the sum over all rows with
  the activation memory of one chunk. The first chunk seeds the carry; ``micro`` = 1 is one call."""
  if micro == 1:
    return value_and_grad(rows)
  chunks = _split_micro(rows, micro)
  first = value_and_grad(jax.tree.map(lambda x: x[0], chunks))

  def body(carry, chunk):
    return jax.tree.map(jnp.add, carry, value_and_grad(chunk)), None

  total, _ = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], chunks))
  return total


def apply_update(
  tx: optax.GradientTransformation, state: TrainState, grads, trainable: lora.Trainable = "all"
) -> TrainState:
  """One optimizer step: the transformed gradients (of the ``trainable`` part of the params, as
  ``lora.partition`` splits them) applied to that part, the step counted."""
  trained, frozen = lora.partition(state.params, trainable)
  updates, opt_state = tx.update(grads, state.opt_state, trained)
  params = lora.combine(optax.apply_updates(trained, updates), frozen)
  return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state)


def _grad_of_part(fn, trainable: lora.Trainable):
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
  (``_split_micro``). An optional field is None when the ``LossConfig`` has no use for it; None is
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
  adv_R = losses.group_advantages(
    batch.rewards_R, batch.group_ids_R, cfg.num_groups, scale_by_std=cfg.scale_by_std
  )
  ref_logp_RxN = None
  rows = (batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN, batch.mask_RxN)
  if cfg.use_kl and pack is None:
    ref_logp_RxN, _ = logp_responses(graphdef, ref_params, *rows, hp.tau, cfg.logprob_chunk)
  elif cfg.use_kl:  # packed as the update packs them: micro-batch by micro-batch, in sequence
    fused = logprobs_entropies(hp.tau, cfg.logprob_chunk)
    ref_logp_RxN = _packed_by_micro_batches(
      lambda chunk: packed_token_values(graphdef, ref_params, *chunk, pack.rows, fused)[0],
      (*rows, pack.slot_R, pack.offset_R),
      cfg.mini_batches,
      cfg.micro_batches,
    )
  if ref_logp_RxN is not None:
    ref_logp_RxN = jax.lax.stop_gradient(ref_logp_RxN)
  behaviour_w_RxN = None
  if cfg.behaviour_correction != "none":  # "none" leaves the objective exactly as it was
    behaviour_w_RxN = losses.behaviour_weights(
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
    informative_R=losses.informative_rollouts(batch.rewards_R, batch.group_ids_R, cfg.num_groups),
    ref_logp_RxN=ref_logp_RxN,
    behaviour_w_RxN=behaviour_w_RxN,
    pack_slot_R=None if pack is None else pack.slot_R,
    pack_offset_R=None if pack is None else pack.offset_R,
    pack_rows=0 if pack is None else pack.rows,
  )


def _packed_by_micro_batches(fn, rows, mini_batches: int, micro_batches: int):
  """``fn(chunk)`` (a pytree of [X, ...]) over the micro-batches of ``rows`` (every mini-batch's,
  ``_split_micro`` within ``_split_micro``), in sequence (``lax.map``), put back in row order: a
  forward over the chunks ``rl.packing.plan`` packs for these mini- and micro-batches."""
  m1, m2 = mini_batches, micro_batches
  nested = jax.tree.map(jax.vmap(lambda x: _split_micro(x, m2)), _split_micro(rows, m1))
  flat = jax.tree.map(lambda x: x.reshape(m1 * m2, *x.shape[2:]), nested)

  def merge(out_CxXx):
    out_M1xM2xXx = out_CxXx.reshape(m1, m2, *out_CxXx.shape[1:])
    return _merge_micro(jax.vmap(_merge_micro)(out_M1xM2xXx))

  return jax.tree.map(merge, jax.lax.map(fn, flat))


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
      adv_RxN = losses.dynamo_modulate(
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
    return losses.dynamo_statistics(
      mb.adv_R, logp_RxN, mb.old_logp_RxN, ent_RxN, mb.loss_mask_RxN, hp.eps_low, hp.eps_high
    )

  return losses.DynamoStats.reduce(jax.lax.map(chunk_stats, _split_micro(rows, cfg.micro_batches)))


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
  grad_fn = _grad_of_part(_micro_loss(graphdef, cfg, hp), trainable)
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
  grad_fn = _grad_of_part(_micro_loss(graphdef, cfg, hp), trainable)
  one_update = _finite_update(graphdef, tx, cfg, hp, grad_fn, trainable)
  state, out = _over_mini_batches(one_update, state, per_row, cfg.mini_batches)
  out["informative_frac"] = jnp.mean(per_row.informative_R.astype(jnp.float32))
  # docs/algorithms.md §9: how far the engine's policy μ is from the update's start, every mode,
  # over the tokens μ sampled (an environment's have no ℓ_μ, §11)
  out.update(
    losses.behaviour_metrics(
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
  state, outs = jax.lax.scan(one_update, state, _split_micro(per_row, mini_batches))
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

  (loss, _), grads = _grad_of_part(nll, trainable)(state.params)
  new_state = apply_update(tx, state, grads, trainable)
  return new_state, dict(loss=loss, grad_norm=optax.global_norm(grads))


@pytree_dataclass
class ForgetRows:
  """The per-row inputs of EEPO's forgetting step (the stage-1 responses), split along R into
  micro-batches (``_split_micro``); each field means what ``UpdateRows``' of its name means, and
  L reads the loss mask's tokens only (§11)."""

  prompt_ids_RxP: Array
  prompt_mask_RxP: Array
  tokens_RxN: Array
  mask_RxN: Array
  loss_mask_RxN: Array
  pack_slot_R: Array | None = None  # None: the padded forward
  pack_offset_R: Array | None = None


def eepo_forget(
  graphdef,
  chunk: int,
  params,
  prompt_ids_RxP,
  prompt_mask_RxP,
  response_ids_RxN,
  response_mask_RxN,
  loss_mask_RxN,
  tau,
  pack: Packing | None = None,
  *,
  lr: float,
  eps_l: float,
  eps_r: float,
  paper_clip: bool = False,
  micro: int = 1,
  trainable: lora.Trainable = "all",
):
  """EEPO's forgetting step on the rollout copy: θ' = θ + η·∇L, one plain SGD ascent step (over
  the ``trainable`` part of θ: with LoRA, the adapters).

  L is the unlearning objective (docs/algorithms.md §5) over the stage-1 responses at τ
  (log(1-p) computed stably by the fused path); no optimizer state. The forward reads every
  response token (``response_mask_RxN``), L only the model's own (``loss_mask_RxN``,
  docs/algorithms.md §11). ``micro`` > 1 accumulates L and ∇L over that many strided row chunks
  (``_split_micro``) in sequence, as ``rl_update``'s micro-batches: the same θ' with the
  activation memory of R/micro rows. ``pack`` (``rl.packing.plan`` for one mini-batch of
  ``micro`` micro-batches) runs the forward packed: the same L and θ' up to rounding.
  Returns (θ', L).
  """
  rows = ForgetRows(
    prompt_ids_RxP=prompt_ids_RxP,
    prompt_mask_RxP=prompt_mask_RxP,
    tokens_RxN=response_ids_RxN,
    mask_RxN=response_mask_RxN,
    loss_mask_RxN=loss_mask_RxN,
    pack_slot_R=None if pack is None else pack.slot_R,
    pack_offset_R=None if pack is None else pack.offset_R,
  )
  objective = _unlearning_objective(graphdef, chunk, tau, pack, eps_l, eps_r, paper_clip)
  value, grads = _forget_grads(_grad_of_part(objective, trainable), params, rows, micro)
  trained, frozen = lora.partition(params, trainable)
  return lora.combine(jax.tree.map(lambda p, g: p + lr * g, trained, grads), frozen), value


def _unlearning_objective(graphdef, chunk: int, tau, pack, eps_l, eps_r, paper_clip: bool):
  """``objective(params, rows, weight) → (weight · L, None)``: EEPO's unlearning loss of
  ``rows`` (``ForgetRows``) at τ, from the packed forward when ``pack`` is given."""

  def fused(hidden_BxTxD, lm_head, targets_BxT):
    return fused_log1m_p(hidden_BxTxD, lm_head, targets_BxT, tau, chunk_size=chunk)

  def objective(p, rows: ForgetRows, weight):
    inputs = (rows.prompt_ids_RxP, rows.prompt_mask_RxP, rows.tokens_RxN, rows.mask_RxN)
    if pack is None:
      hidden_RxNxD, lm_head = response_hidden(graphdef, p, *inputs)
      logp, log1m_p = fused(hidden_RxNxD, lm_head, rows.tokens_RxN)
    else:
      layout = (rows.pack_slot_R, rows.pack_offset_R, pack.rows)
      logp, log1m_p = packed_token_values(graphdef, p, *inputs, *layout, fused)
    loss = losses.eepo_unlearning_loss_from_logp(
      logp, log1m_p, rows.loss_mask_RxN, eps_l, eps_r, paper_clip
    )
    return weight * loss, None

  return objective


def _forget_grads(part_grad, params, rows: ForgetRows, micro: int):
  """(L, ∇L) at ``params`` (``part_grad``: ``_grad_of_part`` of the objective), over ``micro``
  strided row chunks in sequence when ``micro`` > 1 (``accumulate``)."""

  def grad_fn(p, mb: ForgetRows, weight):
    (value, _), grads = part_grad(p, mb, weight)
    return value, grads

  if micro == 1:
    return grad_fn(params, rows, jnp.float32(1))

  # L is a mean over the rows with a model token; a chunk's mean, weighted by its share of
  # those rows, is its part of the sum.
  def responses(mask_RxN):
    return jnp.sum((jnp.sum(mask_RxN, axis=1) > 0).astype(jnp.float32))

  total = jnp.maximum(responses(rows.loss_mask_RxN), 1.0)
  share = lambda mb: responses(mb.loss_mask_RxN) / total  # noqa: E731
  return accumulate(lambda mb: grad_fn(params, mb, share(mb)), rows, micro)


def init_state(params, tx, trainable: lora.Trainable = "all") -> TrainState:
  """Step 0: AdamW moments for the ``trainable`` part of the params only."""
  moments = tx.init(lora.partition(params, trainable)[0])
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=moments)
