"""Packed updates: the sequences of a micro-batch side by side in a few [rows, T] buffers.

A padded update runs every row at its full P + N positions, padding included. Packed, the model
reads each sequence's real tokens only (its prompt's and its response's, without their padding),
several sequences to a buffer row: each carries a segment id (1, 2, …; 0 is padding) that keeps
attention inside its sequence (``jaxrl.nn.attention``) and positions restarting at 0, so RoPE sees
what it sees in the padded row. The buffer length T is P + N, so a sequence as long as the whole
budget fills a buffer by itself; no sequence is ever split.

The host decides the layout (``plan``): per micro-batch, first-fit decreasing of the sequences'
lengths into buffers (``first_fit_decreasing``), and the number of buffer rows rounded up to one
of a few buckets (``bucket``), so the update compiles once per bucket at most. It hands the
update two numbers per row (its buffer and its offset there, ``Packing``); the rows are split
into mini- and micro-batches with everything else, so the split acts on sequences and the step's
semantics do not depend on packing. On the device, ``destinations`` places each row's tokens and
``rl.scoring`` reads each response token's log-prob back into the padded [R, N] layout, where the
loss (every formula of docs/algorithms.md §1-§11, unchanged) reads it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrl.rl.sections import LossSection
from jaxrl.types import Array, Rollouts, pytree_dataclass, static_field


@pytree_dataclass
class Packing:
  """Where each row of a step's batch sits in its micro-batch's packed buffers.

  ``rows`` (static: one program per value) is how many buffer rows each micro-batch has."""

  slot_R: Array  # i32: the buffer row of the row's sequence in its micro-batch; -1: not packed
  offset_R: Array  # i32: where in that buffer row the sequence starts
  rows: int = static_field(default=1)


def first_fit_decreasing(lengths_K, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Pack K items of the given lengths into bins of ``capacity``: (bin_K, offset_K, bins).

  Longest first, each into the first bin it fits in, at that bin's end; an item of length 0
  gets bin -1 (nothing to place). Deterministic: ties keep the items' order."""
  lengths_K = np.asarray(lengths_K, np.int64)
  if np.any(lengths_K > capacity) or np.any(lengths_K < 0):
    raise ValueError(f"lengths must lie in [0, {capacity}], got {lengths_K.tolist()}")
  bin_K = np.full(lengths_K.shape, -1, np.int32)
  offset_K = np.zeros(lengths_K.shape, np.int32)
  used = []  # used[b]: positions taken in bin b
  for k in np.argsort(-lengths_K, kind="stable"):
    if lengths_K[k] == 0:
      continue
    b = next((b for b, u in enumerate(used) if u + lengths_K[k] <= capacity), len(used))
    if b == len(used):
      used.append(0)
    bin_K[k], offset_K[k] = b, used[b]
    used[b] += lengths_K[k]
  return bin_K, offset_K, len(used)


