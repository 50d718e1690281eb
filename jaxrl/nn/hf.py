"""The HF layout of jaxrl ``Decoder`` params and checkpoints written in it (export).

Name map (HF -> jaxrl): ``model.`` prefix dropped; ``{q,k,v}_proj.bias`` become ``{q,k,v}_bias``;
with ``scan_layers`` the L tensors ``model.layers.{l}.X`` are one param ``layers/X`` of shape
[L, ...]. Every tensor keeps HF's layout (kernels [out, in], ``model.PARAM_LAYOUT``): no transposes.

Export writes that layout with numpy only (no torch), which both transformers and a vLLM
sidecar's ``reload_weights`` read; ``hf_load`` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Iterator

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxrl.nn.hf_config import hf_config_from_model
from jaxrl.nn.hf_safetensors import SAFETENSORS_DTYPES
from jaxrl.nn.model import ModelConfig
from jaxrl.parallel import distributed

_SAFETENSORS_NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}


def param_key(key_path) -> tuple:
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


def is_stacked(key: tuple) -> bool:
  """A scanned model's layer param: ``layers/<module>/<leaf>`` with no layer index."""
  return len(key) >= 2 and key[0] == "layers" and not isinstance(key[1], int)


def hf_name(key: tuple) -> str:
  """HF tensor name for a jaxrl (per-layer) param path (the tensor has the param's layout)."""
  if key == ("lm_head",):
    return "lm_head.weight"
  if key in (("embed_tokens",), ("norm",)):
    return f"model.{key[0]}.weight"
  if len(key) >= 3 and key[0] == "layers" and isinstance(key[1], int):
    module, leaf = ".".join(str(k) for k in key[:-1]), key[-1]
    if leaf.endswith(("_proj", "norm")):
      return f"model.{module}.{leaf}.weight"
    if leaf in ("q_bias", "k_bias", "v_bias"):
      return f"model.{module}.{leaf[0]}_proj.bias"
  raise ValueError(f"no HF name for jaxrl param {'/'.join(map(str, key))}")


SCORE_HEAD = "score.weight"  # a sequence-classification checkpoint's head [labels, D], no bias


def _hf_entries(params) -> list[tuple[str, object, int | None]]:
  """(HF name, leaf, layer index into a stacked leaf or None) for every HF tensor,
  a scanned model's stacked leaves expanded layer by layer where they first appear."""
  entries, stacked = [], []
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = param_key(key_path)
    if is_stacked(key):
      if not stacked:
        entries.append(stacked)  # placeholder, filled below
      stacked.append((key, leaf))
    else:
      entries.append((hf_name(key), leaf, None))
  layers = [
    (hf_name(("layers", i, *key[1:])), leaf, i)
    for i in range(stacked[0][1].shape[0] if stacked else 0)
    for key, leaf in stacked
  ]
  out = []
  for e in entries:
    out.extend(layers if e is stacked else [e])
  return out


def _host(leaf, layer) -> np.ndarray:
  # A multi-process run's params span hosts: every process gathers each tensor (a collective).
  return np.ascontiguousarray(distributed.to_host(leaf if layer is None else leaf[layer]))


