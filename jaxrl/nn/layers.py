"""The decoder's blocks: ``DecoderLayer`` (pre-norm attention then MLP), ``Attention``
(grouped-query, q/k norm, the KV cache written and read), ``MLP`` (SwiGLU), and what they are built
of: ``dense`` projections over kernels stored [out, in] (``model.PARAM_LAYOUT``), LoRA adapters
beside the target kernels, ``rms_norm``. Each parameter is created with its logical axes. The
attention arithmetic itself (RoPE, the softmax in blocks) is ``jaxrl.nn.attention``'s; how the
layers are stacked, scanned and rematerialised, ``jaxrl.nn.model``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.nn.attention import attention, rope
from jaxrl.nn.kv_cache import KVCache, keys_layout
from jaxrl.nn.model_config import ModelConfig, rope_inv_freq
from jaxrl.parallel.sharding import constrain
from jaxrl.types import Array


def normal_param(cfg: ModelConfig, rngs: nnx.Rngs, shape, axes, scale: float) -> nnx.Param:
  """A normal(0, scale) parameter tagged with logical axes."""
  value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(cfg.param_dtype), logical_axes=axes)


def kernel_param(cfg: ModelConfig, rngs: nnx.Rngs, d_in: int, d_out: int, in_axis, out_axis):
  """A normal(0, 1/sqrt(d_in)) kernel stored [out, in] (axes ``(out_axis, in_axis)``). Drawn
  [in, out] and transposed, so a seed gives the weights it gave before the layout changed."""
  value = d_in**-0.5 * jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32)
  return nnx.Param(value.T.astype(cfg.param_dtype), logical_axes=(out_axis, in_axis))


def const_param(cfg: ModelConfig, value: float, shape, axes) -> nnx.Param:
  return nnx.Param(jnp.full(shape, value, cfg.param_dtype), logical_axes=axes)


def _add_adapters(module: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs, *projs: str) -> None:
  """``<proj>_lora_a`` [r, in] and ``<proj>_lora_b`` [out, r] on ``module`` for each of ``projs``
  (e.g. "q_proj") that is a LoRA target, with the kernel's logical axes (and so its sharding) on
  their in / out dims. A is uniform(±1/sqrt(in)) as in PEFT, drawn from the ``lora`` stream (so
  the base weights of a seed do not depend on the rank); B is zero. Both float32 whatever
  ``param_dtype`` (their AdamW moments too: the updates are small next to the base)."""
  for proj in projs:
    if not cfg.lora_rank or proj.removesuffix("_proj") not in cfg.lora_targets:
      continue
    kernel = getattr(module, proj)
    (d_out, d_in), (out_axis, in_axis) = kernel.shape, kernel.get_metadata()["logical_axes"]
    bound = d_in**-0.5
    # drawn [in, r] and transposed: a seed's adapters are those it drew before the layout changed
    a = jax.random.uniform(rngs.lora(), (d_in, cfg.lora_rank), jnp.float32, -bound, bound)
    setattr(module, f"{proj}_lora_a", nnx.Param(a.T, logical_axes=("lora", in_axis)))
    b = jnp.zeros((d_out, cfg.lora_rank), jnp.float32)
    setattr(module, f"{proj}_lora_b", nnx.Param(b, logical_axes=(out_axis, "lora")))


def _adapter(module: nnx.Module, cfg: ModelConfig, proj: str):
  """(A, B, alpha / r) of ``proj``'s adapter, or None without one."""
  a = getattr(module, f"{proj}_lora_a", None)
  if a is None:
    return None
  return a[...], getattr(module, f"{proj}_lora_b")[...], cfg.lora_alpha / cfg.lora_rank


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
  """HF-style RMSNorm: normalise in float32, scale, cast back."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def _times_transposed(rows_UxD: Array, w_FxD: Array) -> Array:
  """rows · wᵀ: [U, D] x [F, D] -> [U, F], contracting both last dims (torch's ``F.linear``)."""
  return jax.lax.dot_general(rows_UxD, w_FxD.astype(rows_UxD.dtype), (((1,), (1,)), ((), ())))


def dense(x_BxTxD: Array, kernel_FxD: Array, adapter=None) -> Array:
  """``x · kernelᵀ`` as one 2-D matmul over the flattened rows: [B·T, D] x [F, D] -> [B, T, F];
  with ``adapter`` = (A [r, D], B [F, r], scale), plus (x Aᵀ)(scale · B)ᵀ in the compute dtype.

  Why 2-D: with [B, T, D] activations XLA CPU differentiates the kernel as a dot contracting two
  dims (B and T) and first copies the [B, T, F] cotangent and the activations into transposed
  layouts; on the flattened rows both gradients are plain matmuls with no copies (profiled at the
  5M workload of bench/train_step_vs_torch.py: the MLP's gradient took half the time). Same
  products, same sums: the values do not change.
  """
  rows_UxD = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])
  y_UxF = _times_transposed(rows_UxD, kernel_FxD)
  if adapter is not None:
    a_RxD, b_FxR, scale = adapter
    low_UxR = _times_transposed(rows_UxD, a_RxD)
    # scale folded into B in float32: in a bfloat16 compute dtype a scale like 16/6 would round
    y_UxF = y_UxF + _times_transposed(low_UxR, b_FxR.astype(jnp.float32) * scale)
  return y_UxF.reshape(*x_BxTxD.shape[:-1], kernel_FxD.shape[0])