def bucket(needed: int, rows: int, buckets: int) -> int:
  """The fewest buffer rows among ceil(rows·k / buckets), k = 1..buckets, that hold ``needed``:
  at most ``buckets`` values for a micro-batch of ``rows`` rows (each sequence fits a buffer
  row, so ``needed`` <= ``rows``)."""
  if not 0 <= needed <= rows:
    raise ValueError(f"{needed} buffer rows needed for {rows} sequences")
  return next(
    -(-rows * k // buckets) for k in range(1, buckets + 1) if -(-rows * k // buckets) >= needed
  )


def micro_batch_ids(rows: int, mini_batches: int, micro_batches: int) -> np.ndarray:
  """The micro-batch each of ``rows`` rows lands in (mini-batch-major), as ``rl.micro_batches``
  splits them: row r goes to mini-batch r % m at index r // m, and index i of a mini-batch to its
  micro-batch i % μ (strided splits, ``split_micro``)."""
  r_R = np.arange(rows)
  return (r_R % mini_batches) * micro_batches + (r_R // mini_batches) % micro_batches


def sequence_lengths(prompt_mask_RxP, mask_RxN) -> np.ndarray:
  """Tokens each row's sequence takes packed: its prompt's and its response's real tokens, 0 for
  a row without a response token (nothing of it is read)."""
  prompt_R = np.sum(np.asarray(prompt_mask_RxP, bool), axis=1)
  response_R = np.sum(np.asarray(mask_RxN, bool), axis=1)
  if np.any((response_R > 0) & (prompt_R == 0)):
    # Its first response token would have no token before it to be predicted from.
    raise ValueError("a row with a response needs at least one prompt token")
  return np.where(response_R > 0, prompt_R + response_R, 0).astype(np.int64)


def plan(prompt_mask_RxP, mask_RxN, mini_batches: int, micro_batches: int, buckets: int) -> Packing:
  """Host side: each micro-batch's sequences packed first-fit decreasing into buffers of P + N,
  the buffer rows the fullest micro-batch needs rounded up to a bucket (``bucket``)."""
  prompt_mask_RxP, mask_RxN = np.asarray(prompt_mask_RxP), np.asarray(mask_RxN)
  r = prompt_mask_RxP.shape[0]
  capacity = prompt_mask_RxP.shape[1] + mask_RxN.shape[1]
  lengths_R = sequence_lengths(prompt_mask_RxP, mask_RxN)
  ids_R = micro_batch_ids(r, mini_batches, micro_batches)
  slot_R = np.full(r, -1, np.int32)
  offset_R = np.zeros(r, np.int32)
  needed = 0
  for m in range(mini_batches * micro_batches):
    in_m = ids_R == m
    slot_R[in_m], offset_R[in_m], bins = first_fit_decreasing(lengths_R[in_m], capacity)
    needed = max(needed, bins)
  per_micro = r // (mini_batches * micro_batches)
  return Packing(slot_R, offset_R, rows=bucket(needed, per_micro, buckets))


def for_update(loss: LossSection, batch: Rollouts) -> Packing | None:
  """The packed layout of a (phase's) update of ``batch`` when ``loss.packing`` is on, else None
  (the padded update)."""
  if not loss.packing:
    return None
  return plan(
    batch.prompt_mask_RxP, batch.mask_RxN, loss.mini_batches, loss.micro_batches, loss.pack_buckets
  )


def metrics(pack: Packing, prompt_mask_RxP, mask_RxN, micro_batches_in_all: int) -> dict:
  """What packing did to a step's update of ``micro_batches_in_all`` micro-batches (over all its
  mini-batches): the buffer rows of each (``train_pack_rows``) and the share of the buffers'
  positions that hold a token (``train_pack_fill``)."""
  t = np.shape(prompt_mask_RxP)[1] + np.shape(mask_RxN)[1]
  used = float(np.sum(sequence_lengths(prompt_mask_RxP, mask_RxN)))
  return {
    "train_pack_rows": float(pack.rows),
    "train_pack_fill": used / (micro_batches_in_all * pack.rows * t),
  }


def largest(rows: int, mini_batches: int, micro_batches: int) -> Packing:
  """The layout with the most buffer rows (one per sequence): what ``--plan`` sizes."""
  per_micro = rows // (mini_batches * micro_batches)
  return Packing(
    np.asarray(np.arange(rows) // (mini_batches * micro_batches), np.int32),
    np.zeros(rows, np.int32),
    rows=per_micro,
  )


def destinations(valid_XxT: Array, slot_X: Array, offset_X: Array, rows: int) -> Array:
  """Device side: the flat index into the [rows · T] buffers of each of X rows' positions
  (prompt ++ response, T = P + N), ``rows`` · T (out of range: dropped by a scatter) for padding
  and for rows not packed. A row's real tokens keep their order, from its offset on."""
  t = valid_XxT.shape[1]
  order_XxT = jnp.cumsum(valid_XxT.astype(jnp.int32), axis=1) - 1
  placed_XxT = valid_XxT & (slot_X >= 0)[:, None]
  index_XxT = slot_X[:, None] * t + offset_X[:, None] + order_XxT
  return jnp.where(placed_XxT, index_XxT, rows * t)


def scatter(values_XxT: Array, dest_XxT: Array, rows: int) -> Array:
  """``values_XxT`` placed at ``dest_XxT`` in [rows, T] buffers of zeros (indices out of range
  dropped)."""
  t = values_XxT.shape[1]
  flat = jnp.zeros((rows * t,), values_XxT.dtype)
  return flat.at[dest_XxT.reshape(-1)].set(values_XxT.reshape(-1), mode="drop").reshape(rows, t)
