"""Dataset files read as numbered rows (``rows``): JSON lines (.jsonl, .ndjson), JSON (a list of
objects, ``{"data": [...]}``, columns, or JSON lines under a .json name), each optionally gzipped;
parquet files, a directory of them laid out as a Hub download (one split's files, never another's);
a ``datasets.save_to_disk`` directory; a Hub dataset id (its cached snapshot's parquet files). Rows
are turned into Python objects a batch at a time. What a row must hold is ``datasets``' to check.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator

from jaxrl.tasks.data import hub

_BATCH_ROWS = 4096  # rows per arrow record batch turned into Python dicts at a time


def _open_text(path: str):
  return (
    gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".gz")
    else open(path, encoding="utf-8")
  )


def _jsonl_rows(path: str) -> Iterator[tuple[int, object]]:
  """(line number, object or None for an unparsable line) of a JSON-lines file."""
  with _open_text(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield number, json.loads(line)
      except json.JSONDecodeError:
        yield number, None


def _json_rows(path: str) -> tuple[Iterable[tuple[int, object]], str]:
  """The rows of a .json file: a list of objects, ``{"data": [...]}``, columns, or JSON lines."""
  with _open_text(path) as f:
    text = f.read()
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    # datasets' to_json writes JSON lines under a .json name.
    if text.lstrip().startswith("{") and "\n" in text.strip():
      return _jsonl_rows(path), "line"
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if isinstance(data, dict):
    columns = [v for v in data.values() if isinstance(v, list)]
    if isinstance(data.get("data"), list):
      data = data["data"]
    elif columns and len(columns) == len(data) and all(len(v) == len(columns[0]) for v in columns):
      data = [dict(zip(data, values)) for values in zip(*data.values())]
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of objects, got a {type(data).__name__}")
  return enumerate(data, 1), "row"


def _batches_rows(batches) -> Iterator[tuple[int, object]]:
  """Numbered rows of arrow record batches / tables, converted to dicts one batch at a time."""
  number = 0
  for batch in batches:
    for row in batch.to_pylist():
      number += 1
      yield number, row


def _parquet_rows(paths: list[str]) -> Iterator[tuple[int, object]]:
  # Imported here: pyarrow (and HF datasets below) are heavy, and only runs that read these
  # formats need them (the built-in tasks read none).
  import pyarrow.parquet as pq

  # One numbering across the files, so default ids stay unique.
  yield from _batches_rows(
    batch for path in paths for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS)
  )


def _disk_rows(path: str, split: str) -> Iterator[tuple[int, object]]:
  import datasets as hf_datasets

  data = hf_datasets.load_from_disk(path)
  if isinstance(data, hf_datasets.DatasetDict):
    if split not in data:
      raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(data)}); set data.split")
    data = data[split]
  # Arrow batches, not Dataset row iteration (that formats each row on its own: ~3x slower).
  return _batches_rows(data.with_format("arrow").iter(batch_size=_BATCH_ROWS))


def _split_of(path: str) -> str:
  """The split a parquet file holds, by the Hub's file names: ``SPLIT-00000-of-00002.parquet``,
  ``SPLIT.parquet`` (a split name has no ``-``)."""
  return os.path.basename(path).removesuffix(".parquet").split("-")[0]


def _parquet_files(path: str) -> list[str]:
  return sorted(
    os.path.join(root, f)
    for root, _, names in os.walk(path)
    for f in names
    if f.endswith(".parquet")
  )


def _hub_parquet(path: str, split: str) -> list[str]:
  """The parquet files of a directory laid out as a hub download: those of ``split`` (named
  ``<split>-*.parquet`` or ``<split>.parquet``); with none of that name, all of them when they
  are one unnamed split (``part-*.parquet``), never files of several other names (another split's
  rows, a test set among them, must not leak in)."""
  files = _parquet_files(path)
  chosen = [p for p in files if _split_of(p) == split]
  names = sorted({_split_of(p) for p in files})
  if chosen or len(names) <= 1:
    return chosen or files
  raise ValueError(
    f"{path}: no parquet file of split {split!r} (files named as splits {names}): set data.split "
    "to one of them or point at that split's files"
  )


def rows(path: str, split: str) -> tuple[Iterable[tuple[int, object]], str]:
  """(numbered rows, "line" or "row": what the numbers count) of any supported format."""
  if (hub_id := hub.dataset_id(path)) is not None:
    split = hub_id.split or hub.split_name(split, path)
    directory = hub.dataset_snapshot(hub_id)
    files = _parquet_files(directory)
    parquet = [f for f in files if _split_of(f) == split]
    if not parquet:
      found = sorted({_split_of(f) for f in files}) or "no parquet files"
      raise ValueError(f"{path}: no {split!r} split in its snapshot {directory} (found: {found})")
    return _parquet_rows(parquet), "row"
  if not os.path.exists(path):
    raise ValueError(f"{path}: no such file or directory")
  if os.path.isdir(path):
    if any(
      os.path.exists(os.path.join(path, name))
      for name in ("dataset_info.json", "dataset_dict.json", "state.json")
    ):
      return _disk_rows(path, split), "row"
    parquet = _hub_parquet(path, split)
    if not parquet:
      raise ValueError(f"{path}: a directory with neither a save_to_disk dataset nor parquet files")
    return _parquet_rows(parquet), "row"
  name = path[:-3] if path.endswith(".gz") else path
  if name.endswith((".jsonl", ".ndjson")):
    return _jsonl_rows(path), "line"
  if name.endswith(".json"):
    return _json_rows(path)
  if path.endswith(".parquet"):
    return _parquet_rows([path]), "row"
  raise ValueError(
    f"{path}: unknown dataset format (use .jsonl, .json, .parquet, a "
    "datasets.save_to_disk directory or a directory of parquet files)"
  )


def named_decoding(rows: Iterable, path: str) -> Iterator:
  """``rows``, with a file that is not UTF-8 text named (a ValueError: the codec's own message
  names neither the file nor the field)."""
  try:
    yield from rows
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
