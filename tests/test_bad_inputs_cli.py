"""Bad inputs through ``jaxrl-train`` as a user meets them: a damaged or incomplete checkpoint and an
empty held-out file exit 2 with one line naming the file, with no traceback, before the run
directory is written."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import math_fixtures
import pytest
from run_helpers import ROOT

pytestmark = pytest.mark.slow  # a trainer process per case (~15 s each)


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
  base = tmp_path_factory.mktemp("bad_inputs")
  ckpt = math_fixtures.make_checkpoint(base / "ckpt")
  train, val = math_fixtures.make_math_data(base / "data")
  return base, ckpt, train, val


def _train(ckpt, train, val, workdir):
  return subprocess.run(
    [
      sys.executable, "-m", "jaxrl.main", "--config=configs/qwen7b.py:test", f"--workdir={workdir}",
      f"--config.model.checkpoint={ckpt}", f"--config.data.train={train}",
      f"--config.data.heldout={val}", "--config.steps=1",
    ],
    cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600,
  )  # fmt: skip


def _one_line(out) -> str:
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
  return out.stderr.strip().splitlines()[-1]


def _copy(ckpt, dest, edit):
  shutil.copytree(ckpt, dest)
  edit(dest)
  return dest


def test_a_truncated_shard_exits_2_before_the_run_directory_is_written(math_run):
  base, ckpt, train, val = math_run

  def truncate(d):
    shard = sorted(d.glob("model-*.safetensors"))[1]
    os.truncate(shard, os.path.getsize(shard) // 2)

  broken = _copy(ckpt, base / "truncated", truncate)
  line = _one_line(_train(broken, train, val, base / "run_truncated"))
  assert "model.checkpoint" in line and "model-00002-of-" in line and "outside the file" in line
  assert not os.path.exists(base / "run_truncated")


def test_an_index_that_points_outside_the_checkpoint_exits_2(math_run):
  base, ckpt, train, val = math_run

  def escape(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))

  broken = _copy(ckpt, base / "escape", escape)
  line = _one_line(_train(broken, train, val, base / "run_escape"))
  assert "model.checkpoint" in line and "outside.safetensors" in line, line
  assert not os.path.exists(base / "run_escape")


def test_a_header_length_of_2_to_the_62_exits_2_naming_the_shard(math_run):
  """The first 8 bytes of a safetensors file give its header's length: 2^62 is refused from the
  file's size, before anything of that length is read or allocated."""
  base, ckpt, train, val = math_run

  def huge_header(d):
    shard = sorted(d.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
      f.write(struct.pack("<Q", 2**62))

  broken = _copy(ckpt, base / "huge_header", huge_header)
  line = _one_line(_train(broken, train, val, base / "run_huge_header"))
  assert "model.checkpoint" in line and "model-00001-of-" in line, line
  assert f"a header of {2**62} bytes" in line, line
  assert not os.path.exists(base / "run_huge_header")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_truncated_json_file_of_the_checkpoint_exits_2_naming_it(math_run, name):
  """Each was read where it is used, after the run directory was written: a JSONDecodeError's
  traceback and exit 1."""
  base, ckpt, train, val = math_run
  stem = name.split(".")[0]
  broken = _copy(ckpt, base / stem, lambda d: (d / name).write_text('{"eos_token_id": [1, '))
  line = _one_line(_train(broken, train, val, base / f"run_{stem}"))
  assert "model.checkpoint" in line and f"{stem}/{name}: not valid JSON" in line, line
  assert not os.path.exists(base / f"run_{stem}")


def test_a_tokenizer_without_its_vocabulary_and_an_empty_held_out_file_exit_2(math_run):
  """Both before the run directory is written (the task's inputs are checked before it)."""
  base, ckpt, train, val = math_run
  broken = _copy(ckpt, base / "no_vocab", lambda d: (d / "tokenizer.json").unlink())
  line = _one_line(_train(broken, train, val, base / "run_no_vocab"))
  assert "model.checkpoint" in line and "does not encode and decode" in line, line
  assert not os.path.exists(base / "run_no_vocab")
  empty = base / "empty.jsonl"
  empty.write_text("")
  line = _one_line(_train(ckpt, train, empty, base / "run_empty"))
  assert "data.heldout" in line and "empty.jsonl" in line and "no usable row" in line, line
  assert not os.path.exists(base / "run_empty")
