"""Local datasets: the same rows from jsonl, json, parquet and save_to_disk; field mapping; row
validation counts and strict errors; weighted mixtures drawn by the data cursor."""

from __future__ import annotations

import gzip
import json

import datasets as hf_datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl.config import ConfigError
from jaxrl.tasks.data.cursor import MixtureCursor, next_mixture_batch
from jaxrl.tasks.data.datasets import Fields, load_mixture, load_questions

ROWS = [
  {"problem": "What is 1+1?", "answer": "2", "meta": {"gt": "2", "level": "easy"}, "uid": "a"},
  {
    "problem": "Half of 3?",
    "answer": "\\frac{3}{2}",
    "meta": {"gt": "3/2", "level": "hard"},
    "uid": "b",
  },
  {"problem": "  ", "answer": "1", "meta": {"gt": "1", "level": "easy"}, "uid": "c"},
  {"problem": "Seven times six?", "answer": 42, "meta": {"gt": 42, "level": "easy"}, "uid": "d"},
  {"problem": "No answer here", "answer": None, "meta": {"gt": None, "level": "hard"}, "uid": "e"},
  {
    "problem": "Quarter as decimal?",
    "answer": 0.25,
    "meta": {"gt": 0.25, "level": "hard"},
    "uid": "f",
  },
]
KEPT = (
  ["What is 1+1?", "Half of 3?", "Seven times six?", "Quarter as decimal?"],
  ["2", "\\frac{3}{2}", "42", "0.25"],
)


def _write_all(tmp_path):
  jsonl = tmp_path / "d.jsonl"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  as_json = tmp_path / "d.json"
  as_json.write_text(json.dumps(ROWS))
  # Arrow needs one type per column: answers as strings there (numbers are tested in jsonl).
  typed = [
    {
      **r,
      "answer": None if r["answer"] is None else str(r["answer"]),
      "meta": {**r["meta"], "gt": None if r["meta"]["gt"] is None else str(r["meta"]["gt"])},
    }
    for r in ROWS
  ]
  parquet = tmp_path / "d.parquet"
  pq.write_table(pa.Table.from_pylist(typed), parquet)
  disk = tmp_path / "disk"
  hf_datasets.Dataset.from_list(typed).save_to_disk(str(disk))
  disk_dict = tmp_path / "disk_dict"
  hf_datasets.DatasetDict(
    {
      "train": hf_datasets.Dataset.from_list(typed),
      "test": hf_datasets.Dataset.from_list(typed[:2]),
    }
  ).save_to_disk(str(disk_dict))
  return [jsonl, as_json, parquet, disk, disk_dict]


def test_every_format_gives_the_same_questions(tmp_path):
  for path in _write_all(tmp_path):
    q, report = load_questions(str(path), Fields(id="uid", level="meta.level"))
    assert (q.questions, q.answers) == KEPT, path
    assert q.ids == ["a", "b", "d", "f"] and q.levels == ["easy", "hard", "easy", "hard"]
    assert (report.total, report.kept, report.empty_question, report.missing_answer) == (6, 4, 1, 1)
    assert "row 3" in report.examples[0] or "line 3" in report.examples[0]


def test_dotted_fields_numeric_answers_default_ids(tmp_path):
  path = _write_all(tmp_path)[0]
  q, _ = load_questions(str(path), Fields(answer="meta.gt"))
  assert q.answers == ["2", "3/2", "42", "0.25"]
  assert q.ids[0] == "d.jsonl#1" and q.levels == [""] * 4


def test_split_of_a_dataset_dict(tmp_path):
  disk_dict = _write_all(tmp_path)[4]
  q, _ = load_questions(str(disk_dict), Fields(), split="test")
  assert q.questions == KEPT[0][:2]
  with pytest.raises(ValueError, match="no split 'val'.*train, test"):
    load_questions(str(disk_dict), Fields(), split="val")


def test_strict_names_the_row_and_malformed_lines_count(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(ROWS[0]) + "\n{not json\n[1, 2]\n" + json.dumps(ROWS[4]) + "\n")
  q, report = load_questions(str(path), Fields())
  assert len(q.questions) == 1 and report.malformed == 2 and report.missing_answer == 1
  with pytest.raises(ValueError, match="bad.jsonl: line 2: not a JSON object"):
    load_questions(str(path), Fields(), strict=True)


