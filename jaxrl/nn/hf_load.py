"""HF checkpoints -> jaxrl ``Decoder`` params (Qwen2 / Qwen2.5 / Qwen3 / Llama 3.x), and a
sequence-classification checkpoint's decoder and score head.

Loading reads ``config.json`` and safetensors (single file or sharded with an index, through
``hf_safetensors``) and builds each param device block by device block: a block's bytes are read
from the file, cast, and handed to its device(s). So beyond what the devices hold, host memory
holds one device block, one read chunk and the block or two before it that jax's runtime releases
lazily after their transfer, for loop and scanned (stacked [L, ...]) params alike: never a whole
tensor unless a device's block is one; tests/sharded_load_check.py measures it. Each param's HF
tensor is named by ``hf.hf_name``; a tensor no param reads is an error.
"""

from __future__ import annotations

import contextlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.nn import model as jaxrl_model
from jaxrl.nn.hf import SCORE_HEAD, hf_name, is_stacked, param_key
from jaxrl.nn.hf_config import load_model_config
from jaxrl.nn.hf_safetensors import open_tensor_files, read_into, same_tensor
from jaxrl.nn.model import ModelConfig


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _assemble(shape, sharding, read_block) -> jax.Array:
  """A global array from ``read_block(index)``, reading each distinct device block once and
  holding one block on host at a time; ``sharding=None``: the whole array on the default device."""
  full = tuple(slice(0, n) for n in shape)
  if sharding is None:
    return jnp.asarray(read_block(full))
  by_block: dict[tuple, list] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    by_block.setdefault(tuple((s.start, s.stop) for s in index), []).append((device, index))
  on_device = {}
  for group in by_block.values():
    block = read_block(group[0][1])
    for device, _ in group:
      on_device[device] = jax.device_put(block, device)
    # A transfer may read ``block`` asynchronously: wait, or later blocks would pile up on host.
    jax.block_until_ready([on_device[device] for device, _ in group])
    del block
  arrays = [on_device[d] for d in sharding.addressable_devices_indices_map(shape)]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _placement(shardings) -> dict | None:
  """jaxrl param key -> its sharding, from a pytree of shardings (None: the default device)."""
  if shardings is None:
    return None
  return {param_key(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


class _ParamLoader:
  """Builds each param (a ``tree_map_with_path`` leaf function) from a checkpoint's open tensors,
  recording in ``expected`` the HF names it needed."""

  def __init__(self, path, cfg: ModelConfig, handles: dict, placement: dict | None, np_dtype):
    self.path, self.cfg, self.handles = path, cfg, handles
    self.placement, self.np_dtype = placement, np_dtype
    self.expected = set()

  def _check(self, name, key, want):
    self.expected.add(name)
    if name not in self.handles:
      raise ValueError(f"{self.path}: tensor {name!r} (jaxrl {'/'.join(map(str, key))}) is missing")
    shape = self.handles[name].tensors[name][1]
    if shape != want:
      raise ValueError(
        f"{self.path}: tensor {name!r} has shape {shape}, config.json implies {want}"
      )

  def _block_reader(self, names, stacked):
    """``read_block(index)`` for ``_assemble``: one block of the param, layer by layer when
    stacked (``names``: the HF tensor of each layer, else the param's one tensor)."""
    handles, np_dtype = self.handles, self.np_dtype

    def read_block(index):
      out = np.empty(tuple(s.stop - s.start for s in index), np_dtype)
      if stacked:
        for j, layer in enumerate(range(index[0].start, index[0].stop)):
          read_into(handles[names[layer]], names[layer], index[1:], out[j])
      else:
        read_into(handles[names[0]], names[0], index, out)
      return out

    return read_block

  def __call__(self, key_path, var):
    key = param_key(key_path)
    stacked = is_stacked(key)
    per_layer = [("layers", i, *key[1:]) for i in range(self.cfg.num_layers)] if stacked else [key]
    names = [hf_name(k) for k in per_layer]
    inner = var.shape[1:] if stacked else var.shape
    for name in names:
      self._check(name, key, tuple(inner))
    if self.placement is not None and key not in self.placement:
      raise ValueError(f"shardings has no entry for {'/'.join(map(str, key))}")
    sharding = None if self.placement is None else self.placement[key]
    read_block = self._block_reader(names, stacked)
    return var.replace(_assemble(var.shape, sharding, read_block))


def _unexpected_tensors(path, cfg: ModelConfig, handles: dict, expected: set) -> list[str]:
  """The checkpoint's tensors no param was read from (a tied model's head must equal the
  embedding, which it then replaces; RoPE ``inv_freq`` buffers are ignored)."""
  unexpected = sorted(n for n in set(handles) - expected if not n.endswith("rotary_emb.inv_freq"))
  if cfg.tie_embeddings and "lm_head.weight" in unexpected:
    head, embed = ("lm_head.weight", "model.embed_tokens.weight")
    if not same_tensor(handles[head], head, handles[embed], embed):
      raise ValueError(
        f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
        "model.embed_tokens.weight"
      )
    unexpected.remove("lm_head.weight")
  return unexpected


def _load_params(path: pathlib.Path, cfg: ModelConfig, shardings, dtype, extra=None):
  """(graphdef, params, {name: array}) of ``cfg``'s Decoder read from ``path``, and of the
  ``extra`` tensors besides (HF name -> (shape, sharding or None)); any other tensor is an error."""
  graphdef, abstract = jaxrl_model.abstract(cfg)
  placement = _placement(shardings)
  np_dtype = np.dtype(dtype)

  with contextlib.ExitStack() as stack:
    handles = open_tensor_files(path, stack)
    loader = _ParamLoader(path, cfg, handles, placement, np_dtype)
    params = jax.tree_util.tree_map_with_path(loader, abstract, is_leaf=_is_var)
    extras = {}
    for name, (shape, sharding) in (extra or {}).items():
      loader._check(name, (name,), tuple(shape))
      extras[name] = _assemble(shape, sharding, loader._block_reader([name], stacked=False))
    unexpected = _unexpected_tensors(path, cfg, handles, loader.expected)
  if unexpected:
    raise ValueError(
      f"{path}: unexpected tensors {unexpected[:8]}"
      f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all)"
    )
  return graphdef, params, extras


def load_hf_checkpoint(
  path,
  dtype=jnp.float32,
  shardings=None,
  *,
  scan_layers: bool = False,
  remat: str = "none",
  compute_dtype: str = "float32",
):
  """(ModelConfig, graphdef, params) from an HF directory, streamed and cast to ``dtype``.

  ``dtype`` becomes ``ModelConfig.param_dtype``; ``scan_layers``, ``remat`` and ``compute_dtype``
  (``ModelConfig.dtype``) say how to run it. ``shardings``: None (default device) or a pytree of
  ``NamedSharding`` with the structure of the params, e.g. ``sharding.tree_shardings(
  model.abstract(load_model_config(path, scan_layers=True))[1], mesh)``.
  """
  path = pathlib.Path(path)
  cfg = load_model_config(
    path,
    param_dtype=jnp.dtype(dtype).name,
    scan_layers=scan_layers,
    remat=remat,
    dtype=compute_dtype,
  )
  graphdef, params, _ = _load_params(path, cfg, shardings, dtype)
  return cfg, graphdef, params


def load_hf_score_model(
  path, cfg: ModelConfig, dtype=jnp.float32, shardings=None, score_sharding=None
):
  """(graphdef, params, score_LxD) of an HF ``*ForSequenceClassification`` directory whose decoder
  ``cfg`` describes (``cfg.tie_embeddings`` true: such a checkpoint has no LM head); the head
  [labels, D] is placed on ``score_sharding`` (None: the default device)."""
  path = pathlib.Path(path)
  if not cfg.tie_embeddings:
    raise ValueError("load_hf_score_model: cfg.tie_embeddings must be true (no LM head is read)")
  with contextlib.ExitStack() as stack:
    handles = open_tensor_files(path, stack)
    if SCORE_HEAD not in handles:
      raise ValueError(f"{path}: no {SCORE_HEAD} tensor: not a sequence-classification checkpoint")
    labels = handles[SCORE_HEAD].tensors[SCORE_HEAD][1][0]
  extra = {SCORE_HEAD: ((labels, cfg.hidden_size), score_sharding)}
  graphdef, params, extras = _load_params(path, cfg, shardings, dtype, extra)
  return graphdef, params, extras[SCORE_HEAD]
