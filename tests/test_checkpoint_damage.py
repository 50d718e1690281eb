"""A damaged checkpoint (a data file truncated, as a full disk or a copy cut short leaves it): a
resume falls back to the newest checkpoint that reads, logging which one did not and why, and sets
the damaged one aside; ``jaxrl-export`` and ``jaxrl-eval`` of the run fall back the same way
(moving nothing); a damaged step asked for by name exits 2 in one line."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
from run_helpers import ROOT, read_metrics

pytestmark = pytest.mark.slow  # a 6-step run, its resume, an export and an eval (~1 min)


def _main(*flags, module="jaxrl.main"):
  return subprocess.run(
    [sys.executable, "-m", module, *flags],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=600,
  )


def _damage(step_dir) -> list[str]:
  """Cut every array data file of a checkpoint to half its size."""
  files = glob.glob(os.path.join(step_dir, "tree", "ocdbt.process_0", "d", "*"))
  assert files
  for f in files:
    os.truncate(f, os.path.getsize(f) // 2)
  return files


@pytest.fixture(scope="module")
def damaged_run(tmp_path_factory):
  """A tiny run checkpointed at steps 3 and 6, then step 6's data files truncated."""
  run = tmp_path_factory.mktemp("damaged") / "run"
  flags = ("--config=tiny:test", f"--workdir={run}", "--config.checkpoint.every=3")
  out = _main(*flags, "--config.steps=6")
  assert out.returncode == 0, out.stderr[-3000:]
  assert sorted(os.listdir(run / "checkpoints")) == ["3", "6"]
  _damage(run / "checkpoints" / "6")
  return run, flags


def test_a_resume_falls_back_to_the_newest_checkpoint_that_reads(damaged_run, tmp_path):
  run, flags = damaged_run
  copy = tmp_path / "run"
  shutil.copytree(run, copy)
  out = _main(*flags[:1], f"--workdir={copy}", *flags[2:], "--config.steps=9")
  assert out.returncode == 0, out.stderr[-3000:]
  # jaxrl's own report is one line; orbax's reads of the damaged step, dropped unfinished, are
  # silenced on every channel found, but under load one can still print after it (docs/running.md)
  (line,) = [x for x in out.stderr.splitlines() if "does not read" in x]
  assert "checkpoint 6 in" in line and "checkpoints/6/tree" in line and "OUT_OF_RANGE" in line
  assert "resumed from step 3" in out.stderr
  assert sorted(os.listdir(copy / "checkpoints")) == ["6", "9", "unreadable-6"]
  assert [r["step"] for r in read_metrics(copy)][-6:] == [4, 5, 6, 7, 8, 9]


def test_export_falls_back_and_a_damaged_step_asked_for_exits_2(damaged_run, tmp_path):
  run, _ = damaged_run
  before = sorted(os.listdir(run / "checkpoints"))
  out = _main(f"--checkpoint={run}", f"--out={tmp_path}/latest", module="jaxrl.export")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "checkpoint 6 in" in out.stderr and "restored params of" in out.stderr
  assert "step 3" in out.stderr and os.path.isfile(tmp_path / "latest" / "config.json")
  assert sorted(os.listdir(run / "checkpoints")) == before  # a reader moves nothing
  out = _main(f"--checkpoint={run}/checkpoints/6", f"--out={tmp_path}/six", module="jaxrl.export")
  assert out.returncode == 2, out.stderr[-3000:]
  (line,) = [x for x in out.stderr.splitlines() if ": error: " in x]
  assert "no checkpoint reads" in line and "step 6: " in line and "OUT_OF_RANGE" in line, line
  assert not os.path.exists(tmp_path / "six")


def test_eval_of_the_run_falls_back_and_a_damaged_step_asked_for_exits_2(damaged_run):
  run, _ = damaged_run
  before = sorted(os.listdir(run / "checkpoints"))
  flags = (f"--config={run}/config.json", "--num_samples=2", "--ks=1,2")
  out = _main(*flags, f"--checkpoint={run}", module="jaxrl.eval")
  assert out.returncode == 0, out.stderr[-3000:]
  # jaxrl's own report is one line; orbax's reads of the damaged step, dropped unfinished, are
  # silenced on every channel found, but under load one can still print after it (docs/running.md)
  (line,) = [x for x in out.stderr.splitlines() if "does not read" in x]
  assert "checkpoint 6 in" in line and "OUT_OF_RANGE" in line, line
  with open(run / "eval" / "step3" / "eval_results.json") as f:
    assert json.load(f)["checkpoint"] == os.path.join(run, "checkpoints", "3")
  assert sorted(os.listdir(run / "eval")) == ["step3"]
  assert sorted(os.listdir(run / "checkpoints")) == before  # a reader moves nothing
  out = _main(*flags, f"--checkpoint={run}/checkpoints/6", module="jaxrl.eval")
  assert out.returncode == 2, out.stderr[-3000:]
  (line,) = [x for x in out.stderr.splitlines() if ": error: " in x]
  assert "no checkpoint reads" in line and "step 6: " in line and "OUT_OF_RANGE" in line, line
  assert sorted(os.listdir(run / "eval")) == ["step3"]


def test_a_checkpoint_whose_metadata_does_not_parse_exits_2_in_one_line(damaged_run, tmp_path):
  """``checkpoints/N/meta/metadata`` cut short (orbax raises a JSONDecodeError from inside its
  read): the step asked for by name exits 2 in one line naming it; the run, none of whose
  checkpoints reads (step 6's data truncated too), exits 2 naming both; nothing is written."""
  run, _ = damaged_run
  copy = tmp_path / "run"
  shutil.copytree(run, copy)
  meta = copy / "checkpoints" / "3" / "meta" / "metadata"
  meta.write_text(meta.read_text()[:40])
  for checkpoint, steps in ((copy / "checkpoints" / "3", [3]), (copy, [6, 3])):
    out = _main(f"--checkpoint={checkpoint}", f"--out={tmp_path}/out", module="jaxrl.export")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if ": error: " in x]
    assert "no checkpoint reads" in line and all(f"step {s}: " in line for s in steps), line
    assert "JSONDecodeError" in line, line
    assert not os.path.exists(tmp_path / "out")
  assert sorted(os.listdir(copy / "checkpoints")) == ["3", "6"]  # a reader moves nothing
