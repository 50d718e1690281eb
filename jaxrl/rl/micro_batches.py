"""Row chunks: a batch's rows split along R into strided mini- and micro-batches, and put back.

The update, the π_old rescoring and EEPO's forgetting step run their rows in chunks in sequence
(``lax.map``, ``lax.scan``) to bound activation memory; these functions say how the rows are split
(every micro-th row to one chunk, so each chunk stays data-parallel), merged back into row order,
and summed over the chunks (``accumulate``). ``rl.packing`` plans its packed layout for the same
chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_micro(tree, micro: int):
  """[R, ...] → [micro, R/micro, ...] taking every micro-th row (row r goes to chunk r % micro).

  Rows are sharded over the data axes in contiguous blocks, one per device; a strided split gives
  every chunk an equal share of every device's block, so each chunk stays data-parallel. (A
  contiguous split would put a whole chunk on 1/micro of the devices, which then hold its
  activations alone: up to micro times the memory per device, as ``--plan`` shows.)
  """
  return jax.tree.map(
    lambda x: jnp.swapaxes(x.reshape(x.shape[0] // micro, micro, *x.shape[1:]), 0, 1), tree
  )


def merge_micro(x_MxXx):
  """Inverse of ``split_micro`` for one array: [micro, R/micro, ...] → [R, ...]."""
  return jnp.swapaxes(x_MxXx, 0, 1).reshape(-1, *x_MxXx.shape[2:])


def accumulate(value_and_grad, rows, micro: int):
  """Σ of ``value_and_grad(chunk)`` (any pytree: values, metrics, gradients) over ``micro``
  strided row chunks (``split_micro``), in sequence (``lax.scan``): the sum over all rows with
  the activation memory of one chunk. The first chunk seeds the carry; ``micro`` = 1 is one call."""
  if micro == 1:
    return value_and_grad(rows)
  chunks = split_micro(rows, micro)
  first = value_and_grad(jax.tree.map(lambda x: x[0], chunks))

  def body(carry, chunk):
    return jax.tree.map(jnp.add, carry, value_and_grad(chunk)), None

  total, _ = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], chunks))
  return total


def packed_by_micro_batches(fn, rows, mini_batches: int, micro_batches: int):
  """``fn(chunk)`` (a pytree of [X, ...]) over the micro-batches of ``rows`` (every mini-batch's,
  ``split_micro`` within ``split_micro``), in sequence (``lax.map``), put back in row order: a
  forward over the chunks ``rl.packing.plan`` packs for these mini- and micro-batches."""
  m1, m2 = mini_batches, micro_batches
  nested = jax.tree.map(jax.vmap(lambda x: split_micro(x, m2)), split_micro(rows, m1))
  flat = jax.tree.map(lambda x: x.reshape(m1 * m2, *x.shape[2:]), nested)

  def merge(out_CxXx):
    out_M1xM2xXx = out_CxXx.reshape(m1, m2, *out_CxXx.shape[1:])
    return merge_micro(jax.vmap(merge_micro)(out_M1xM2xXx))

  return jax.tree.map(merge, jax.lax.map(fn, flat))
