"""Safetensors files, read and checked before anything they say is used.

A file is read by explicit ``pread``s of row ranges (``SafetensorsFile``: only the rows a block
needs, never a memory map whose pages would pile up in the process); a block that takes only some
columns of the rows reads whole rows chunk by chunk (``read_into``), at the price of re-reading
them (from the page cache) once per column block. A header's length is checked against the
file's size, each tensor's offsets against the file's data, and an index's shard names against
its directory (a name with ``..`` or an absolute path is refused), each failure a ``ValueError``
naming the file. ``check_tensor_files`` runs those checks alone, before a run writes anything.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import struct

import ml_dtypes
import numpy as np

SAFETENSORS_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
}
# File rows are read in pieces of about this size when they cannot go straight into the block
# (a column slice or a cast): host memory then holds the block plus one piece.
_READ_CHUNK_BYTES = 8 * 2**20
# The longest safetensors header read (the safetensors library's own limit); a checkpoint's is
# kilobytes. A header length is also bounded by the file's size, so a corrupt or hostile length
# is an error naming the file, never an allocation of that size.
_MAX_HEADER_BYTES = 100_000_000


class SafetensorsFile:
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
  if dtype_name not in SAFETENSORS_DTYPES:
    raise ValueError(
      f"{path}: tensor {name!r} has dtype {dtype_name}, expected one of "
      f"{sorted(SAFETENSORS_DTYPES)}"
    )
  if not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
    raise ValueError(f"{path}: tensor {name!r} has a shape or data_offsets that are not counts")
  if not begin <= end <= data_bytes:
    raise ValueError(
      f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] outside the file's "
      f"{data_bytes} bytes of data"
    )
  dtype = np.dtype(SAFETENSORS_DTYPES[dtype_name])
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


def read_into(handle: SafetensorsFile, name: str, index: tuple, out: np.ndarray):
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


def same_tensor(a: SafetensorsFile, a_name: str, b: SafetensorsFile, b_name: str) -> bool:
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


def open_tensor_files(path: pathlib.Path, stack: contextlib.ExitStack) -> dict:
  """HF tensor name -> the open ``SafetensorsFile`` holding it, every file closed by ``stack``."""
  handles = {}
  for f in _tensor_files(path):
    handle = SafetensorsFile(f)
    stack.callback(handle.close)
    handles.update((name, handle) for name in handle.tensors)
  return handles


def check_tensor_files(path) -> None:
  """Every tensor file of the HF checkpoint ``path`` opens and its header describes tensors that
  lie inside it (the loader's own checks; headers only, nothing else read): a ValueError naming
  the file otherwise, before a run writes anything."""
  with contextlib.ExitStack() as stack:
    open_tensor_files(pathlib.Path(path), stack)