def to_hf_tensors(params) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, host array in HF layout) for every HF tensor, one at a time, in the params' dtype
  (a scanned model's stacked params are unstacked into per-layer tensors)."""
  for name, leaf, layer in _hf_entries(params):
    yield name, _host(leaf, layer)


def _shard_bounds(sizes: list[int], max_shard_bytes: int) -> list[tuple[int, int]]:
  """[lo, hi) entry ranges of consecutive shards, each at most ``max_shard_bytes`` unless one
  tensor alone is over it."""
  bounds, start, acc = [], 0, 0
  for i, size in enumerate(sizes):
    if acc and acc + size > max_shard_bytes:
      bounds.append((start, i))
      start, acc = i, 0
    acc += size
  bounds.append((start, len(sizes)))
  return bounds


def _write_shards(out: pathlib.Path, entries: list, bounds: list[tuple[int, int]]) -> dict:
  """Write each shard's tensors (on host one shard at a time); HF name -> its file name."""
  weight_map = {}
  for shard, (lo, hi) in enumerate(bounds):
    fname = (
      "model.safetensors"
      if len(bounds) == 1
      else f"model-{shard + 1:05d}-of-{len(bounds):05d}.safetensors"
    )
    chunk = {name: _host(leaf, layer) for name, leaf, layer in entries[lo:hi]}
    save_file(chunk, out / fname, metadata={"format": "pt"})
    weight_map.update((name, fname) for name in chunk)
    del chunk
  return weight_map


def save_hf_checkpoint(
  cfg: ModelConfig,
  params,
  out_dir,
  tokenizer=None,
  max_shard_bytes: int = 5 * 2**30,
  untie: bool = False,
  *,
  extra: dict | None = None,
  config_fields: dict | None = None,
) -> pathlib.Path:
  """Write config.json + safetensors in HF layout (sharded with an index above ``max_shard_bytes``).

  Overwrites any earlier weights in ``out_dir``. Host memory peaks at about one shard. Params keep
  their dtype, so ``load_hf_checkpoint`` with that dtype gives them back bitwise. ``untie`` writes
  a tied model as an untied one (an explicit ``lm_head.weight``): vLLM's CPU build keeps a stale
  packed copy of a tied head after ``reload_weights``. ``extra`` (HF name -> array) are written
  beside the decoder's tensors and ``config_fields`` over config.json's (``save_hf_score_model``).
  """
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
    stale.unlink(missing_ok=True)  # a leftover shard of an earlier save would be read back
  entries = _hf_entries(params)
  if untie and cfg.tie_embeddings:
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
    entries.append(("lm_head.weight", params["embed_tokens"][...], None))  # [V, D] both
  entries.extend((name, value, None) for name, value in (extra or {}).items())
  dtype = entries[0][1].dtype
  if np.dtype(dtype) not in _SAFETENSORS_NAMES:
    raise ValueError(
      f"params of dtype {dtype} cannot be saved (supported: "
      f"{sorted(str(d) for d in _SAFETENSORS_NAMES)})"
    )
  config = {**hf_config_from_model(cfg, dtype), **(config_fields or {})}
  (out / "config.json").write_text(json.dumps(config, indent=2))

  # Plan shards from sizes alone so tensors are materialised on host one shard at a time.
  sizes = [
    math.prod(leaf.shape[layer is not None :]) * leaf.dtype.itemsize for _, leaf, layer in entries
  ]
  bounds = _shard_bounds(sizes, max_shard_bytes)
  weight_map = _write_shards(out, entries, bounds)
  if len(bounds) > 1:
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  if tokenizer is not None:
    tokenizer.save_pretrained(out)
  return out


def save_hf_score_model(
  cfg: ModelConfig, params, score_LxD, out_dir, tokenizer=None, pad_id: int | None = None
) -> pathlib.Path:
  """An HF ``*ForSequenceClassification`` directory, as ``load_hf_score_model`` and transformers
  read it: the decoder as ``save_hf_checkpoint`` writes it (no LM head), the head [labels, D] as
  ``score.weight``, and config.json naming the architecture, one label per row of the head and
  the pad id (transformers reads a row's score at its rightmost token that is not the pad)."""
  causal = hf_config_from_model(cfg)["architectures"][0]
  labels = int(score_LxD.shape[0])
  fields = {
    "architectures": [causal.replace("ForCausalLM", "ForSequenceClassification")],
    "id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
    "label2id": {f"LABEL_{i}": i for i in range(labels)},
    "pad_token_id": pad_id,
    "tie_word_embeddings": False,  # no LM head to tie
  }
  return save_hf_checkpoint(
    cfg, params, out_dir, tokenizer, extra={SCORE_HEAD: score_LxD}, config_fields=fields
  )
