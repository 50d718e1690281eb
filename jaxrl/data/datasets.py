"""Local question/answer datasets: jsonl, json, parquet, or a ``datasets.save_to_disk`` directory.

A field mapping (dotted paths into a row, e.g. ``reward_model.ground_truth`` for verl-style rows)
picks the question, the answer and optionally an id and a level. Rows with an empty question or no
answer are dropped and counted (``strict``: the first one is an error naming the file and row); a
field that no row has is always an error listing the keys the rows do have. A training mixture is
several datasets with weights, each one pool of the deterministic ``MixtureCursor``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator

import numpy as np

from jaxrl.config import ConfigError, parse_mixture
from jaxrl.data.cursor import Mixture

log = logging.getLogger(__name__)
_EXAMPLES = 5
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Fields:
  """Dotted paths into a row."""
  question: str = "problem"
  answer: str = "answer"
  id: str = ""          # "" = "SOURCE#ROW"
  level: str = ""       # "" = one level


@dataclasses.dataclass
class Questions:
  """The valid rows of one or more datasets, in file order."""
  questions: list[str]
  answers: list[str]
  ids: list[str]
  levels: list[str]
  sources: list[str]

  def __len__(self) -> int:
    return len(self.questions)

  @staticmethod
  def concat(parts: list[Questions]) -> Questions:
    return Questions(*([x for p in parts for x in getattr(p, f.name)]
                       for f in dataclasses.fields(Questions)))


@dataclasses.dataclass(frozen=True)
class RowReport:
  """What validation found in one file; ``str(report)`` is its log line."""
  source: str
  total: int
  kept: int
  missing_answer: int
  empty_question: int
  malformed: int
  examples: tuple[str, ...]

  def __str__(self) -> str:
    dropped = self.total - self.kept
    text = f"{self.source}: {self.total} rows, {self.kept} kept"
    if dropped:
      text += (f", {dropped} dropped ({self.missing_answer} without an answer, "
               f"{self.empty_question} with an empty question, {self.malformed} malformed; "
               f"{'; '.join(self.examples)})")
    return text


def _get(row, path: str):
  node = row
  for key in path.split("."):
    if isinstance(node, dict) and key in node:
      node = node[key]
    elif isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
      node = node[int(key)]
    else:
      return _MISSING
  return node


def _text(value) -> str | None:
  """A field as text: strings stripped, numbers without a spurious ".0"; None when empty."""
  if value is _MISSING or value is None:
    return None
  if isinstance(value, bool):
    value = str(value)
  elif isinstance(value, (int, np.integer)):
    value = str(int(value))
  elif isinstance(value, (float, np.floating)):
    if not math.isfinite(value):
      return None
    value = str(int(value)) if float(value).is_integer() else repr(float(value))
  elif isinstance(value, (list, tuple)) and len(value) == 1:   # e.g. answers stored as ["42"]
    return _text(value[0])
  elif not isinstance(value, str):
    return None
  value = value.strip()
  return value or None


def _jsonl_rows(path: str) -> Iterator[tuple[int, object]]:
  """(line number, object or _MISSING for an unparsable line) of a jsonl file."""
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield number, json.loads(line)
      except json.JSONDecodeError:
        yield number, _MISSING


def _json_rows(path: str) -> Iterator[tuple[int, object]]:
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if isinstance(data, dict):   # {"data": [...]} or a column dict {"problem": [...], ...}
    lists = [v for v in data.values() if isinstance(v, list)]
    if "data" in data and isinstance(data["data"], list):
      data = data["data"]
    elif lists and all(len(v) == len(lists[0]) for v in lists) and len(lists) == len(data):
      data = [dict(zip(data, values)) for values in zip(*data.values())]
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of objects")
  yield from enumerate(data, 1)


def _parquet_rows(paths: list[str]) -> Iterator[tuple[int, object]]:
  import pyarrow.parquet as pq

  number = 0
  for path in paths:
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
      for row in batch.to_pylist():
        number += 1
        yield number, row


def _disk_rows(path: str, split: str) -> Iterator[tuple[int, object]]:
  import datasets as hf_datasets

  data = hf_datasets.load_from_disk(path)
  if isinstance(data, hf_datasets.DatasetDict):
    if split not in data:
      raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(data)}); set data.split")
    data = data[split]
  yield from enumerate(data, 1)   # rows as dicts, read batch by batch from the arrow files


def _rows(path: str, split: str) -> Iterator[tuple[int, object]]:
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such file or directory")
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(
        os.path.join(path, "dataset_dict.json")):
      return _disk_rows(path, split)
    # A hub download: data/<split>-*.parquet, or parquet files at the top.
    parquet = sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files
                     if f.endswith(".parquet"))
    chosen = [p for p in parquet if os.path.basename(p).startswith(split)] or parquet
    if not chosen:
      raise ValueError(f"{path}: a directory with neither a save_to_disk dataset nor parquet files")
    return _parquet_rows(chosen)
  if path.endswith((".jsonl", ".jsonl.gz")) or path.endswith(".ndjson"):
    return _jsonl_rows(path)
  if path.endswith(".json"):
    return _json_rows(path)
  if path.endswith(".parquet"):
    return _parquet_rows([path])
  raise ValueError(f"{path}: unknown dataset format (use .jsonl, .json, .parquet or a "
                   "datasets.save_to_disk directory)")


def _keys(row) -> str:
  return ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__


def load_questions(path: str, fields: Fields, *, split: str = "train", strict: bool = False,
                   limit: int = 0) -> tuple[Questions, RowReport]:
  """The valid rows of one dataset (at most ``limit`` > 0 of them) and what validation found."""
  source = os.path.basename(path.rstrip("/")) or path
  out = Questions([], [], [], [], [])
  counts = dict(total=0, missing_answer=0, empty_question=0, malformed=0)
  examples: list[str] = []
  seen = {name: False for name in ("question", "answer", "id", "level") if getattr(fields, name)}
  first_row = None

  def bad(kind: str, where: str, what: str):
    counts[kind] += 1
    if strict:
      raise ValueError(f"{path}: {where}: {what} (data.strict is on)")
    if len(examples) < _EXAMPLES:
      examples.append(f"{where}: {what}")

  for number, row in _rows(path, split):
    if limit and len(out) >= limit:
      break
    counts["total"] += 1
    where = f"line {number}" if path.endswith((".jsonl", ".ndjson")) else f"row {number}"
    if not isinstance(row, dict):
      bad("malformed", where, "not a JSON object")
      continue
    first_row = first_row if first_row is not None else row
    values = {name: _get(row, getattr(fields, name)) for name in seen}
    for name, value in values.items():
      seen[name] |= value is not _MISSING
    question, answer = _text(values["question"]), _text(values["answer"])
    if question is None:
      bad("empty_question", where, f"empty or missing question ({fields.question!r})")
      continue
    if answer is None:
      bad("missing_answer", where, f"missing answer ({fields.answer!r})")
      continue
    out.questions.append(question)
    out.answers.append(answer)
    out.ids.append(_text(values.get("id", _MISSING)) or f"{source}#{number}")
    out.levels.append(_text(values.get("level", _MISSING)) or "")
    out.sources.append(path)
  unmapped = [name for name, hit in seen.items() if not hit]
  if counts["total"] and first_row is not None and unmapped:
    name = unmapped[0]
    raise ValueError(f"{path}: no row has the {name} field {getattr(fields, name)!r} (set "
                     f"data.{name}_field; the first row has: {_keys(first_row)})")
  report = RowReport(source=path, kept=len(out), examples=tuple(examples), **counts)
  log.info("%s", report)
  if not len(out):
    raise ValueError(f"{path}: no usable row ({report})")
  return out, report


def load_mixture(spec: str, fields: Fields, *, split: str = "train", strict: bool = False,
                 field: str = "data.train") -> tuple[Questions, Mixture, list[RowReport]]:
  """``"PATH[:WEIGHT],..."`` → the datasets concatenated, and a Mixture with one pool per dataset."""
  parts = parse_mixture(spec, field)
  if not parts:
    raise ConfigError(field, "no dataset given (expected PATH[:WEIGHT],...)")
  loaded, reports = [], []
  for path, _ in parts:
    try:
      questions, report = load_questions(path, fields, split=split, strict=strict)
    except (OSError, ValueError) as e:
      raise ConfigError(field, str(e)) from None
    loaded.append(questions)
    reports.append(report)
  pools, start = [], 0
  for q in loaded:
    pools.append(np.arange(start, start + len(q), dtype=np.int32))
    start += len(q)
  return Questions.concat(loaded), Mixture(tuple(pools), tuple(w for _, w in parts)), reports
