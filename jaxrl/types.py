"""Pytrees that cross jit boundaries, and the shape-letter legend used in names across jaxrl.

Shape letters (suffixes such as ``tokens_RxN``), each with one meaning:
  B  questions in a step            R  rollouts in a step (R = sum of G_i, static)
  G  rollouts of one question       Q  questions of a dataset split (|D|)
  T  tokens of a sequence (response, or prompt + response where stated)
  P  prompt tokens (left-padded)    N  newly generated (response) tokens
  S  KV-cache slots (P + N)         L  decoder layers
  D  model width                    F  feed-forward width
  H  attention heads                K  key/value heads
  A  query heads per key/value head (H / K)                 E  head_dim
  V  vocabulary
  U  tokens flattened over rows (B·T)   C  tokens in one fused log-prob chunk   J  chunks (U / C)
  M  sequential row chunks (micro-batches)                  X  rows in one such chunk (R / M)
  W  a controller's window (ring buffer of the last W values)
  Z  queries in one attention block                         Y  attention blocks (T / Z)
  I  entries one sampling search runs over (a CDF block, top-k candidates)
  O  blocks of the vocabulary in the sampler's two-level CDF (V / I)
  b  rows of a compacted decode batch (a bucket of the live rollouts: ``rollout.compaction``)
In the model's code (``jaxrl.nn``) and of packed buffers (``jaxrl.rl.packing``), B is any batch of
rows: rollouts, or buffer rows that each hold several sequences side by side (T = P + N slots).

Every pytree here is a frozen dataclass registered with ``jax.tree_util.register_dataclass``;
update with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

Array = jax.Array
PyTree = Any


def pytree_dataclass(cls):
  """Frozen dataclass registered as a pytree; fields marked ``static`` go into the treedef."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  data, meta = [], []
  for f in dataclasses.fields(cls):
    (meta if f.metadata.get("static", False) else data).append(f.name)
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static_field(**kwargs):
  """A dataclass field that is part of the treedef (hashable, not traced)."""
  return dataclasses.field(metadata={"static": True}, **kwargs)


@pytree_dataclass
class TrainState:
  """Everything the jitted train step reads and writes."""

  step: Array  # i32[] optimizer updates so far
  params: PyTree  # nnx.State of nnx.Param leaves
  opt_state: PyTree  # optax state


@pytree_dataclass
class Rollouts:
  """One step's rollouts from the engine to the update. Row r answers question ``group_ids_R[r]``
  (an index into the step's B questions); responses are right-padded after EOS.

  Engines return every field up to ``finished_R`` (the JAX sampler also its full-softmax ℓ under
  the params it sampled with, as ``prox_logp_RxN``; multi-turn engines the turn counts and the
  environment's trajectory reward, if any, as ``rewards_R``); the collector sets the proximal
  log-probs and the loop the verifier's rewards (``dataclasses.replace``) before the update,
  which reads both.
  The three log-probs of docs/algorithms.md §9 are ℓ_μ (``behaviour_logp_RxN``), ℓ_prox
  (``prox_logp_RxN``) and ℓ (the update's own forward).

  Two masks (docs/algorithms.md §11): ``mask_RxN``, the response mask, marks every position that
  holds a token, the model's or an environment's (what the forward attends to, what a response's
  length counts); ``loss_mask_RxN`` marks the model's own sampled tokens, the only ones any loss,
  weight or entropy statistic reads. A single-turn response has no environment tokens: the two are
  equal. Per-token values (log-probs, entropies) at environment positions are never read."""

  prompt_ids_RxP: Array  # i32, left-padded
  prompt_mask_RxP: Array  # bool
  tokens_RxN: Array  # i32 response tokens, pad_id after EOS
  mask_RxN: Array  # bool, True on every response token (model or environment), EOS included
  loss_mask_RxN: (
    Array  # bool, True on the model's sampled tokens only (⊆ mask_RxN; docs/algorithms.md §11)
  )
  # f32 ℓ_μ: the token's log-prob under the distribution the engine drew it from, softmax(z/τ)
  # restricted to the top-p nucleus and renormalised (docs/algorithms.md §9.1); 0 off the loss mask
  behaviour_logp_RxN: Array
  entropy_RxN: Array  # f32, entropy of the full softmax(z/τ), 0 off the response mask
  lengths_R: Array  # i32, generated tokens (EOS included)
  group_ids_R: Array  # i32 in [0, B)
  finished_R: Array  # bool, the row emitted EOS
  prox_logp_RxN: Array | None = None  # f32 ℓ_prox: under the params the update starts from
  rewards_R: Array | None = None  # f32, added after verification
  # Multi-turn engines (docs/algorithms.md §11): i32 model turns per row (turns in which it sampled
  # a token) and observations the environment appended; None for single-turn rollouts
  turns_R: Array | None = None
  tool_calls_R: Array | None = None


@pytree_dataclass
class QuestionStats:
  """Per-question statistics (docs/algorithms.md §2), as columns indexed by question id."""

  seen_Q: Array  # i32 rollouts so far
  correct_Q: Array  # i32 rollouts with reward > 0
  reward_sum_Q: Array  # f32
  last_step_Q: Array  # i32 last step the question was sampled, -1 = never
