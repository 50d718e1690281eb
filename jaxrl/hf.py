"""Hugging Face checkpoints <-> jaxrl ``Decoder`` params (Qwen2 / Qwen2.5 / Qwen3).

Loading reads ``config.json`` and safetensors (single file or sharded with an index) one tensor at a
time, so the host never holds a second full copy of the model, and places each tensor straight onto
its sharding. Export writes the same HF layout with numpy only (no torch), which both transformers
and a vLLM sidecar's ``reload_weights`` read.

Name map (HF -> jaxrl): ``model.`` prefix dropped; ``*_proj.weight`` and ``lm_head.weight`` are
[out, in] in HF and [in, out] here; ``{q,k,v}_proj.bias`` become ``{q,k,v}_bias``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import pathlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl import model as jaxrl_model
from jaxrl.model import ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
# transformers' own defaults, so a config.json that omits these loads the same in both frameworks.
_ROPE_THETA_DEFAULT = 10_000.0
_QWEN3_HEAD_DIM_DEFAULT = 128
_MAX_POSITIONS = 32768


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _rope_theta(config: dict) -> float:
  """RoPE θ: ``rope_parameters`` (transformers 5), legacy ``rope_scaling``, top-level ``rope_theta``."""
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  if set(rope) & set(config.get("layer_types") or ()):
    raise ValueError("config.json: per-layer-type rope_parameters are not supported")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (only 'default')")
  if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
  return float(rope.get("rope_theta", config.get("rope_theta", _ROPE_THETA_DEFAULT)))


def model_config_from_hf(config: dict) -> ModelConfig:
  """ModelConfig from a Qwen2/Qwen2.5/Qwen3 ``config.json`` dict; ValueError names any bad field."""
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"config.json: model_type {model_type!r} is not supported "
                     f"(expected one of {SUPPORTED_MODEL_TYPES})")
  for field in _REQUIRED:
    if config.get(field) is None:
      raise ValueError(f"config.json: required field {field!r} is missing")
  act = config.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
  sliding = "sliding_attention" in (config.get("layer_types") or ())
  if config.get("use_sliding_window", False) or sliding:
    raise ValueError("config.json: use_sliding_window / sliding_attention layers are not supported")
  heads = config["num_attention_heads"]
  qwen3 = model_type == "qwen3"
  if qwen3 and config.get("attention_bias", False):
    # HF Qwen3 then also has an o_proj bias, which the Decoder does not have.
    raise ValueError("config.json: attention_bias=true (q/k/v/o biases) is unsupported for qwen3")
  head_dim = config.get("head_dim") or (
      _QWEN3_HEAD_DIM_DEFAULT if qwen3 else config["hidden_size"] // heads)
  return ModelConfig(
      vocab_size=config["vocab_size"],
      hidden_size=config["hidden_size"],
      intermediate_size=config["intermediate_size"],
      num_layers=config["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=config.get("num_key_value_heads") or heads,
      head_dim=head_dim,
      rope_theta=_rope_theta(config),
      rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
      # Qwen2 attention always has q/k/v biases (transformers ignores attention_bias there).
      qkv_bias=not qwen3,
      qk_norm=qwen3,
      tie_embeddings=bool(config.get("tie_word_embeddings", False)),
  )


def hf_config_from_model(cfg: ModelConfig, dtype="float32") -> dict:
  """The ``config.json`` dict transformers 5 (and vLLM) needs to rebuild this architecture."""
  if cfg.qk_norm == cfg.qkv_bias:
    raise ValueError(f"qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm} has no HF equivalent "
                     "(Qwen2: biases and no qk-norm; Qwen3: qk-norm and no biases)")
  model_type = "qwen3" if cfg.qk_norm else "qwen2"
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
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "rope_theta": cfg.rope_theta,  # for readers older than transformers 5
      "max_position_embeddings": _MAX_POSITIONS,
      "tie_word_embeddings": cfg.tie_embeddings,
      "use_sliding_window": False,
      "attention_dropout": 0.0,
      "dtype": str(jnp.dtype(dtype)),
  }
  if model_type == "qwen3":
    config["attention_bias"] = False
  return config


def _key(key_path) -> tuple:
  """A jax key path as plain names, without the Variable's trailing ``.value``."""
  out = []
  for k in key_path:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(k.key)
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(k.idx)
    elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
      out.append(k.name)
  return tuple(out)


def hf_name(key: tuple) -> tuple[str, bool]:
  """HF tensor name for a jaxrl param path, and whether HF stores it transposed."""
  if key == ("lm_head",):
    return "lm_head.weight", True
  if key in (("embed_tokens",), ("norm",)):
    return f"model.{key[0]}.weight", False
  if len(key) >= 3 and key[0] == "layers":
    module, leaf = ".".join(str(k) for k in key[:-1]), key[-1]
    if leaf.endswith("_proj"):
      return f"model.{module}.{leaf}.weight", True
    if leaf in ("q_bias", "k_bias", "v_bias"):
      return f"model.{module}.{leaf[0]}_proj.bias", False
    if leaf.endswith("norm"):
      return f"model.{module}.{leaf}.weight", False
  raise ValueError(f"no HF name for jaxrl param {'/'.join(map(str, key))}")


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """HF tensor name -> safetensors file holding it (single file or every shard of an index)."""
  single, index = path / "model.safetensors", path / "model.safetensors.index.json"
  if single.exists():
    files = [single]
  elif index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    files = [path / f for f in sorted(set(weight_map.values()))]
  else:
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
  where = {}
  for f in files:
    with safe_open(f, framework="numpy") as handle:  # reads the header only
      where.update((name, f) for name in handle.keys())
  return where


