"""``ModelConfig``: the decoder's architecture (the fields of an HF ``config.json``) and how to
execute it, checked when built; and the RoPE frequencies it describes (``rope_inv_freq``).
"""

from __future__ import annotations

import dataclasses
import math
import typing

import jax.numpy as jnp

from jaxrl.nn.sections import LoraSection, LoraTarget, ModelSection, Remat
from jaxrl.types import Array

ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16")
LORA_TARGETS = typing.get_args(LoraTarget)  # the projections an adapter may sit on (short names)
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
  remat: str = ModelSection.remat  # per layer: one of REMAT_POLICIES (see model._remat_policy)
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
