"""The run's model architecture: from the checkpoint's ``config.json`` or from ``config.model``.

With ``model.checkpoint`` set, the checkpoint defines the architecture (as in transformers, vLLM and
verl: a user points at a directory and gets that model). Without it, the model section describes a
model built from scratch (the tiny task). ``--plan`` uses the model section when the checkpoint is
not downloaded yet, so the big configs carry their checkpoint's architecture too.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl.config import Config, ConfigError
from jaxrl.nn import hf, hf_config
from jaxrl.nn.model import ModelConfig


def lora_fields(cfg: Config) -> dict:
  """The LoRA adapters the run trains (``model.lora``; rank 0: none)."""
  lo = cfg.model.lora
  return dict(lora_rank=lo.rank, lora_alpha=lo.alpha, lora_targets=lo.target_names())


def execution_fields(cfg: Config) -> dict:
  """How to run the model (never what it is): compute / param dtype, layer scan, remat."""
  m = cfg.model
  return dict(
    dtype=m.dtype,
    param_dtype=m.param_dtype,
    scan_layers=m.scan_layers,
    remat=m.remat,
    attention_block=m.attention_block,
  )


def from_section(cfg: Config, vocab_size: int = 0) -> ModelConfig:
  """The model section's architecture (``vocab_size`` = 0 there: take the tokenizer's)."""
  m = cfg.model
  return ModelConfig(
    vocab_size=m.vocab_size or vocab_size,
    hidden_size=m.hidden_size,
    intermediate_size=m.intermediate_size,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    rope_theta=m.rope_theta,
    rms_norm_eps=m.rms_norm_eps,
    qkv_bias=m.qkv_bias,
    qk_norm=m.qk_norm,
    tie_embeddings=m.tie_embeddings,
    **execution_fields(cfg),
    **lora_fields(cfg),
  )


def checkpoint_error(cfg: Config) -> ConfigError | None:
  """A missing ``model.checkpoint`` as one line saying what to download and where, or a damaged
  one (a truncated shard, a header or index that points outside it) naming the file (None:
  fine)."""
  path = cfg.model.checkpoint
  if path and os.path.isfile(os.path.join(path, "config.json")):
    try:
      hf.check_tensor_files(path)
    except (ValueError, OSError) as e:
      return ConfigError("model.checkpoint", str(e))
    return None
  if not path:
    return None
  where = "directory not found" if not os.path.isdir(path) else "no config.json in it"
  fetch = (
    f"download {cfg.model.hub_id} there (huggingface-cli download {cfg.model.hub_id} "
    f"--local-dir {path}) or "
    if cfg.model.hub_id
    else ""
  )
  return ConfigError(
    "model.checkpoint", f"{path!r}: {where}; {fetch}point model.checkpoint at a local HF checkpoint"
  )


def model_config(cfg: Config, vocab_size: int = 0) -> ModelConfig:
  """The run's ModelConfig: the checkpoint's architecture when there is one, else the section's."""
  if not cfg.model.checkpoint:
    return from_section(cfg, vocab_size)
  error = checkpoint_error(cfg)
  if error is not None:
    raise error
  try:
    base = hf_config.load_model_config(cfg.model.checkpoint, **execution_fields(cfg))
  except ValueError as e:
    raise ConfigError("model.checkpoint", str(e)) from None
  return dataclasses.replace(base, **lora_fields(cfg))
