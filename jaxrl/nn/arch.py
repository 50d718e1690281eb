"""The run's model architecture: from the checkpoint's ``config.json`` or from ``config.model``.

With ``model.checkpoint`` set, the checkpoint defines the architecture (as in transformers, vLLM and
verl: a user points at a directory and gets that model). Without it, the model section describes a
model built from scratch (the tiny task). ``--plan`` uses the model section when the checkpoint is
not downloaded yet, so the big configs carry their checkpoint's architecture too.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxrl.fields import ConfigError
from jaxrl.nn import hf_config, hf_safetensors
from jaxrl.nn.model import ModelConfig
from jaxrl.nn.sections import ModelSection


def lora_fields(m: ModelSection) -> dict:
  """The LoRA adapters the run trains (``model.lora``; rank 0: none)."""
  lo = m.lora
  return dict(lora_rank=lo.rank, lora_alpha=lo.alpha, lora_targets=lo.target_names())


def execution_fields(m: ModelSection) -> dict:
  """How to run the model (never what it is): compute / param dtype, layer scan, remat."""
  return dict(
    dtype=m.dtype,
    param_dtype=m.param_dtype,
    scan_layers=m.scan_layers,
    remat=m.remat,
    attention_block=m.attention_block,
  )


def from_section(m: ModelSection, vocab_size: int = 0) -> ModelConfig:
  """The model section's architecture (``vocab_size`` = 0 there: take the tokenizer's)."""
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
    **execution_fields(m),
    **lora_fields(m),
  )


def missing_checkpoint(m: ModelSection) -> ConfigError | None:
  """A ``model.checkpoint`` that is not there (no directory, no config.json in it) as one line
  saying what to download and where (None: there, or none set)."""
  path = m.checkpoint
  if not path or os.path.isfile(os.path.join(path, "config.json")):
    return None
  where = "directory not found" if not os.path.isdir(path) else "no config.json in it"
  fetch = (
    f"download {m.hub_id} there (huggingface-cli download {m.hub_id} --local-dir {path}) or "
    if m.hub_id
    else ""
  )
  return ConfigError(
    "model.checkpoint", f"{path!r}: {where}; {fetch}point model.checkpoint at a local HF checkpoint"
  )


def checkpoint_error(m: ModelSection) -> ConfigError | None:
  """A missing ``model.checkpoint`` (``missing_checkpoint``), or a damaged one naming the file: a
  JSON file that does not parse (its config, generation config, tokenizer's), a truncated shard, a
  header or index that points outside it (None: fine). Headers only: no weight is read."""
  if (error := missing_checkpoint(m)) is not None or not m.checkpoint:
    return error
  try:
    _check_json_files(m.checkpoint)
    hf_safetensors.check_tensor_files(m.checkpoint)
  except (ValueError, OSError) as e:
    return ConfigError("model.checkpoint", str(e))
  return None


def _check_json_files(path: str) -> None:
  """Each JSON file at the top of the checkpoint parses (a ValueError naming it): each is read
  only where it is used, after the run's directory is written."""
  for name in sorted(os.listdir(path)):
    if name.endswith(".json"):
      file = os.path.join(path, name)
      try:
        with open(file, "rb") as f:
          json.load(f)
      except ValueError as e:  # JSON or UTF-8
        raise ValueError(f"{file}: not valid JSON ({e})") from None


def model_config(m: ModelSection, vocab_size: int = 0) -> ModelConfig:
  """The run's ModelConfig: the checkpoint's architecture when there is one, else the section's."""
  if not m.checkpoint:
    return from_section(m, vocab_size)
  # config.json alone: --plan reads the architecture before the weights are downloaded.
  error = missing_checkpoint(m)
  if error is not None:
    raise error
  try:
    base = hf_config.load_model_config(m.checkpoint, **execution_fields(m))
  except ValueError as e:
    raise ConfigError("model.checkpoint", str(e)) from None
  return dataclasses.replace(base, **lora_fields(m))
