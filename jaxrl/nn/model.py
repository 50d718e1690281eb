"""Qwen2 / Qwen2.5 / Qwen3 / Llama 3.x decoder in Flax NNX, used functionally.

The module is built once; training and sampling call ``forward(graphdef, params, ...)`` on a split
``nnx.State``, so params are a plain pytree that jit, optax, orbax and sharding act on.
Hidden states and the LM head are separate: log-probs and entropies are computed by the fused,
chunked path in ``jaxrl.nn.logprobs`` and never through a [B, T, V] logits buffer.

Every parameter names its logical axes (``logical_axes`` metadata); ``jaxrl.parallel.sharding`` alone maps
them onto the mesh. Every matrix is stored as HF stores it: kernels [out, in], the LM head [V, D],
LoRA's A [r, in] and B [out, r] (``PARAM_LAYOUT``). A product x · Wᵀ that contracts W's last dim
streams W's rows in order, which on CPU decodes 15-30% faster at 4-16 rows than x · W over an
[in, out] kernel (bench/dot_layout.py, bench/results/peers.md), and import and export copy tensors
without a transpose.

Two layouts of the L decoder layers compute the same function from the same init:
  loop (``scan_layers=False``): ``params["layers"][i]`` per layer, applied by a Python loop;
  scan (``scan_layers=True``):  one ``params["layers"]`` whose leaves carry a leading [L] axis
    (logical axis "layers"), applied by ``jax.lax.scan``, so compile time does not grow with L.
Both run every layer through one function (optionally rematerialised, ``remat``). The KV cache
follows the layout: one array per layer in loop mode (a layer reads its own, no copy), one stacked
[L, ...] array in scan mode (indexed by the scan's layer); updated in place. Keys are kept
transposed, [B, K, E, S], values [B, K, S, E] (``jaxrl.nn.kv_cache.KVCache`` says why).

Memory at long T: attention runs in blocks of ``attention_block`` queries (``jaxrl.nn.attention``),
each block rematerialised, so no [B, H, T, T] buffer exists; and under jit on a mesh the activations
are constrained to keep rows split over the data axes (``sharding.constrain``; a no-op elsewhere).

Here: the ``Decoder`` (embedding, the layers looped or scanned, final norm), ``forward``, ``create``,
``init_cache``. The blocks it stacks (attention, MLP, the projections and adapters) are
``jaxrl.nn.layers``; ``ModelConfig``, ``jaxrl.nn.model_config``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.nn.kv_cache import KVCache
from jaxrl.nn.layers import DecoderLayer, const_param, kernel_param, normal_param, rms_norm
from jaxrl.nn.model_config import ModelConfig
from jaxrl.parallel.sharding import activation_mesh, constrain
from jaxrl.types import Array

# How params are laid out, recorded in every checkpoint (``jaxrl.workdir.checkpoint``): a checkpoint of
# another layout is refused by name, never restored transposed (a square kernel would fit).
PARAM_LAYOUT = "matrices [out, in]"
LEGACY_PARAM_LAYOUT = "kernels [in, out]"  # checkpoints written before the layout was recorded


def _remat_policy(name: str):
  """The ``jax.checkpoint`` policy of a ``ModelConfig.remat`` name (None: save nothing)."""
  if name == "full":
    return None
  if name == "dots":  # keep the projections' outputs, recompute norms, RoPE, softmax, SiLU
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  if name == "offload":  # as "dots", but parked in pinned host memory between the passes
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
  raise ValueError(name)


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
  """An empty cache of ``slots`` slots in the layout of ``cfg.scan_layers`` (see ``KVCache``)."""
  keys_BxKxExS = (batch, cfg.num_kv_heads, cfg.head_dim, slots)
  values_BxKxSxE = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
  if cfg.scan_layers:
    stacked = lambda shape: jnp.zeros((cfg.num_layers, *shape), dtype)  # noqa: E731
    return KVCache(k=stacked(keys_BxKxExS), v=stacked(values_BxKxSxE))
  per_layer = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
  return KVCache(k=per_layer(keys_BxKxExS), v=per_layer(values_BxKxSxE))


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
  """One DecoderLayer whose params hold the given layers' params on a leading "layers" axis."""
  graphdef = nnx.split(layers[0])[0]
  states = [nnx.split(layer)[1] for layer in layers]

  def stack(*vs):
    axes = vs[0].get_metadata()["logical_axes"]
    return vs[0].replace(jnp.stack([v[...] for v in vs]), logical_axes=("layers", *axes))

  return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_var))