def _is_slot_zero(start) -> bool:
  """Whether ``start`` is the Python int 0 (known when tracing; a traced start is never assumed)."""
  return isinstance(start, int) and start == 0


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k RMSNorm and a slot-indexed KV cache."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = kernel_param(cfg, rngs, d, h * e, "embed", "heads")
    self.k_proj = kernel_param(cfg, rngs, d, k * e, "embed", "kv_heads")
    self.v_proj = kernel_param(cfg, rngs, d, k * e, "embed", "kv_heads")
    self.o_proj = kernel_param(cfg, rngs, h * e, d, "heads", "embed")
    _add_adapters(self, cfg, rngs, "q_proj", "k_proj", "v_proj", "o_proj")
    if cfg.qkv_bias:
      self.q_bias = const_param(cfg, 0.0, (h * e,), ("heads",))
      self.k_bias = const_param(cfg, 0.0, (k * e,), ("kv_heads",))
      self.v_bias = const_param(cfg, 0.0, (k * e,), ("kv_heads",))
    if cfg.qk_norm:
      self.q_norm = const_param(cfg, 1.0, (e,), ("norm",))
      self.k_norm = const_param(cfg, 1.0, (e,), ("norm",))

  def _project(self, x, proj, bias_name, heads):
    cfg = self.cfg
    y = dense(x, getattr(self, proj)[...], _adapter(self, cfg, proj))
    if cfg.qkv_bias:
      y = y + getattr(self, bias_name)[...].astype(x.dtype)
    y = y.reshape(*x.shape[:2], heads, cfg.head_dim)
    return constrain(y, "batch", "act_seq", "act_heads", None)

  def __call__(self, x_BxTxD, positions_BxT, kv_valid_BxS, start, cache: KVCache | None, layer):
    """Attend from T new tokens (slots start..start+T-1) to all S cache slots (or the T tokens)."""
    cfg = self.cfg
    b, t, _ = x_BxTxD.shape
    q = self._project(x_BxTxD, "q_proj", "q_bias", cfg.num_heads)
    k = self._project(x_BxTxD, "k_proj", "k_bias", cfg.num_kv_heads)
    v = self._project(x_BxTxD, "v_proj", "v_bias", cfg.num_kv_heads)
    if cfg.qk_norm:
      q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
      k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
    inv_freq = rope_inv_freq(cfg)
    # The sampler (a cache, no gradient) takes rope's faster select form; see ``rope``.
    q = rope(q, positions_BxT, inv_freq, concat_halves=cache is None)
    k = rope(k, positions_BxT, inv_freq, concat_halves=cache is None)
    if cache is not None:
      cache = cache.write(layer, start, k, v)
    if cache is not None and not _is_slot_zero(start):
      k_BxKxExS, v_BxKxSxE = cache.layer(layer)
      k_BxKxExS, v_BxKxSxE = k_BxKxExS.astype(x_BxTxD.dtype), v_BxKxSxE.astype(x_BxTxD.dtype)
    else:
      # No cache, or a prefill from slot 0: a query at slot i < T sees slots <= i only, so the T
      # new tokens are all it can attend to: scores [.., T, T], not [.., T, S] (S = P + N).
      k_BxKxExS, v_BxKxSxE = keys_layout(k), jnp.swapaxes(v, 1, 2)
      kv_valid_BxS = kv_valid_BxS[:, :t]
    rep = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(b, t, cfg.num_kv_heads, rep, cfg.head_dim)
    out = attention(q, k_BxKxExS, v_BxKxSxE, kv_valid_BxS, start, cfg.attention_block)
    out = constrain(
      out.reshape(b, t, cfg.num_heads * cfg.head_dim), "batch", "act_seq", "act_heads"
    )
    out = dense(out, self.o_proj[...], _adapter(self, cfg, "o_proj"))
    return constrain(out, "batch", "act_seq", "act_embed"), cache


class MLP(nnx.Module):
  """SwiGLU feed-forward block."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = kernel_param(cfg, rngs, d, f, "embed", "mlp")
    self.up_proj = kernel_param(cfg, rngs, d, f, "embed", "mlp")
    self.down_proj = kernel_param(cfg, rngs, f, d, "mlp", "embed")
    _add_adapters(self, cfg, rngs, "gate_proj", "up_proj", "down_proj")

  def _dense(self, x, proj):
    return dense(x, getattr(self, proj)[...], _adapter(self, self.cfg, proj))

  def __call__(self, x_BxTxD):
    gate_BxTxF = constrain(self._dense(x_BxTxD, "gate_proj"), "batch", "act_seq", "act_mlp")
    up_BxTxF = constrain(self._dense(x_BxTxD, "up_proj"), "batch", "act_seq", "act_mlp")
    out = self._dense(jax.nn.silu(gate_BxTxF) * up_BxTxF, "down_proj")
    return constrain(out, "batch", "act_seq", "act_embed")


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: attention then MLP."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.input_layernorm = const_param(cfg, 1.0, (cfg.hidden_size,), ("norm",))
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = const_param(cfg, 1.0, (cfg.hidden_size,), ("norm",))
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, kv_valid, start, cache, layer):
    eps = self.cfg.rms_norm_eps
    x = constrain(x, "batch", "act_seq", "act_embed")
    h, cache = self.self_attn(
      rms_norm(x, self.input_layernorm[...], eps), positions, kv_valid, start, cache, layer
    )
    x = x + h
    x = x + self.mlp(rms_norm(x, self.post_attention_layernorm[...], eps))
    return constrain(x, "batch", "act_seq", "act_embed"), cache
