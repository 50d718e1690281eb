"""Pytrees that cross jit boundaries, and the shape-letter legend used in names across jaxrl.

Shape letters (suffixes such as ``logp_RxT``):
  B  questions in a step            R  rollouts in a step (R = sum of G_i, static)
  G  rollouts of one question       Q  questions of a dataset split (|D|)
  T  tokens (response, or full sequence where stated)
  P  prompt tokens (left-padded)    N  newly generated tokens
  S  KV-cache slots (P + N)         L  decoder layers
  D  model width                    F  feed-forward width
  H  attention heads                K  key/value heads       E  head_dim
  V  vocabulary                     C  chunk of tokens (fused log-probs)

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
class RolloutBatch:
  """One step's rollouts, flattened over questions: row r belongs to group ``group_ids_R[r]``."""

  prompt_ids_RxP: Array  # i32, left-padded
  prompt_mask_RxP: Array  # bool
  response_ids_RxN: Array  # i32, right-padded after EOS
  response_mask_RxN: Array  # bool, True on generated tokens up to and including EOS
  old_logp_RxN: Array  # f32, sampled-token log-probs at tau under the sampling params
  entropy_RxN: Array  # f32, full-vocabulary entropy at tau under the sampling params
  group_ids_R: Array  # i32 in [0, B)


@pytree_dataclass
class QuestionStats:
  """Per-question statistics (ALGORITHMS.md §2), as columns indexed by question id."""

  seen_Q: Array  # i32 rollouts so far
  correct_Q: Array  # i32 rollouts with reward > 0
  reward_sum_Q: Array  # f32
  last_step_Q: Array  # i32 last step the question was sampled, -1 = never
