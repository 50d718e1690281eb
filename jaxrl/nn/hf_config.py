"""Hugging Face ``config.json`` <-> ``ModelConfig`` (Qwen2 / Qwen2.5 / Qwen3 / Llama 3.x).

What the model is comes from the checkpoint's config.json, with transformers' own defaults for the
fields it may omit; how to run it (``EXECUTION_FIELDS``: dtypes, scan, remat, attention blocks)
comes from jaxrl's config and is never read from or written to config.json. The export writes the
config transformers and vLLM need to load the same architecture back (RoPE scaling included).
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp

from jaxrl.nn.model_config import ROPE_TYPES, ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_ARCHITECTURES = {
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "llama": "LlamaForCausalLM",
}
_REQUIRED = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
)
# ModelConfig fields that say how to run the model, not what it is: never read from config.json.
EXECUTION_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat", "attention_block")
# transformers' own defaults, so a config.json that omits these loads the same in both frameworks.
_ROPE_THETA_DEFAULT = 10_000.0
_QWEN3_HEAD_DIM_DEFAULT = 128


def _rope_fields(config: dict) -> dict:
  """ModelConfig's RoPE fields from ``rope_parameters`` (transformers 5), legacy ``rope_scaling``
  and top-level ``rope_theta``, with transformers' fallbacks (``standardize_rope_params``)."""
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  if set(rope) & set(config.get("layer_types") or ()):
    raise ValueError("config.json: per-layer-type rope_parameters are not supported")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
  theta = rope.get("rope_theta", config.get("rope_theta", _ROPE_THETA_DEFAULT))
  fields = {"rope_theta": float(theta)}

  def need(key):
    if rope.get(key) is None:
      raise ValueError(f"config.json: rope_type {rope_type!r} needs rope_parameters[{key!r}]")
    return rope[key]

  if rope_type == "default":
    return fields
  if rope_type == "linear":
    return {**fields, "rope_type": "linear", "rope_factor": float(need("factor"))}
  if rope_type == "llama3":
    # transformers prefers a top-level original_max_position_embeddings, then the rope dict's,
    # then max_position_embeddings.
    original = (
      config.get("original_max_position_embeddings")
      or rope.get("original_max_position_embeddings")
      or config.get("max_position_embeddings")
    )
    if original is None:
      raise ValueError("config.json: rope_type 'llama3' needs original_max_position_embeddings")
    return {
      **fields,
      "rope_type": "llama3",
      "rope_factor": float(need("factor")),
      "rope_low_freq_factor": float(need("low_freq_factor")),
      "rope_high_freq_factor": float(need("high_freq_factor")),
      "rope_original_max_positions": int(original),
    }
  raise ValueError(
    f"config.json: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
  )