def _layer_fn(cfg: ModelConfig, graphdef: nnx.GraphDef, start):
  """The pure per-layer function (state_i, x, positions, kv_valid, cache, i) -> (x, cache),
  rematerialised by ``cfg.remat``; the same function runs in loop and scan mode. ``start`` is
  bound, not passed: a Python int stays static through ``jax.checkpoint`` (a prefill from slot 0
  then attends to its own T tokens only, ``Attention``)."""

  def apply(state, x, positions, kv_valid, cache, layer):
    return nnx.merge(graphdef, state)(x, positions, kv_valid, start, cache, layer)

  if cfg.remat == "none":
    return apply
  # Inside scan, CSE cannot merge the recomputation into the forward, so the guard is not needed.
  return jax.checkpoint(apply, policy=_remat_policy(cfg.remat), prevent_cse=not cfg.scan_layers)


class Decoder(nnx.Module):
  """Token embedding, decoder layers, final norm; the LM head is read separately."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = normal_param(
      cfg, rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), 0.02
    )
    # Built one by one in both modes, so a seed gives the same weights whether scanned or not.
    layers = [DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)]
    self.layers = _stack_layers(layers) if cfg.scan_layers else nnx.List(layers)
    self.norm = const_param(cfg, 1.0, (cfg.hidden_size,), ("norm",))
    if not cfg.tie_embeddings:
      self.lm_head = kernel_param(cfg, rngs, cfg.hidden_size, cfg.vocab_size, "embed", "vocab")

  def lm_head_weight(self) -> Array:
    """The output projection as [V, D] (the embedding itself when tied)."""
    if self.cfg.tie_embeddings:
      return self.embed_tokens[...]
    return self.lm_head[...]

  def __call__(
    self, tokens_BxT, positions_BxT, kv_valid_BxS, cache: KVCache | None = None, start=0
  ):
    """Final-norm hidden states [B, T, D] and the updated cache.

    Without a cache, S = T and token t attends to tokens ≤ t that are valid. With a cache, the T
    tokens are written at slots ``start..start+T-1`` and attend to valid slots up to their own.
    """
    cfg = self.cfg
    x = jnp.take(self.embed_tokens[...], tokens_BxT, axis=0).astype(cfg.dtype)
    x = constrain(x, "batch", "act_seq", "act_embed")
    if cfg.scan_layers:
      graphdef, stacked = nnx.split(self.layers)
      layer_fn = _layer_fn(cfg, graphdef, start)

      def body(x_and_cache, state_and_index):
        (x, cache), (state, i) = x_and_cache, state_and_index
        return layer_fn(state, x, positions_BxT, kv_valid_BxS, cache, i), None

      (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked, jnp.arange(cfg.num_layers)))
    else:
      for i, layer in enumerate(self.layers):
        graphdef, state = nnx.split(layer)
        x, cache = _layer_fn(cfg, graphdef, start)(state, x, positions_BxT, kv_valid_BxS, cache, i)
    x = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
    return constrain(x, "batch", "act_seq", "act_embed"), cache


def create(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
  """Randomly initialised model, split into (graphdef, params)."""
  # LoRA's A draws from its own stream: a seed's base weights are the same at every rank.
  model = Decoder(cfg, nnx.Rngs(params=seed, lora=jax.random.fold_in(jax.random.key(seed), 1)))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params


def abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, params of ShapeDtypeStructs): a model plan without allocating weights."""
  model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(params=0, lora=0)))
  return nnx.split(model, nnx.Param)


def forward(graphdef, params, tokens_BxT, positions_BxT, kv_valid_BxS, cache=None, start=0):
  """Pure forward: (hidden_BxTxD, lm_head_VxD, new_cache)."""
  model = nnx.merge(graphdef, params)
  with activation_mesh(params):  # the params' mesh: activations keep rows over the data axes
    hidden, cache = model(tokens_BxT, positions_BxT, kv_valid_BxS, cache, start)
  return hidden, model.lm_head_weight(), cache


def positions_from_mask(mask_BxT: Array) -> Array:
  """RoPE positions for a left- or right-padded batch: cumsum(mask) - 1 (pads clamp to 0)."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def num_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