def test_a_wrong_mapping_lists_the_keys(tmp_path):
  path = _write_all(tmp_path)[0]
  with pytest.raises(ValueError, match="question field 'question'.*meta, problem"):
    load_questions(str(path), Fields(question="question"))
  with pytest.raises(ValueError, match="level field 'lvl'"):
    load_questions(str(path), Fields(level="lvl"))
  # A wrong nested path shows the keys where the path stops existing.
  with pytest.raises(ValueError, match="answer field 'meta.truth'.*'meta' is gt, level"):
    load_questions(str(path), Fields(answer="meta.truth"))
  # strict stops at the first row, and still says which keys the row has.
  with pytest.raises(ValueError, match="line 1: no question.*the row has: answer, meta, problem"):
    load_questions(str(path), Fields(question="question"), strict=True)


def test_non_text_answers_are_malformed(tmp_path):
  rows = [
    {"problem": "p1", "answer": ["3"]},
    {"problem": "p2", "answer": ["1", "2"]},
    {"problem": "p3", "answer": {"value": 1}},
    {"problem": "p4", "answer": float("nan")},
  ]
  path = tmp_path / "odd.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  q, report = load_questions(str(path), Fields())
  assert q.answers == ["3"] and (report.malformed, report.missing_answer) == (2, 1)
  assert report.examples[0] == "line 2: the answer ('answer') is a list, not text"


def test_json_lines_under_json_gzip_and_hub_parquet_layout(tmp_path):
  typed = [{"problem": f"q{i}", "answer": str(i)} for i in range(5)]
  hf_datasets.Dataset.from_list(typed).to_json(tmp_path / "lines.json")  # JSON lines, .json name
  with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as f:
    f.write("".join(json.dumps(r) + "\n" for r in typed))
  hub = tmp_path / "hub" / "data"
  hub.mkdir(parents=True)
  pq.write_table(pa.Table.from_pylist(typed[:3]), hub / "train-00000-of-00002.parquet")
  pq.write_table(pa.Table.from_pylist(typed[3:]), hub / "train-00001-of-00002.parquet")
  pq.write_table(pa.Table.from_pylist(typed[:1]), hub / "test-00000-of-00001.parquet")
  for path in ["lines.json", "rows.jsonl.gz", "hub"]:
    q, _ = load_questions(str(tmp_path / path), Fields())
    assert q.questions == [r["problem"] for r in typed], path
  q, _ = load_questions(str(tmp_path / "hub"), Fields(), split="test")
  assert q.questions == ["q0"]
  assert load_questions(str(tmp_path / "hub"), Fields())[0].ids[-1] == "hub#5"  # rows run on


def test_missing_path_and_unknown_format(tmp_path):
  with pytest.raises(ValueError, match="nope.jsonl: no such file"):
    load_questions(str(tmp_path / "nope.jsonl"), Fields())
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="unknown dataset format"):
    load_questions(str(tmp_path / "x.csv"), Fields())


def test_mixture_pools_follow_the_weights(tmp_path):
  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  a.write_text("".join(json.dumps({"problem": f"a{i}", "answer": "1"}) + "\n" for i in range(50)))
  b.write_text("".join(json.dumps({"problem": f"b{i}", "answer": "1"}) + "\n" for i in range(30)))
  q, mixture, reports = load_mixture(f"{a}:3,{b}", Fields())
  assert len(q.questions) == 80 and [r.kept for r in reports] == [50, 30]
  assert [len(p) for p in mixture.pools] == [50, 30] and mixture.weights == (3.0, 1.0)
  cursor = MixtureCursor.start(mixture)
  drawn = []
  for _ in range(100):
    ids, cursor = next_mixture_batch(cursor, 0, mixture, 8)
    drawn.extend(ids)
  share_a = np.mean([q.questions[i].startswith("a") for i in drawn])
  assert abs(share_a - 0.75) < 5 * np.sqrt(0.75 * 0.25 / len(drawn))
  with pytest.raises(ConfigError, match="data.train"):
    load_mixture(f"{tmp_path / 'missing.jsonl'}", Fields())
  with pytest.raises(ConfigError, match="data.train.*WEIGHT > 0"):
    load_mixture(f"{a}:0", Fields())
  (tmp_path / "empty.jsonl").write_text(json.dumps({"problem": "", "answer": "1"}) + "\n")
  with pytest.raises(ConfigError, match="empty.jsonl: no usable row"):
    load_mixture(f"{a},{tmp_path / 'empty.jsonl'}", Fields())


def test_a_file_that_is_not_utf8_text_is_named(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_bytes(b'{"problem": "1+1", "answer": "2"}\n' + bytes(range(128, 256)))
  with pytest.raises(ConfigError, match=f"{path}: not UTF-8 text") as e:
    load_mixture(str(path), Fields())
  assert e.value.field == "data.train"
