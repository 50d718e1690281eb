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
"""

from __future__ import annotations

import dataclasses
import math
import typing

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import LoraSection, LoraTarget, ModelSection, Remat
from jaxrl.nn.attention import attention, rope
from jaxrl.nn.kv_cache import KVCache, keys_layout
from jaxrl.parallel.sharding import activation_mesh, constrain
from jaxrl.types import Array

ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16")
LORA_TARGETS = typing.get_args(LoraTarget)  # the projections an adapter may sit on (short names)
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


REMAT_POLICIES = typing.get_args(Remat)  # the values config.model.remat accepts


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture (the fields of an HF ``config.json``) and how to execute it.

  The execution fields (``dtype``, ``param_dtype``, ``scan_layers``, ``remat``) never change the
  function computed, only precision, memory and compile time. A field that the config's ``model``
  section has too defaults to that section's value (``config.ModelSection``, the one source).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = ModelSection.rope_theta
  rms_norm_eps: float = ModelSection.rms_norm_eps
  qkv_bias: bool = ModelSection.qkv_bias  # Qwen2: True; Qwen3, Llama: False
  qk_norm: bool = ModelSection.qk_norm  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  tie_embeddings: bool = ModelSection.tie_embeddings
  dtype: str = ModelSection.dtype  # compute dtype of activations and matmuls
  # RoPE frequency scaling, as HF ``rope_parameters``: "linear" divides every frequency by
  # ``rope_factor``; "llama3" divides the low ones, keeps the high ones, interpolates between.
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  # storage dtype of the params (and so of grads and AdamW moments)
  param_dtype: str = ModelSection.param_dtype
  scan_layers: bool = ModelSection.scan_layers  # stack the layers on one axis, lax.scan over them
  remat: str = ModelSection.remat  # per layer: one of REMAT_POLICIES (see _remat_policy)
  # Queries per attention block: longer inputs attend block by block (scores [B, H, block, S]
  # instead of [B, H, T, S]); T <= block (decode, short prompts) takes the one-block path.
  attention_block: int = ModelSection.attention_block
  # Architecture: the longest context the checkpoint declares (HF max_position_embeddings); only
  # carried through to the exported config.json, never used in the computation.
  max_position_embeddings: int = 32768
  # LoRA (Hu et al., 2021): rank r > 0 adds y += (alpha / r) · x Aᵀ Bᵀ on each target projection,
  # A [r, in] and B [out, r] float32 params named ``<proj>_lora_a`` / ``<proj>_lora_b`` beside the
  # kernel; B starts at zero, so a fresh adapter computes the base model exactly (``jaxrl.nn.lora``
  # splits them from the base for training, checkpoints and export).
  lora_rank: int = LoraSection.rank
  lora_alpha: float = LoraSection.alpha
  lora_targets: tuple[str, ...] = LoraSection().target_names()

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is not one of {DTYPES}")
    if self.attention_block < 1:
      raise ValueError(f"ModelConfig.attention_block={self.attention_block} must be >= 1")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat={self.remat!r} is not one of {REMAT_POLICIES}")
    unknown = set(self.lora_targets) - set(LORA_TARGETS)
    if self.lora_rank < 0 or unknown:
      raise ValueError(
        f"LoRA rank {self.lora_rank} must be >= 0 and targets {self.lora_targets} among "
        f"{LORA_TARGETS}"
      )
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"ModelConfig.rope_type={self.rope_type!r} is not one of {ROPE_TYPES}")
    if self.rope_type != "default" and self.rope_factor <= 0:
      raise ValueError(f"ModelConfig.rope_factor={self.rope_factor} must be > 0")
    if self.rope_type == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
      raise ValueError(
        f"llama3 RoPE needs rope_high_freq_factor ({self.rope_high_freq_factor}) > "
        f"rope_low_freq_factor ({self.rope_low_freq_factor})"
      )


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
  """An empty cache of ``slots`` slots in the layout of ``cfg.scan_layers`` (see ``KVCache``)."""
  keys_BxKxExS = (batch, cfg.num_kv_heads, cfg.head_dim, slots)
  values_BxKxSxE = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
  if cfg.scan_layers:
    stacked = lambda shape: jnp.zeros((cfg.num_layers, *shape), dtype)  # noqa: E731
    return KVCache(k=stacked(keys_BxKxExS), v=stacked(values_BxKxSxE))
  per_layer = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
  return KVCache(k=per_layer(keys_BxKxExS), v=per_layer(values_BxKxSxE))


def rope_inv_freq(cfg: ModelConfig) -> Array:
  """RoPE inverse frequencies [E/2] in float32, with the config's scaling, in transformers' order
  of float32 operations (``modeling_rope_utils``), so the angles match its to the last bit or so."""
  half = cfg.head_dim // 2
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  if cfg.rope_type == "linear":
    return inv_freq / cfg.rope_factor
  if cfg.rope_type == "llama3":
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths beyond context/low were never seen whole in pretraining: stretch them by factor.
    scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) & ~(wavelen > context / low)
    return jnp.where(medium, smoothed, scaled)
  return inv_freq


def _param(cfg: ModelConfig, rngs: nnx.Rngs, shape, axes, scale: float) -> nnx.Param:
  """A normal(0, scale) parameter tagged with logical axes."""
  value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(cfg.param_dtype), logical_axes=axes)


def _kernel(cfg: ModelConfig, rngs: nnx.Rngs, d_in: int, d_out: int, in_axis, out_axis):
  """A normal(0, 1/sqrt(d_in)) kernel stored [out, in] (axes ``(out_axis, in_axis)``). Drawn
  [in, out] and transposed, so a seed gives the weights it gave before the layout changed."""
  value = d_in**-0.5 * jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32)
  return nnx.Param(value.T.astype(cfg.param_dtype), logical_axes=(out_axis, in_axis))


def _const(cfg: ModelConfig, value: float, shape, axes) -> nnx.Param:
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
    self.q_proj = _kernel(cfg, rngs, d, h * e, "embed", "heads")
    self.k_proj = _kernel(cfg, rngs, d, k * e, "embed", "kv_heads")
    self.v_proj = _kernel(cfg, rngs, d, k * e, "embed", "kv_heads")
    self.o_proj = _kernel(cfg, rngs, h * e, d, "heads", "embed")
    _add_adapters(self, cfg, rngs, "q_proj", "k_proj", "v_proj", "o_proj")
    if cfg.qkv_bias:
      self.q_bias = _const(cfg, 0.0, (h * e,), ("heads",))
      self.k_bias = _const(cfg, 0.0, (k * e,), ("kv_heads",))
      self.v_bias = _const(cfg, 0.0, (k * e,), ("kv_heads",))
    if cfg.qk_norm:
      self.q_norm = _const(cfg, 1.0, (e,), ("norm",))
      self.k_norm = _const(cfg, 1.0, (e,), ("norm",))

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
    self.gate_proj = _kernel(cfg, rngs, d, f, "embed", "mlp")
    self.up_proj = _kernel(cfg, rngs, d, f, "embed", "mlp")
    self.down_proj = _kernel(cfg, rngs, f, d, "mlp", "embed")
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
    self.input_layernorm = _const(cfg, 1.0, (cfg.hidden_size,), ("norm",))
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = _const(cfg, 1.0, (cfg.hidden_size,), ("norm",))
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
    self.embed_tokens = _param(
      cfg, rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), 0.02
    )
    # Built one by one in both modes, so a seed gives the same weights whether scanned or not.
    layers = [DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)]
    self.layers = _stack_layers(layers) if cfg.scan_layers else nnx.List(layers)
    self.norm = _const(cfg, 1.0, (cfg.hidden_size,), ("norm",))
    if not cfg.tie_embeddings:
      self.lm_head = _kernel(cfg, rngs, cfg.hidden_size, cfg.vocab_size, "embed", "vocab")

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
