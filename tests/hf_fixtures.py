"""Tiny random Qwen2/Qwen3/Llama 3 checkpoints saved with transformers' ``save_pretrained`` as
several safetensors shards (with an index), for parity tests, and the two forwards compared on
them: jaxrl's and transformers' logits of a left-padded batch.

Weights are re-initialised away from HF's defaults (norms 1, biases 0, Linear std 0.02) so that a
wrong norm, bias, transpose or RoPE shows up in the logits instead of vanishing in near-uniform
attention.
"""

from __future__ import annotations

import functools
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jaxrl.nn import model as jaxrl_model  # noqa: E402

# Shared by all kinds: GQA (4 query heads on 2 kv heads), float32.
_COMMON = dict(
  vocab_size=160,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
)
# Llama 3 RoPE scaling shrunk to the test's positions (< 16): with a context of 64 tokens the
# 8 frequencies of head_dim 16 (wavelengths 6, 20, 63, 199, ...) fall in all three regimes (kept,
# interpolated, divided by the factor), and the interpolated ones turn by radians within 10 tokens.
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 10_000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 64,
}
_KINDS = {
  # head_dim = hidden / heads; a non-default θ and eps so both must be read from config.json.
  "qwen2": (
    transformers.Qwen2Config,
    transformers.Qwen2ForCausalLM,
    dict(
      head_dim=16,
      rms_norm_eps=1e-5,
      use_sliding_window=False,
      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
  ),
  # head_dim != hidden / heads, as in real Qwen3 models.
  "qwen3": (
    transformers.Qwen3Config,
    transformers.Qwen3ForCausalLM,
    dict(
      head_dim=32,
      rms_norm_eps=1e-6,
      attention_bias=False,
      use_sliding_window=False,
      rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
    ),
  ),
  # No biases, no q/k norms; RoPE with llama3 frequency scaling.
  "llama": (
    transformers.LlamaConfig,
    transformers.LlamaForCausalLM,
    dict(
      head_dim=16,
      rms_norm_eps=1e-5,
      attention_bias=False,
      mlp_bias=False,
      rope_parameters=LLAMA3_ROPE,
    ),
  ),
}
KINDS = tuple(_KINDS)
# Well below the ~330 KB of a tiny model, so every fixture is saved as 2+ shards with an index.
SHARD_SIZE = "100KB"


def tiny_hf_config(kind: str, tie: bool, **overrides):
  """The transformers config of a tiny ``kind`` model ("qwen2", "qwen3" or "llama")."""
  config_cls, _, extra = _KINDS[kind]
  return config_cls(**{**_COMMON, **extra, **overrides}, tie_word_embeddings=tie, dtype="float32")


@torch.no_grad()
def make_tiny_hf_model(kind: str, tie: bool, seed: int = 0, **overrides):
  """A random tiny ``{Qwen2,Qwen3,Llama}ForCausalLM`` (float32, eval mode) with non-trivial norms
  and biases; ``overrides`` change its config (the weights depend on the seed only)."""
  _, model_cls, _ = _KINDS[kind]
  torch.manual_seed(seed)
  model = _away_from_defaults(model_cls(tiny_hf_config(kind, tie, **overrides)).eval())
  if tie:
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  return model


@torch.no_grad()
def _away_from_defaults(model):
  """``model`` with norms near 1, biases near 0 and unit-scale Linear and embedding weights."""
  for name, p in model.named_parameters():  # tied weights appear once
    if name.endswith("norm.weight"):
      p.copy_(1.0 + 0.2 * torch.randn_like(p))
    elif name.endswith(".bias"):
      p.copy_(0.2 * torch.randn_like(p))
    elif "embed_tokens" in name:
      p.copy_(torch.randn_like(p))
    else:  # Linear [out, in]: unit-scale activations, so attention is far from uniform
      p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
  return model


# Sequence-classification (reward) models of each kind: one label, pad id REWARD_PAD_ID.
_SCORE_CLASSES = {
  "qwen2": transformers.Qwen2ForSequenceClassification,
  "qwen3": transformers.Qwen3ForSequenceClassification,
  "llama": transformers.LlamaForSequenceClassification,
}
REWARD_PAD_ID = 0


def make_tiny_hf_reward_model(kind: str, out_dir, seed: int = 0, **overrides) -> pathlib.Path:
  """Save a random tiny ``{Qwen2,Qwen3,Llama}ForSequenceClassification`` with one label (float32,
  sharded safetensors) into ``out_dir``; return it. ``overrides`` change its config."""
  torch.manual_seed(seed)
  config = tiny_hf_config(
    kind, False, **{"num_labels": 1, "pad_token_id": REWARD_PAD_ID, **overrides}
  )
  model = _away_from_defaults(_SCORE_CLASSES[kind](config).eval())
  out = pathlib.Path(out_dir)
  model.save_pretrained(out, max_shard_size=SHARD_SIZE)
  return out


def make_tiny_hf(
  kind: str, tie: bool, out_dir, seed: int = 0, max_shard_size=SHARD_SIZE
) -> pathlib.Path:
  """Save a random tiny model with ``save_pretrained`` (safetensors shards + index) into
  ``out_dir``; return it."""
  out = pathlib.Path(out_dir)
  make_tiny_hf_model(kind, tie, seed).save_pretrained(out, max_shard_size=max_shard_size)
  return out


def left_padded_batch(vocab):
  """Prompts of lengths 11, 6, 1, 9 left-padded to T=11 (pad id 0)."""
  lengths_B = np.array([11, 6, 1, 9])
  t = lengths_B.max()
  mask_BxT = np.arange(t)[None, :] >= (t - lengths_B)[:, None]
  tokens_BxT = np.random.default_rng(0).integers(1, vocab, (len(lengths_B), t))
  return np.where(mask_BxT, tokens_BxT, 0), mask_BxT


@functools.partial(jax.jit, static_argnums=0)
def _our_logits_jit(graphdef, params, tokens_BxT, mask_BxT):
  hidden_BxTxD, lm_head_VxD, _ = jaxrl_model.forward(
    graphdef, params, tokens_BxT, jaxrl_model.positions_from_mask(mask_BxT), mask_BxT
  )
  return jnp.einsum("btd,vd->btv", hidden_BxTxD, lm_head_VxD, preferred_element_type=jnp.float32)


def our_logits(graphdef, params, tokens_BxT, mask_BxT):
  """jaxrl's float32 logits [B, T, V] of a left-padded batch."""
  return np.asarray(
    _our_logits_jit(graphdef, params, jnp.asarray(tokens_BxT), jnp.asarray(mask_BxT))
  )


def load_hf_model(path):
  """transformers' model of the checkpoint in ``path``, in eval mode."""
  return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@torch.no_grad()
def hf_logits(hf_model, tokens_BxT, mask_BxT):
  """transformers' logits [B, T, V] of a left-padded batch (positions counted from each row's
  first token, as jaxrl counts them), as float32 numpy."""
  mask = torch.tensor(mask_BxT, dtype=torch.long)
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  out = hf_model(input_ids=torch.tensor(tokens_BxT), attention_mask=mask, position_ids=positions)
  return out.logits.float().numpy()
