"""The decoder's KV cache: one slot per sequence position, keys stored transposed for decoding.

``layers.Attention`` writes a step's keys and values (``KVCache.write``) and reads a layer's
(``KVCache.layer``); the sampler builds, copies, grows and compacts caches (``model.init_cache``,
``KVCache.repeat_rows``, ``KVCache.pad_slots``, ``KVCache.take_rows``). The layout follows
``ModelConfig.scan_layers``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.types import Array, pytree_dataclass


def repeat_by_counts(x: Array, counts_B: Array, rows: int, axis: int = 0) -> Array:
  """Entry b of ``axis`` repeated counts_B[b] times, ``rows`` entries in all (a static count, so
  new counts with the same total reuse the compilation): prompts and caches to rollout rows."""
  return jnp.repeat(x, counts_B, axis=axis, total_repeat_length=rows)


@pytree_dataclass
class KVCache:
  """Keys/values of every layer; slot s holds sequence position s of the (left-padded) batch.

  Heads come before slots so that both attention products read a layer's cache as it lies (batch
  dims b, k leading); a [.., S, K, E] layout made XLA transpose every layer's cache each step.
  Keys are stored transposed, [B, K, E, S]: a decode step's scores q·k then sum E vectors S slots
  wide, where [B, K, S, E] made them S sums over a 32-wide minor axis (0.95 -> 0.3 ms per layer at
  the 5M sampler benchmark's 64 rows). Values stay [B, K, S, E]: the mix sums over s, a major axis.
  Loop mode keeps one array per layer: slicing a layer out of a stacked [L, ...] array copies it
  (2 x 4 MB per layer and decode step at the 5M benchmark's 64 rows, ~15% of the step).
  """

  k: Array | tuple[Array, ...]  # [L, B, K, E, S] (scan mode) or L x [B, K, E, S] (loop mode)
  v: Array | tuple[Array, ...]  # [L, B, K, S, E] (scan mode) or L x [B, K, S, E] (loop mode)

  def write(self, layer, start, k_BxTxKxE: Array, v_BxTxKxE: Array) -> KVCache:
    """Store T new keys/values of ``layer`` (int or traced) at slots start..start+T-1, in place."""

    def put(cache, new, at):  # ``new`` in the cache's layout, written from index ``at`` on
      per_layer = isinstance(cache, tuple)
      new = new.astype((cache[0] if per_layer else cache).dtype)
      if per_layer:
        updated = jax.lax.dynamic_update_slice(cache[layer], new, at)
        return cache[:layer] + (updated,) + cache[layer + 1 :]
      return jax.lax.dynamic_update_slice(cache, new[None], (layer, *at))

    return KVCache(
      k=put(self.k, keys_layout(k_BxTxKxE), (0, 0, 0, start)),
      v=put(self.v, jnp.swapaxes(v_BxTxKxE, 1, 2), (0, 0, start, 0)),
    )

  def repeat_rows(self, counts_B: Array, rows: int) -> KVCache:
    """Row b repeated counts_B[b] times (``rows`` rows in all, a static count as in ``jnp.repeat``'s
    ``total_repeat_length``): a cache filled once per distinct prompt, copied to each of its
    rollouts."""

    def repeat(cache):
      batch_axis = cache.ndim - 4  # 0 for one layer's [B, ...], 1 for the stacked [L, B, ...]
      return repeat_by_counts(cache, counts_B, rows, axis=batch_axis)

    return self._map(repeat, repeat)

  def take_rows(self, rows_b: Array) -> KVCache:
    """The rows ``rows_b`` (indices), in that order: the sampler's compaction to the live rows."""

    def take(cache):
      return jnp.take(cache, rows_b, axis=cache.ndim - 4)

    return self._map(take, take)

  @property
  def slots(self) -> int:
    """The number of slots (positions) the cache holds."""
    return (self.k[0] if isinstance(self.k, tuple) else self.k).shape[-1]

  def pad_slots(self, slots: int) -> KVCache:
    """The cache with ``slots`` slots: the new ones (at the end) zero, so unwritten."""

    def pad(axis):
      def grow(cache):
        widths = [(0, 0)] * cache.ndim
        widths[axis] = (0, slots - cache.shape[axis])
        return jnp.pad(cache, widths)

      return grow

    return self._map(pad(-1), pad(-2))  # keys [.., E, S], values [.., S, E]

  def _map(self, on_keys, on_values) -> KVCache:
    """Apply ``on_keys`` to every keys array and ``on_values`` to every values array."""

    def each(fn, caches):
      return tuple(fn(c) for c in caches) if isinstance(caches, tuple) else fn(caches)

    return KVCache(k=each(on_keys, self.k), v=each(on_values, self.v))

  def layer(self, layer) -> tuple[Array, Array]:
    """(k_BxKxExS, v_BxKxSxE) of one layer."""
    if isinstance(self.k, tuple):
      return self.k[layer], self.v[layer]
    return (
      jax.lax.dynamic_index_in_dim(self.k, layer, keepdims=False),
      jax.lax.dynamic_index_in_dim(self.v, layer, keepdims=False),
    )


def keys_layout(k_BxTxKxE: Array) -> Array:
  """Keys as attention reads them, [B, K, E, T] (see ``KVCache``)."""
  return jnp.transpose(k_BxTxKxE, (0, 2, 3, 1))
