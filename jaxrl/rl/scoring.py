"""Scoring responses: the log-probs, entropies or any fused per-token values of response tokens
under given params, from one forward over prompt ++ response.

The padded forward (``logp_responses``) runs the [R, P + N] rows as they are; the packed one
(``packed_token_values``, the layout ``rl.packing`` plans) runs only their real tokens, packed
into fewer buffers, and reads the values back into the padded [R, N] layout: the same values up
to rounding. ``logp_responses_chunked`` scores a whole step's rows in sequential row chunks
(``rl.micro_batches``). The update, the π_old rescoring and EEPO's forgetting step all score
through these functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.nn import model
from jaxrl.nn.logprobs import fused_logprobs_entropy
from jaxrl.rl import packing
from jaxrl.rl.micro_batches import merge_micro, packed_by_micro_batches, split_micro
from jaxrl.rl.packing import Packing
from jaxrl.types import Array


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
    return packed_by_micro_batches(
      lambda chunk: packed_token_values(graphdef, params, *chunk, pack.rows, fused),
      (*rows, pack.slot_R, pack.offset_R),
      1,
      micro,
    )
  if micro == 1:
    return logp_responses(graphdef, params, *rows, tau, chunk_size)
  logp_MxXxN, ent_MxXxN = jax.lax.map(
    lambda chunk: logp_responses(graphdef, params, *chunk, tau, chunk_size),
    split_micro(rows, micro),
  )
  return merge_micro(logp_MxXxN), merge_micro(ent_MxXxN)
