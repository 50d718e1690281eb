"""EEPO's forgetting step (docs/algorithms.md §5): θ' = θ + η·∇L on the rollout copy, one plain
SGD ascent step on the unlearning objective L of the stage-1 responses, with no optimizer state.

A pure function of arrays, jitted by ``rl.programs``; ``rollout.eepo`` runs it between the two
stages of a step's rollouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.nn import lora
from jaxrl.nn.logprobs import fused_log1m_p
from jaxrl.rl import losses
from jaxrl.rl.micro_batches import accumulate
from jaxrl.rl.packing import Packing
from jaxrl.rl.scoring import packed_token_values, response_hidden
from jaxrl.rl.step import grad_of_part
from jaxrl.types import Array, pytree_dataclass


@pytree_dataclass
class ForgetRows:
  """The per-row inputs of EEPO's forgetting step (the stage-1 responses), split along R into
  micro-batches (``split_micro``); each field means what ``rl.step.UpdateRows``' of its name
  means, and L reads the loss mask's tokens only (§11)."""

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
  (``split_micro``) in sequence, as ``rl_update``'s micro-batches: the same θ' with the
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
  value, grads = _forget_grads(grad_of_part(objective, trainable), params, rows, micro)
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
  """(L, ∇L) at ``params`` (``part_grad``: ``grad_of_part`` of the objective), over ``micro``
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
