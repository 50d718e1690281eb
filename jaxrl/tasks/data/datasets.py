"""Local question/answer datasets: jsonl, json, parquet, or a ``datasets.save_to_disk`` directory.

A field mapping (dotted paths into a row, e.g. ``reward_model.ground_truth`` for verl-style rows)
picks the question, the answer and optionally an id and a level. Rows with an empty question or no
answer are dropped and counted (``strict``: the first one is an error naming the file and row); a
field that no row has is always an error listing the keys the rows do have. A training mixture is
several datasets with weights, each one pool of the deterministic ``MixtureCursor``.

The files are read by ``dataset_readers``; here each row is checked and its fields picked.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import numpy as np

from jaxrl.fields import ConfigError
from jaxrl.tasks.data.cursor import Mixture
from jaxrl.tasks.data.dataset_readers import named_decoding, rows
from jaxrl.tasks.mixture import parse_mixture

log = logging.getLogger(__name__)
_EXAMPLES = 5
_MISSING = object()  # a field the row does not have (None is a field set to null)
_NOT_TEXT = object()  # a field holding a list or dict: not usable as text


@dataclasses.dataclass(frozen=True)
class Fields:
  """Dotted paths into a row."""

  question: str = "problem"
  answer: str = "answer"
  id: str = ""  # "" = "SOURCE#ROW"
  level: str = ""  # "" = one level


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
    return Questions(
      *([x for p in parts for x in getattr(p, f.name)] for f in dataclasses.fields(Questions))
    )


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
      text += (
        f", {dropped} dropped ({self.missing_answer} without an answer, "
        f"{self.empty_question} with an empty question, {self.malformed} malformed; "
        f"{'; '.join(self.examples)})"
      )
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


def _text(value):
  """A field as stripped text (ints without a spurious ".0"); None when empty or null."""
  if value is _MISSING or value is None:
    return None
  if isinstance(value, str):
    return value.strip() or None
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, (int, np.integer)):
    return str(int(value))
  if isinstance(value, (float, np.floating)):
    if not math.isfinite(value):
      return None
    return str(int(value)) if float(value).is_integer() else repr(float(value))
  if isinstance(value, (list, tuple)) and len(value) == 1:  # e.g. answers stored as ["42"]
    return _text(value[0])
  return _NOT_TEXT


def _describe(row: dict, path: str) -> str:
  """The keys a row does have, down the dotted path as far as it exists."""
  text, node = f"the first row has: {', '.join(sorted(map(str, row)))}", row
  keys = path.split(".")
  for depth, key in enumerate(keys[:-1]):
    if not (isinstance(node, dict) and key in node):
      break
    node = node[key]
    inner = (
      ", ".join(sorted(map(str, node))) if isinstance(node, dict) else f"a {type(node).__name__}"
    )
    text += f"; its {'.'.join(keys[: depth + 1])!r} is {inner}"
  return text


class _RowChecker:
  """Validates rows one at a time: counts what is dropped and why (``strict``: the first dropped
  row is an error), keeps a few examples, and notes which mapped fields some row has."""

  def __init__(self, path: str, fields: Fields, strict: bool):
    self.path, self.strict = path, strict
    self.mapped = {
      name: getattr(fields, name)
      for name in ("question", "answer", "id", "level")
      if getattr(fields, name)
    }
    self.seen = dict.fromkeys(self.mapped, False)
    self.first_row = None
    self.counts = dict(total=0, missing_answer=0, empty_question=0, malformed=0)
    self.examples: list[str] = []

  def _bad(self, kind: str, where: str, what: str, row=None):
    self.counts[kind] += 1
    if self.strict:
      keys = f" (the row has: {', '.join(sorted(map(str, row)))})" if row is not None else ""
      raise ValueError(f"{self.path}: {where}: {what}{keys} (data.strict is on)")
    if len(self.examples) < _EXAMPLES:
      self.examples.append(f"{where}: {what}")

  def __call__(self, row, where: str) -> tuple[str, str, dict] | None:
    """(question, answer, every mapped field's value) of a valid row, else None (counted)."""
    self.counts["total"] += 1
    if not isinstance(row, dict):
      self._bad("malformed", where, "not a JSON object")
      return None
    if self.first_row is None:
      self.first_row = row
    values = {name: _get(row, field) for name, field in self.mapped.items()}
    for name, value in values.items():
      if value is not _MISSING:
        self.seen[name] = True
    question, answer = _text(values["question"]), _text(values["answer"])
    if question is None or answer is None:
      name = "question" if question is None else "answer"
      absent = values[name] is _MISSING
      what = f"{'no' if absent else 'empty'} {name} ({self.mapped[name]!r})"
      self._bad(
        "empty_question" if name == "question" else "missing_answer",
        where,
        what,
        row if absent else None,
      )
      return None
    if question is _NOT_TEXT or answer is _NOT_TEXT:
      name = "question" if question is _NOT_TEXT else "answer"
      kind = type(values[name]).__name__
      self._bad("malformed", where, f"the {name} ({self.mapped[name]!r}) is a {kind}, not text")
      return None
    return question, answer, values

  def check_fields(self):
    """Raise when there are rows but no row has some mapped field (a wrong field mapping)."""
    unmapped = [name for name, hit in self.seen.items() if not hit]
    if self.first_row is not None and unmapped:
      name = unmapped[0]
      raise ValueError(
        f"{self.path}: no row has the {name} field {self.mapped[name]!r} (set "
        f"data.{name}_field; {_describe(self.first_row, self.mapped[name])})"
      )

  def report(self, kept: int) -> RowReport:
    return RowReport(source=self.path, kept=kept, examples=tuple(self.examples), **self.counts)


def load_questions(
  path: str, fields: Fields, *, split: str = "train", strict: bool = False, limit: int = 0
) -> tuple[Questions, RowReport]:
  """The valid rows of one dataset (at most ``limit`` > 0 of them) and what validation found."""
  source = os.path.basename(path.rstrip("/")) or path
  numbered, unit = rows(path, split)
  out = Questions([], [], [], [], [])
  check = _RowChecker(path, fields, strict)
  for number, row in named_decoding(numbered, path):
    if limit and len(out) >= limit:
      break
    valid = check(row, f"{unit} {number}")
    if valid is None:
      continue
    question, answer, values = valid
    row_id, level = _text(values.get("id")), _text(values.get("level"))
    out.questions.append(question)
    out.answers.append(answer)
    out.ids.append(row_id if isinstance(row_id, str) else f"{source}#{number}")
    out.levels.append(level if isinstance(level, str) else "")
    out.sources.append(path)
  check.check_fields()
  report = check.report(kept=len(out))
  log.info("%s", report)
  if not len(out):
    raise ValueError(f"{path}: no usable row ({report})")
  return out, report


def load_mixture(
  spec: str,
  fields: Fields,
  *,
  split: str = "train",
  strict: bool = False,
  field: str = "data.train",
) -> tuple[Questions, Mixture, list[RowReport]]:
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
  sizes = np.cumsum([0] + [len(q) for q in loaded])
  pools = tuple(np.arange(a, b, dtype=np.int32) for a, b in zip(sizes[:-1], sizes[1:]))
  return Questions.concat(loaded), Mixture(pools, tuple(w for _, w in parts)), reports
