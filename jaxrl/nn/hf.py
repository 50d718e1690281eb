"""Hugging Face checkpoints <-> jaxrl ``Decoder`` params (Qwen2 / Qwen2.5 / Qwen3 / Llama 3.x).

Loading reads ``config.json`` and safetensors (single file or sharded with an index) and builds each
param device block by device block: a block's bytes are read from the file with ``pread`` (only
the rows it needs, never a memory map whose pages would pile up in the process), cast, and handed
to its device(s). So beyond what the devices hold, host memory holds one device block, one read
chunk (``_READ_CHUNK_BYTES``) and the block or two before it that jax's runtime releases lazily
after their transfer, for loop and scanned (stacked [L, ...]) params alike: never a whole tensor
unless a device's block is one. A block that takes only some columns of HF's rows (e.g. an
fsdp-split input dim) reads whole rows chunk by chunk: bounded memory, at the price of re-reading
those rows (from the page cache) once per column block; tests/sharded_load_check.py measures it.
What the files say is checked before it is used: a header's length against the file's size, each
tensor's offsets against the file's data, and an index's shard names against its directory (a
name with ``..`` or an absolute path is refused), each failure a ``ValueError`` naming the file.
Export writes the same HF layout with numpy only (no torch), which both transformers and a vLLM
sidecar's ``reload_weights`` read.

Name map (HF -> jaxrl): ``model.`` prefix dropped; ``{q,k,v}_proj.bias`` become ``{q,k,v}_bias``;
with ``scan_layers`` the L tensors ``model.layers.{l}.X`` are one param ``layers/X`` of shape
[L, ...]. Every tensor keeps HF's layout (kernels [out, in], ``model.PARAM_LAYOUT``): no transposes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import struct
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxrl.nn import model as jaxrl_model
from jaxrl.nn.hf_config import hf_config_from_model, load_model_config
from jaxrl.nn.model import ModelConfig
from jaxrl.parallel import distributed

_SAFETENSORS_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
}
_SAFETENSORS_NAMES = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}
# File rows are read in pieces of about this size when they cannot go straight into the block
# (a column slice or a cast): host memory then holds the block plus one piece.
_READ_CHUNK_BYTES = 8 * 2**20
# The longest safetensors header read (the safetensors library's own limit); a checkpoint's is
# kilobytes. A header length is also bounded by the file's size, so a corrupt or hostile length
# is an error naming the file, never an allocation of that size.
_MAX_HEADER_BYTES = 100_000_000


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


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


def _is_stacked(key: tuple) -> bool:
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


class _SafetensorsFile:
  """One safetensors file read by explicit ``pread``s of row ranges (no mmap, no full reads)."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    self._fd = os.open(path, os.O_RDONLY)
    try:
      file_bytes = os.fstat(self._fd).st_size
      header, self._base = self._header(file_bytes)
      self.tensors = {
        name: _tensor_entry(path, name, info, file_bytes - self._base)
        for name, info in header.items()
      }
    except BaseException:
      os.close(self._fd)
      raise

  def _header(self, file_bytes: int) -> tuple[dict, int]:
    """The JSON header (without ``__metadata__``) and where the tensor data starts, the header's
    length checked against the file's size before anything that long is read."""
    path = self.path
    if file_bytes < 8:
      raise ValueError(f"{path}: not a safetensors file ({file_bytes} bytes, no header length)")
    (size,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
    if size > file_bytes - 8:
      raise ValueError(
        f"{path}: not a safetensors file (a header of {size} bytes, but the file has "
        f"{file_bytes} bytes)"
      )
    if size > _MAX_HEADER_BYTES:
      raise ValueError(
        f"{path}: not a safetensors file (a header of {size} bytes, over the format's limit of "
        f"{_MAX_HEADER_BYTES})"
      )
    try:
      header = json.loads(os.pread(self._fd, size, 8))
    except ValueError as e:  # JSON or UTF-8
      raise ValueError(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
      raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + size

  def close(self):
    os.close(self._fd)

  def row_bytes(self, name: str) -> int:
    dtype, shape, _ = self.tensors[name]
    return math.prod(shape[1:]) * dtype.itemsize

  def rows(self, name: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows lo..hi-1 (along axis 0) of a tensor, read into ``out`` (C-contiguous, the tensor's
    dtype) when given."""
    dtype, shape, begin = self.tensors[name]
    if not shape:
      raise ValueError(f"{self.path}: tensor {name!r} is 0-d, no parameter is")
    if out is None:
      out = np.empty((hi - lo, *shape[1:]), dtype)
    assert out.dtype == dtype and out.shape == (hi - lo, *shape[1:]) and out.flags.c_contiguous, (
      out.dtype,
      out.shape,
    )
    view = out.reshape(-1).view(np.uint8)
    offset, done = self._base + begin + lo * self.row_bytes(name), 0
    while done < view.size:  # pread may return fewer bytes than asked
      n = os.preadv(self._fd, [view[done:]], offset + done)
      if n <= 0:
        raise ValueError(f"{self.path}: tensor {name!r} is truncated")
      done += n
    return out


def _tensor_entry(path, name: str, info, data_bytes: int) -> tuple[np.dtype, tuple, int]:
  """(dtype, shape, data offset) of one header entry, checked: a known dtype, a shape of
  non-negative ints, and data inside the file's ``data_bytes`` that fit the shape exactly."""
  try:
    dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
  except (TypeError, KeyError, ValueError):
    raise ValueError(
      f"{path}: tensor {name!r} has no dtype, shape and data_offsets [begin, end]"
    ) from None
  if dtype_name not in _SAFETENSORS_DTYPES:
    raise ValueError(
      f"{path}: tensor {name!r} has dtype {dtype_name}, expected one of "
      f"{sorted(_SAFETENSORS_DTYPES)}"
    )
  if not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
    raise ValueError(f"{path}: tensor {name!r} has a shape or data_offsets that are not counts")
  if not begin <= end <= data_bytes:
    raise ValueError(
      f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] outside the file's "
      f"{data_bytes} bytes of data"
    )
  dtype = np.dtype(_SAFETENSORS_DTYPES[dtype_name])
  if end - begin != math.prod(shape) * dtype.itemsize:
    raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape}")
  return dtype, shape, begin


def _inside(name: str) -> bool:
  """Whether a file name from an index stays in the index's directory: relative, no ``..``."""
  parts = pathlib.PurePosixPath(name).parts
  return bool(name) and not os.path.isabs(name) and ".." not in parts


def _index_files(index: pathlib.Path) -> list[str]:
  """The file names an index's ``weight_map`` lists, each checked to lie in its directory."""
  try:
    weight_map = json.loads(index.read_text()).get("weight_map")
  except (ValueError, AttributeError) as e:
    raise ValueError(f"{index}: not a JSON object with a weight_map ({e})") from None
  if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
    raise ValueError(f"{index}: weight_map must map each tensor name to a file name")
  names = sorted(set(weight_map.values()))
  for name in names:
    if not _inside(name):
      raise ValueError(
        f"{index}: weight_map names the file {name!r}, outside the checkpoint directory "
        "(shards lie beside the index)"
      )
  return names


def _tensor_files(path: pathlib.Path) -> list[pathlib.Path]:
  """The safetensors files of an HF directory (single file or every shard of an index)."""
  single, index = path / "model.safetensors", path / "model.safetensors.index.json"
  if single.exists():
    return [single]
  if index.exists():
    return [path / f for f in _index_files(index)]
  raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


def _read_into(handle: _SafetensorsFile, name: str, index: tuple, out: np.ndarray):
  """Fill ``out`` with the block ``index`` (slices) of one HF tensor, cast to ``out.dtype``:
  straight from the file when its rows are the block's, else chunk by chunk."""
  dtype, shape, _ = handle.tensors[name]
  rows, *cols = index
  whole_rows = all((c.start, c.stop) == (0, n) for c, n in zip(cols, shape[1:]))
  if whole_rows and dtype == out.dtype:
    handle.rows(name, rows.start, rows.stop, out=out)
    return
  step = max(1, _READ_CHUNK_BYTES // max(1, handle.row_bytes(name)))
  for lo in range(rows.start, rows.stop, step):
    hi = min(lo + step, rows.stop)
    out[lo - rows.start : hi - rows.start] = handle.rows(name, lo, hi)[(slice(None), *cols)]


def _same_tensor(a: _SafetensorsFile, a_name: str, b: _SafetensorsFile, b_name: str) -> bool:
  """Whether two tensors are equal, compared chunk by chunk."""
  if a.tensors[a_name][:2] != b.tensors[b_name][:2]:  # dtype and shape
    return False
  n = a.tensors[a_name][1][0]
  step = max(1, _READ_CHUNK_BYTES // max(1, a.row_bytes(a_name)))
  for lo in range(0, n, step):
    hi = min(lo + step, n)
    if not np.array_equal(a.rows(a_name, lo, hi), b.rows(b_name, lo, hi)):
      return False
  return True


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


def _open_tensor_files(path: pathlib.Path, stack: contextlib.ExitStack) -> dict:
  """HF tensor name -> the open ``_SafetensorsFile`` holding it, every file closed by ``stack``."""
  handles = {}
  for f in _tensor_files(path):
    handle = _SafetensorsFile(f)
    stack.callback(handle.close)
    handles.update((name, handle) for name in handle.tensors)
  return handles


def check_tensor_files(path) -> None:
  """Every tensor file of the HF checkpoint ``path`` opens and its header describes tensors that
  lie inside it (the loader's own checks; headers only, nothing else read): a ValueError naming
  the file otherwise, before a run writes anything."""
  with contextlib.ExitStack() as stack:
    _open_tensor_files(pathlib.Path(path), stack)


def _placement(shardings) -> dict | None:
  """jaxrl param key -> its sharding, from a pytree of shardings (None: the default device)."""
  if shardings is None:
    return None
  return {_key(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


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
          _read_into(handles[names[layer]], names[layer], index[1:], out[j])
      else:
        _read_into(handles[names[0]], names[0], index, out)
      return out

    return read_block

  def __call__(self, key_path, var):
    key = _key(key_path)
    stacked = _is_stacked(key)
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
    if not _same_tensor(handles[head], head, handles[embed], embed):
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
    handles = _open_tensor_files(path, stack)
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


SCORE_HEAD = "score.weight"  # a sequence-classification checkpoint's head [labels, D], no bias


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
    handles = _open_tensor_files(path, stack)
    if SCORE_HEAD not in handles:
      raise ValueError(f"{path}: no {SCORE_HEAD} tensor: not a sequence-classification checkpoint")
    labels = handles[SCORE_HEAD].tensors[SCORE_HEAD][1][0]
  extra = {SCORE_HEAD: ((labels, cfg.hidden_size), score_sharding)}
  graphdef, params, extras = _load_params(path, cfg, shardings, dtype, extra)
  return graphdef, params, extras[SCORE_HEAD]


def _hf_entries(params) -> list[tuple[str, object, int | None]]:
  """(HF name, leaf, layer index into a stacked leaf or None) for every HF tensor,
  a scanned model's stacked leaves expanded layer by layer where they first appear."""
  entries, stacked = [], []
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = _key(key_path)
    if _is_stacked(key):
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