def _place(array: np.ndarray, sharding) -> jax.Array:
  if sharding is None:
    return jnp.asarray(array)
  if sharding.is_fully_addressable:
    return jax.device_put(array, sharding)
  # Multi-process: each process holds the whole tensor on host and hands over its own shards.
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def load_hf_checkpoint(path, dtype=jnp.float32, shardings=None):
  """(ModelConfig, graphdef, params) from an HF directory, streamed and cast to ``dtype``.

  ``shardings``: None (default device) or a pytree of ``NamedSharding`` with the structure of the
  params (e.g. ``jaxrl.sharding.tree_shardings(abstract_params, mesh)``).
  """
  path = pathlib.Path(path)
  config_file = path / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{path}: no config.json")
  cfg = model_config_from_hf(json.loads(config_file.read_text()))
  graphdef, abstract = jaxrl_model.abstract(cfg)
  files = _tensor_files(path)
  placement = None
  if shardings is not None:
    placement = {_key(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
  np_dtype = np.dtype(dtype)
  expected = set()

  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(safe_open(f, framework="numpy")) for f in set(files.values())}

    def read(name):
      return handles[files[name]].get_tensor(name)

    def load_one(key_path, var):
      key = _key(key_path)
      name, transposed = hf_name(key)
      expected.add(name)
      if name not in files:
        raise ValueError(f"{path}: tensor {name!r} (jaxrl {'/'.join(map(str, key))}) is missing")
      want = tuple(var.shape[::-1] if transposed else var.shape)
      array = read(name)
      if array.shape != want:
        raise ValueError(
            f"{path}: tensor {name!r} has shape {array.shape}, config.json implies {want}")
      array = (array.T if transposed else array).astype(np_dtype, order="C")
      if placement is not None and key not in placement:
        raise ValueError(f"shardings has no entry for {'/'.join(map(str, key))}")
      return var.replace(_place(array, None if placement is None else placement[key]))

    params = jax.tree_util.tree_map_with_path(load_one, abstract, is_leaf=_is_var)

    unexpected = sorted(n for n in set(files) - expected if not n.endswith("rotary_emb.inv_freq"))
    if cfg.tie_embeddings and "lm_head.weight" in unexpected:
      if not np.array_equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
        raise ValueError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                         "model.embed_tokens.weight")
      unexpected.remove("lm_head.weight")
  if unexpected:
    raise ValueError(f"{path}: unexpected tensors {unexpected[:8]}"
                     f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all)")
  return cfg, graphdef, params


def to_hf_tensors(params) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, host array in HF layout) for every param, one at a time, in the params' dtype."""
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, transposed = hf_name(_key(key_path))
    array = np.asarray(jax.device_get(leaf))
    yield name, np.ascontiguousarray(array.T if transposed else array)


def save_hf_checkpoint(cfg: ModelConfig, params, out_dir, tokenizer=None,
                       max_shard_bytes: int = 5 * 2**30, untie: bool = False) -> pathlib.Path:
  """Write config.json + safetensors in HF layout (sharded with an index above ``max_shard_bytes``).

  Overwrites any earlier weights in ``out_dir``. Host memory peaks at about one shard. Params keep
  their dtype, so ``load_hf_checkpoint`` with that dtype gives them back bitwise. ``untie`` writes
  a tied model as an untied one (an explicit ``lm_head.weight``): vLLM's CPU build keeps a stale
  packed copy of a tied head after ``reload_weights``.
  """
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
    stale.unlink(missing_ok=True)  # a leftover file or shard from an earlier save would be read back
  leaves = jax.tree.leaves(params)
  dtype = leaves[0].dtype
  tensors = to_hf_tensors(params)
  if untie and cfg.tie_embeddings:
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
    embed = params["embed_tokens"][...]                       # [V, D]: HF's lm_head layout too
    leaves = [*leaves, embed]
    tensors = itertools.chain(tensors, [("lm_head.weight", np.asarray(jax.device_get(embed)))])
  (out / "config.json").write_text(json.dumps(hf_config_from_model(cfg, dtype), indent=2))

  # Plan shards from sizes alone so tensors are materialised on host one shard at a time.
  sizes = [leaf.size * leaf.dtype.itemsize for leaf in leaves]
  bounds, start, acc = [], 0, 0
  for i, size in enumerate(sizes):
    if acc and acc + size > max_shard_bytes:
      bounds.append((start, i))
      start, acc = i, 0
    acc += size
  bounds.append((start, len(sizes)))

  weight_map = {}
  for shard, (lo, hi) in enumerate(bounds):
    fname = ("model.safetensors" if len(bounds) == 1
             else f"model-{shard + 1:05d}-of-{len(bounds):05d}.safetensors")
    chunk = dict(next(tensors) for _ in range(lo, hi))
    save_file(chunk, out / fname, metadata={"format": "pt"})
    weight_map.update((name, fname) for name in chunk)
    del chunk
  if len(bounds) > 1:
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  if tokenizer is not None:
    tokenizer.save_pretrained(out)
  return out