def _check_sizes(config: dict) -> None:
  """Each size the model's shapes are built from, where set, is a positive integer (a ValueError
  naming it): a string or a fraction would otherwise surface as a traceback deep in JAX."""
  for field in (*_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings"):
    value = config.get(field)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    if value is not None and not ok:
      raise ValueError(f"config.json: {field} must be a positive integer, got {value!r}")


def model_config_from_hf(config: dict, **execution) -> ModelConfig:
  """ModelConfig from a Qwen2/Qwen2.5/Qwen3/Llama ``config.json`` dict; ValueError names any bad
  field. ``execution``: any of ``EXECUTION_FIELDS`` (e.g. ``scan_layers=True``)."""
  unknown = set(execution) - set(EXECUTION_FIELDS)
  if unknown:
    raise TypeError(
      f"model_config_from_hf: unknown options {sorted(unknown)} (allowed: {EXECUTION_FIELDS})"
    )
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
      f"config.json: model_type {model_type!r} is not supported "
      f"(expected one of {SUPPORTED_MODEL_TYPES})"
    )
  for field in _REQUIRED:
    if config.get(field) is None:
      raise ValueError(f"config.json: required field {field!r} is missing")
  _check_sizes(config)
  act = config.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
  sliding = "sliding_attention" in (config.get("layer_types") or ())
  if config.get("use_sliding_window", False) or sliding:
    raise ValueError("config.json: use_sliding_window / sliding_attention layers are not supported")
  if model_type in ("qwen3", "llama") and config.get("attention_bias", False):
    # HF then also has an o_proj bias, which the Decoder does not have.
    raise ValueError(
      f"config.json: attention_bias=true (q/k/v/o biases) is unsupported for {model_type}"
    )
  if model_type == "llama" and config.get("mlp_bias", False):
    raise ValueError("config.json: mlp_bias=true (gate/up/down biases) is unsupported for llama")
  heads = config["num_attention_heads"]
  qwen3 = model_type == "qwen3"
  head_dim = config.get("head_dim") or (
    _QWEN3_HEAD_DIM_DEFAULT if qwen3 else config["hidden_size"] // heads
  )
  return ModelConfig(
    vocab_size=config["vocab_size"],
    hidden_size=config["hidden_size"],
    intermediate_size=config["intermediate_size"],
    num_layers=config["num_hidden_layers"],
    num_heads=heads,
    num_kv_heads=config.get("num_key_value_heads") or heads,
    head_dim=head_dim,
    rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
    # Qwen2 attention always has q/k/v biases (transformers ignores attention_bias there).
    qkv_bias=model_type == "qwen2",
    qk_norm=qwen3,
    tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    # Carried to the export unchanged: vLLM derives its max_model_len from it.
    max_position_embeddings=int(
      config.get("max_position_embeddings") or ModelConfig.max_position_embeddings
    ),
    **_rope_fields(config),
    **execution,
  )


def read_config_json(path) -> dict:
  """The config.json dict of an HF directory; a clear error when it is missing or not an object."""
  config_file = pathlib.Path(path) / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{path}: no config.json")
  try:
    config = json.loads(config_file.read_text())
  except ValueError as e:  # JSON or UTF-8
    raise ValueError(f"{config_file}: not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise ValueError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
  return config


def load_model_config(path, **execution) -> ModelConfig:
  """ModelConfig of an HF directory (its config.json), e.g. to plan shardings before loading."""
  return model_config_from_hf(read_config_json(path), **execution)


def _rope_parameters(cfg: ModelConfig) -> dict:
  rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  if cfg.rope_type != "default":
    rope["factor"] = cfg.rope_factor
  if cfg.rope_type == "llama3":
    rope.update(
      low_freq_factor=cfg.rope_low_freq_factor,
      high_freq_factor=cfg.rope_high_freq_factor,
      original_max_position_embeddings=cfg.rope_original_max_positions,
    )
  return rope


def hf_config_from_model(cfg: ModelConfig, dtype="float32") -> dict:
  """The ``config.json`` dict transformers 5 (and vLLM) needs to rebuild this architecture.

  q/k/v biases make it Qwen2, q/k norms Qwen3, neither Llama.
  """
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError(
      "qkv_bias=True with qk_norm=True has no HF equivalent "
      "(Qwen2: biases; Qwen3: qk-norm; Llama: neither)"
    )
  model_type = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
  rope = _rope_parameters(cfg)
  config = {
    "architectures": [_ARCHITECTURES[model_type]],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_parameters": rope,
    # For readers older than transformers 5 (e.g. a vLLM sidecar's): top-level θ, rope_scaling.
    "rope_theta": cfg.rope_theta,
    "rope_scaling": (
      {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_type != "default" else None
    ),
    "max_position_embeddings": cfg.max_position_embeddings,
    "tie_word_embeddings": cfg.tie_embeddings,
    "attention_dropout": 0.0,
    "dtype": str(jnp.dtype(dtype)),
  }
  if model_type == "qwen2":
    config["use_sliding_window"] = False
  else:
    config["attention_bias"] = False
  if model_type == "llama":
    config["mlp_bias"] = False
  return config
