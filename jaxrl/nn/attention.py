"""Attention arithmetic of the decoder: RoPE (frequencies from ``model_config.rope_inv_freq``),
and grouped-query softmax attention of T queries to S slots, block by block for long T and as
products and sums for one query (a decode step); on an NVIDIA GPU, cuDNN's fused attention
(``jax.nn.dot_product_attention``) where it takes the call (``fused_implementation``).

Pure functions of arrays; ``layers.Attention`` projects, caches and calls them. Keys arrive as
[B, K, E, S] and values as [B, K, S, E], the KV cache's layout (``jaxrl.nn.kv_cache``).

Which slots a query sees comes as ``kv_valid_BxS``: booleans (a padded row: one sequence, the
slots it marks valid) or integer segment ids (a packed row, ``jaxrl.rl.packing``: several
sequences side by side, 0 for padding). With segments a query sees the slots up to its own that
belong to its own segment; queries and keys are then the same T slots (no cache).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from jaxrl.types import Array

log = logging.getLogger(__name__)


def rope(
  x_BxTxHxE: Array, positions_BxT: Array, inv_freq_half: Array, *, concat_halves: bool = True
) -> Array:
  """Rotary embedding in HF's rotate-half layout (first and second halves of head_dim pair up):
  [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], HF's products and sums in HF's order.

  Two ways to lay the same arithmetic out. ``concat_halves``: cut x into halves and concatenate
  the rotated ones (HF's code). Otherwise over the full width: the halves swapped by a reverse
  and a select between the two halves' expressions. XLA CPU fuses the rotation into its
  consumers (the cache write, the scores), where a concatenate costs a branch per element: the
  select form runs the decode step's rotations ~2x faster and gives the same forward values
  here, so the sampler uses it. Its gradient rounds differently in the last bits (FMA
  contraction), which moved the golden train step's grad_norm by 0.5%, so what is
  differentiated keeps the concatenate.
  """
  half = x_BxTxHxE.shape[-1] // 2
  angles_BxTxhalf = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_half
  cos = jnp.cos(angles_BxTxhalf)[:, :, None, :]
  sin = jnp.sin(angles_BxTxhalf)[:, :, None, :]
  x32 = x_BxTxHxE.astype(jnp.float32)
  if concat_halves:
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  else:
    cos, sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
    swapped = jnp.flip(x32.reshape(*x32.shape[:-1], 2, half), axis=-2).reshape(x32.shape)
    first_half_E = jnp.arange(2 * half) < half
    out = jnp.where(first_half_E, x32 * cos - swapped * sin, x32 * cos + swapped * sin)
  return out.astype(x_BxTxHxE.dtype)


def is_segments(kv_valid_BxS: Array) -> bool:
  """Whether ``kv_valid_BxS`` holds segment ids (integers) rather than validity (booleans)."""
  return jnp.issubdtype(kv_valid_BxS.dtype, jnp.integer)


def _visible_BxTxS(kv_valid_BxS: Array, q_segment_BxT: Array | None) -> Array:
  """Which slots each query may see apart from causality: the valid ones (booleans), or those of
  its own segment (segment ids; padding, segment 0, sees none and is seen by none)."""
  if q_segment_BxT is None:
    return kv_valid_BxS[:, None, :].astype(bool)
  k_segment_Bx1xS = kv_valid_BxS[:, None, :]
  return (q_segment_BxT[:, :, None] == k_segment_Bx1xS) & (k_segment_Bx1xS > 0)


def _attend(
  q_BxTxKxAxE: Array,
  k_BxKxExS: Array,
  v_BxKxSxE: Array,
  kv_valid_BxS: Array,
  first_slot,
  q_segment_BxT: Array | None = None,
) -> Array:
  """Softmax attention of T queries at slots first_slot..first_slot+T-1 to the S slots: a query
  sees the valid slots up to its own (with ``q_segment_BxT``, the queries' segment ids, those of
  its own segment: ``kv_valid_BxS`` then holds the slots' segment ids). Scores and softmax in
  float32. Returns [B, T, K, R, E]."""
  t, s = q_BxTxKxAxE.shape[1], k_BxKxExS.shape[3]
  if t == 1:
    scores = _one_query_scores(q_BxTxKxAxE, k_BxKxExS)
  else:
    scores = jnp.einsum(
      "btkae,bkes->bkats", q_BxTxKxAxE, k_BxKxExS, preferred_element_type=jnp.float32
    )
  scores = scores * (q_BxTxKxAxE.shape[-1] ** -0.5)
  query_slot_T = first_slot + jnp.arange(t)
  causal_TxS = jnp.arange(s)[None, :] <= query_slot_T[:, None]
  allowed_BxTxS = causal_TxS[None] & _visible_BxTxS(kv_valid_BxS, q_segment_BxT)
  # finfo.min, not -inf: a query with no visible slot (a pad) gets a uniform row, never NaN.
  scores = jnp.where(allowed_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  if t == 1:
    return _one_query_mix(probs, v_BxKxSxE)
  return jnp.einsum("bkats,bkse->btkae", probs.astype(v_BxKxSxE.dtype), v_BxKxSxE)


# A decode step has one query per row: the attention matmuls are then [A, E] x [E, S] per (b, k),
# a batch of few-row dots that XLA CPU runs one small GEMM call at a time (~3.5 us each: 0.9 ms
# per layer for 64 rows; as einsums inside the decode loop the 5M sampler's step took 2x as long).
# The same sums as broadcast products and one reduction are each a single vectorised loop, over a
# major axis of the cache (keys [.., E, S], values [.., S, E]: see ``KVCache``). Both in float32.


def _one_query_scores(q_Bx1xKxAxE: Array, k_BxKxExS: Array) -> Array:
  """``einsum("btkae,bkes->bkats")`` for T = 1, as products and a sum over e: [B, K, A, 1, S]."""
  q_BxKxAxEx1 = q_Bx1xKxAxE[:, 0, :, :, :, None].astype(jnp.float32)
  k_BxKx1xExS = k_BxKxExS[:, :, None].astype(jnp.float32)
  return jnp.sum(q_BxKxAxEx1 * k_BxKx1xExS, axis=-2)[:, :, :, None, :]


def _one_query_mix(probs_BxKxAx1xS: Array, v_BxKxSxE: Array) -> Array:
  """``einsum("bkats,bkse->btkae")`` for T = 1, as products and a sum over s: [B, 1, K, A, E]."""
  p_BxKxAxSx1 = probs_BxKxAx1xS[:, :, :, 0, :, None]
  v_BxKx1xSxE = v_BxKxSxE[:, :, None].astype(jnp.float32)
  out_BxKxAxE = jnp.sum(p_BxKxAxSx1 * v_BxKx1xSxE, axis=-2).astype(v_BxKxSxE.dtype)
  return out_BxKxAxE[:, None]


def block_size(t: int, block: int) -> int:
  """Queries per block of ``attention`` for T queries at most ``block`` at a time: T itself (one
  pass) or, with n = ceil(T / block) blocks, ceil(T / n)."""
  if t <= block:
    return t
  blocks = -(-t // block)
  return -(-t // blocks)


def attention(
  q_BxTxKxAxE: Array, k_BxKxExS: Array, v_BxKxSxE: Array, kv_valid_BxS: Array, start, block: int
) -> Array:
  """Grouped-query attention of T queries (slots start..start+T-1) to S slots, at most ``block``
  queries at a time: [B, T, K, R, E].

  Each block attends to all S slots with the full softmax, so every output row is computed as in
  one pass (the same einsums on a slice of the queries). Blocks run in sequence (``lax.map``) and
  each is rematerialised, so the forward keeps only its output and the backward recomputes one
  block's [B, H, Z, S] scores at a time: memory O(block · S) instead of O(T · S). The n blocks
  are of equal size Z (``block_size``), so fewer than n queries are padded (blocks of ``block``
  would pad T = 544 to 1,024 at block 512: almost twice the attention's work). Where cuDNN's
  fused attention takes the call (``fused_implementation``: an NVIDIA GPU, bf16/fp16, queries
  from slot 0) it runs instead, in one pass: it never holds the scores.

  Integer ``kv_valid_BxS`` are segment ids of the T slots (packed rows, S = T, ``start`` 0): a
  query attends within its own segment (``_visible_BxTxS``).
  """
  b, t = q_BxTxKxAxE.shape[:2]
  q_segment_BxT = None
  if is_segments(kv_valid_BxS):
    if not (_is_zero(start) and kv_valid_BxS.shape[1] == t):
      raise ValueError("segment ids need queries from slot 0 over their own T slots (no cache)")
    q_segment_BxT = kv_valid_BxS
  implementation = fused_implementation(q_BxTxKxAxE, k_BxKxExS, start)
  if implementation is not None:
    try:
      return fused_attention(q_BxTxKxAxE, k_BxKxExS, v_BxKxSxE, kv_valid_BxS, implementation)
    except (NotImplementedError, ValueError, RuntimeError) as e:
      # jax checks what cuDNN takes when it traces the call; a limit this jax has and
      # ``fused_implementation`` does not know falls back here, said once per shape.
      _warn_fallback(f"{implementation} attention refused {q_BxTxKxAxE.shape}: {e}")
  block = block_size(t, block)
  if block == t:
    return _attend(q_BxTxKxAxE, k_BxKxExS, v_BxKxSxE, kv_valid_BxS, start, q_segment_BxT)
  n = -(-t // block)
  pad = n * block - t  # padded queries see the same slots as any query; their rows are dropped
  q = jnp.pad(q_BxTxKxAxE, ((0, 0), (0, pad)) + ((0, 0),) * 3)
  q_YxBxZxKxAxE = jnp.swapaxes(q.reshape(b, n, block, *q.shape[2:]), 0, 1)
  xs = (q_YxBxZxKxAxE, jnp.arange(n))
  if q_segment_BxT is not None:  # each block's queries' segment ids, laid out as the queries
    xs += (jnp.swapaxes(jnp.pad(q_segment_BxT, ((0, 0), (0, pad))).reshape(b, n, block), 0, 1),)

  @jax.checkpoint
  def one_block(q_BxZxKxAxE, k, v, kv_valid, first_slot, *q_segment_BxZ):
    return _attend(q_BxZxKxAxE, k, v, kv_valid, first_slot, *q_segment_BxZ)

  out_YxBxZxKxAxE = jax.lax.map(
    lambda qi: one_block(qi[0], k_BxKxExS, v_BxKxSxE, kv_valid_BxS, start + qi[1] * block, *qi[2:]),
    xs,
  )
  out = jnp.swapaxes(out_YxBxZxKxAxE, 0, 1).reshape(b, n * block, *q.shape[2:])
  return out[:, :t]


# cuDNN's fused (flash) attention never holds the [B, H, T, S] scores (what the blocks above are
# for) and skips the slot blocks above the diagonal. jax 0.10's checks of what it takes
# (``check_layout`` and ``check_is_flash_attention`` in its cudnn/fused_attention_stablehlo.py):
# float16/bfloat16 only, head dim a multiple of 8 and at most 128 (256 from Hopper on: 128 holds
# everywhere), even T and S when a mask (which it receives as a bias) is differentiated. Its
# causal mask lets query t see slots <= t, so only queries from slot 0 over their own T slots fit
# (the training forward, a prefill); a decode step (T = 1 after a cache) keeps the products and
# sums above.
_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
_FUSED_MAX_HEAD_DIM = 128


def _is_zero(start) -> bool:
  return isinstance(start, int) and start == 0


@functools.cache
def _on_cuda() -> bool:
  """Whether JAX's default backend is an NVIDIA GPU: cuDNN exists there only (a ROCm GPU's
  backend is "gpu" too, but has no "cuda" devices)."""
  if jax.default_backend() != "gpu":
    return False
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


def fused_implementation(q_BxTxKxAxE: Array, k_BxKxExS: Array, start) -> str | None:
  """``jax.nn.dot_product_attention``'s implementation for this call ("cudnn" on an NVIDIA GPU
  when cuDNN takes it), or None: the blocked path (CPUs, float32, a decode step)."""
  t, e = q_BxTxKxAxE.shape[1], q_BxTxKxAxE.shape[-1]
  from_slot_zero = _is_zero(start) and k_BxKxExS.shape[-1] == t
  supported = (
    from_slot_zero
    and t > 1
    and t % 2 == 0
    and q_BxTxKxAxE.dtype in _FUSED_DTYPES
    and e % 8 == 0
    and e <= _FUSED_MAX_HEAD_DIM
  )
  return "cudnn" if supported and _on_cuda() else None


@functools.cache
def _warn_fallback(message: str) -> None:
  log.warning("%s; blocked attention instead", message)


def fused_attention(
  q_BxTxKxAxE: Array, k_BxKxExS: Array, v_BxKxSxE: Array, kv_valid_BxS: Array, implementation: str
) -> Array:
  """``attention`` of T queries from slot 0 to their own T slots (S = T) as one
  ``jax.nn.dot_product_attention`` call: [B, T, K, A, E].

  Padding is a boolean mask [B, 1, T, S] (slots the row marks valid), causality ``is_causal``:
  rows are padded on the left (prompts) and the right (responses), which the call's
  ``query_seq_lengths`` / ``key_value_seq_lengths`` (valid prefixes) cannot say; nor can they say
  segments (packed rows): with segment ids the mask holds, per query, the slots of its segment. Query heads
  k·A + a share kv head k, HF's grouping and the call's. A query that sees no valid slot (a left
  pad) gets some finite mix; its row is never read (no valid query attends to a pad, the loss
  masks pads)."""
  b, t, k, a, e = q_BxTxKxAxE.shape
  q_BxTxHxE = q_BxTxKxAxE.reshape(b, t, k * a, e)
  k_BxSxKxE = jnp.transpose(k_BxKxExS, (0, 3, 1, 2))
  v_BxSxKxE = jnp.swapaxes(v_BxKxSxE, 1, 2)
  s = k_BxSxKxE.shape[1]
  # cuDNN takes the mask as an additive bias at the full [T, S] (broadcast, not [B, 1, 1, S]);
  # boolean, so that jax (from 0.11) skips the bias gradient nobody can ask for
  if is_segments(kv_valid_BxS):
    valid_Bx1xTxS = _visible_BxTxS(kv_valid_BxS, kv_valid_BxS)[:, None]
  else:
    valid_Bx1xTxS = jnp.broadcast_to(kv_valid_BxS.astype(bool)[:, None, None, :], (b, 1, t, s))
  out_BxTxHxE = jax.nn.dot_product_attention(
    q_BxTxHxE,
    k_BxSxKxE,
    v_BxSxKxE,
    mask=valid_Bx1xTxS,
    is_causal=True,
    implementation=implementation,
  )
  return out_BxTxHxE.reshape(b, t, k, a, e)
