"""Qwen2 / Qwen2.5 / Qwen3-family decoder in Flax NNX, used functionally.

The module is built once; training and sampling call ``forward(graphdef, params, ...)`` on a split
``nnx.State``, so params are a plain pytree that jit, optax, orbax and sharding act on.
Hidden states and the LM head are separate: log-probs and entropies are computed by the fused,
chunked path in ``jaxrl.logprobs`` and never through a [B, T, V] logits buffer.

Every parameter names its logical axes (``logical_axes`` metadata); ``jaxrl.sharding`` alone maps
them onto the mesh. Linear kernels are stored [in, out] (HF stores [out, in]).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.types import Array, pytree_dataclass


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Qwen2/Qwen3-style decoder (the fields of an HF ``config.json``)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = True          # Qwen2: True; Qwen3: False
  qk_norm: bool = False          # Qwen3: RMSNorm over head_dim on q and k before RoPE
  tie_embeddings: bool = False
  dtype: str = "float32"         # compute dtype of matmuls (params keep their own dtype)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")


@pytree_dataclass
class KVCache:
  """Per-layer key/value cache; slot s holds sequence position s of the (left-padded) batch."""
  k: tuple[Array, ...]   # L x [B, S, K, E]
  v: tuple[Array, ...]   # L x [B, S, K, E]


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
  shape = (batch, slots, cfg.num_kv_heads, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=zeros)


def _param(rngs: nnx.Rngs, shape, axes, scale: float | None = None) -> nnx.Param:
  """A normal(0, scale) parameter (scale = 1/sqrt(fan_in) by default) tagged with logical axes."""
  scale = shape[0] ** -0.5 if scale is None else scale
  return nnx.Param(scale * jax.random.normal(rngs.params(), shape, jnp.float32), logical_axes=axes)


def _zeros(shape, axes) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, jnp.float32), logical_axes=axes)


def _ones(shape, axes) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, jnp.float32), logical_axes=axes)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
  """HF-style RMSNorm: normalise in float32, scale, cast back."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope(x_BxTxHxE: Array, positions_BxT: Array, theta: float) -> Array:
  """Rotary embedding in HF's rotate-half layout (first and second halves of head_dim pair up)."""
  half = x_BxTxHxE.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles_BxTxhalf = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angles_BxTxhalf)[:, :, None, :]
  sin = jnp.sin(angles_BxTxhalf)[:, :, None, :]
  x32 = x_BxTxHxE.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxE.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k RMSNorm and a slot-indexed KV cache."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = _param(rngs, (d, h * e), ("embed", "heads"))
    self.k_proj = _param(rngs, (d, k * e), ("embed", "kv_heads"))
    self.v_proj = _param(rngs, (d, k * e), ("embed", "kv_heads"))
    self.o_proj = _param(rngs, (h * e, d), ("heads", "embed"))
    if cfg.qkv_bias:
      self.q_bias = _zeros((h * e,), ("heads",))
      self.k_bias = _zeros((k * e,), ("kv_heads",))
      self.v_bias = _zeros((k * e,), ("kv_heads",))
    if cfg.qk_norm:
      self.q_norm = _ones((e,), ("norm",))
      self.k_norm = _ones((e,), ("norm",))

  def _project(self, x, kernel, bias_name, heads):
    cfg = self.cfg
    y = x @ kernel[...].astype(x.dtype)
    if cfg.qkv_bias:
      y = y + getattr(self, bias_name)[...].astype(x.dtype)
    return y.reshape(*x.shape[:2], heads, cfg.head_dim)

  def __call__(self, x_BxTxD, positions_BxT, kv_valid_BxS, start, cache_k, cache_v):
    """Attend from T new tokens (slots start..start+T-1) to all S cache slots (or the T tokens)."""
    cfg = self.cfg
    b, t, _ = x_BxTxD.shape
    q = self._project(x_BxTxD, self.q_proj, "q_bias", cfg.num_heads)
    k = self._project(x_BxTxD, self.k_proj, "k_bias", cfg.num_kv_heads)
    v = self._project(x_BxTxD, self.v_proj, "v_bias", cfg.num_kv_heads)
    if cfg.qk_norm:
      q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
      k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
    q = rope(q, positions_BxT, cfg.rope_theta)
    k = rope(k, positions_BxT, cfg.rope_theta)
    if cache_k is not None:
      cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, start, 0, 0))
      cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, start, 0, 0))
      k, v = cache_k.astype(x_BxTxD.dtype), cache_v.astype(x_BxTxD.dtype)
    s = k.shape[1]
    rep = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(b, t, cfg.num_kv_heads, rep, cfg.head_dim)
    scores = jnp.einsum("btkre,bske->bkrts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (cfg.head_dim ** -0.5)
    query_slot_T = start + jnp.arange(t)
    causal_TxS = jnp.arange(s)[None, :] <= query_slot_T[:, None]
    allowed_BxTxS = causal_TxS[None] & kv_valid_BxS[:, None, :].astype(bool)
    scores = jnp.where(allowed_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkrts,bske->btkre", probs, v).reshape(b, t, cfg.num_heads * cfg.head_dim)
    return out @ self.o_proj[...].astype(out.dtype), cache_k, cache_v


class MLP(nnx.Module):
  """SwiGLU feed-forward block."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"))
    self.up_proj = _param(rngs, (d, f), ("embed", "mlp"))
    self.down_proj = _param(rngs, (f, d), ("mlp", "embed"))

  def __call__(self, x_BxTxD):
    dt = x_BxTxD.dtype
    gate = jax.nn.silu(x_BxTxD @ self.gate_proj[...].astype(dt))
    return (gate * (x_BxTxD @ self.up_proj[...].astype(dt))) @ self.down_proj[...].astype(dt)


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: attention then MLP."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.input_layernorm = _ones((cfg.hidden_size,), ("norm",))
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = _ones((cfg.hidden_size,), ("norm",))
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, kv_valid, start, cache_k, cache_v):
    eps = self.cfg.rms_norm_eps
    h, cache_k, cache_v = self.self_attn(
        rms_norm(x, self.input_layernorm[...], eps), positions, kv_valid, start, cache_k, cache_v)
    x = x + h
    x = x + self.mlp(rms_norm(x, self.post_attention_layernorm[...], eps))
    return x, cache_k, cache_v


class Decoder(nnx.Module):
  """Token embedding, decoder layers, final norm; the LM head is read separately."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), 0.02)
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = _ones((cfg.hidden_size,), ("norm",))
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))

  def lm_head_weight(self) -> Array:
    """The output projection as [D, V] (the transposed embedding when tied)."""
    if self.cfg.tie_embeddings:
      return self.embed_tokens[...].T
    return self.lm_head[...]

  def __call__(self, tokens_BxT, positions_BxT, kv_valid_BxS, cache: KVCache | None = None,
               start=0):
    """Final-norm hidden states [B, T, D] and the updated cache.

    Without a cache, S = T and token t attends to tokens ≤ t that are valid. With a cache, the T
    tokens are written at slots ``start..start+T-1`` and attend to valid slots up to their own.
    """
    dtype = jnp.dtype(self.cfg.dtype)
    x = jnp.take(self.embed_tokens[...], tokens_BxT, axis=0).astype(dtype)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      ck = cache.k[i] if cache is not None else None
      cv = cache.v[i] if cache is not None else None
      x, ck, cv = layer(x, positions_BxT, kv_valid_BxS, start, ck, cv)
      new_k.append(ck)
      new_v.append(cv)
    x = rms_norm(x, self.norm[...], self.cfg.rms_norm_eps)
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v)) if cache is not None else None
    return x, new_cache


def create(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
  """Randomly initialised model, split into (graphdef, params)."""
  model = Decoder(cfg, nnx.Rngs(params=seed))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params


def abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, params of ShapeDtypeStructs): a model plan without allocating weights."""
  model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(params=0)))
  return nnx.split(model, nnx.Param)


def forward(graphdef, params, tokens_BxT, positions_BxT, kv_valid_BxS, cache=None, start=0):
  """Pure forward: (hidden_BxTxD, lm_head_DxV, new_cache)."""
  model = nnx.merge(graphdef, params)
  hidden, cache = model(tokens_BxT, positions_BxT, kv_valid_BxS, cache, start)
  return hidden, model.lm_head_weight(), cache


def positions_from_mask(mask_BxT: Array) -> Array:
  """RoPE positions for a left- or right-padded batch: cumsum(mask) - 1 (pads clamp to 0)."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def num_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
