"""A checkpoint write that fails keeps the previous checkpoint usable, says so; training goes on.

The failure is real: a file-size limit makes orbax's writes fail with EFBIG the way a full disk
fails them with ENOSPC (the ``file_size_limit`` fixture, conftest.py). Tensorstore goes on flushing
a failed write's other files after orbax reported the error (after close too); such a late flush is
a real write of tensorstore's file driver into the failed step's tmp directory.
A write that never settles is real too: orbax reports the failure through absl logging, into a
full pipe that nobody reads (a stalled log sink), and that thread blocks in ``write()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from run_helpers import ROOT, read_metrics
from stalled_log import stall_absl_errors

from jaxrl.workdir import checkpoint_failures
from jaxrl.workdir.checkpoint import Checkpointer

LIMIT = 100_000  # bytes: below the tree's data file in the unit test
RUN_LIMIT = 50_000  # bytes: below a run's checkpoint data file (hidden 256) and its log.txt


def _late_flush(directory, step: int) -> str | None:
  """What a flush of step ``step``'s failed write does when tensorstore finishes it after orbax
  reported the write's error: tensorstore's file driver writes a data file under the step's tmp
  directory, creating the directories above it. Its error, or None if it landed."""
  tmp = directory / f"{step}.orbax-checkpoint-tmp" / "tree.orbax-checkpoint-tmp" / "ocdbt.process_0"
  store = ts.KvStore.open({"driver": "file", "path": f"{tmp / 'd'}/"}).result()
  try:
    store.write("late", b"late bytes").result()
  except ValueError as e:
    return str(e)
  return None


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_failed_writes_keep_the_previous_checkpoint(tmp_path, file_size_limit, async_save):
  key = jax.random.PRNGKey(0)
  tree = {"w": jax.random.normal(key, (100_000,)), "b": {"c": jnp.arange(3), "n": jnp.int32(7)}}
  ckpt = Checkpointer(str(tmp_path), keep=2, async_save=async_save)
  ckpt.save(1, tree, {"step": 1})
  ckpt.wait()
  file_size_limit(LIMIT)  # the disk is "full"
  for step in (2, 3):
    ckpt.save(step, tree, {"step": step})
  ckpt.wait()
  assert ckpt.failed == [2, 3] and ckpt.latest_step() == 1 and "File too large" in ckpt.last_error
  # Of a failed write only an empty file is left, in its tmp directory's place: a flush that
  # tensorstore finishes late fails there instead of recreating the directory.
  markers = ["2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp"]
  assert "Not a directory" in _late_flush(tmp_path, 2)
  assert sorted(os.listdir(tmp_path)) == ["1", *markers]
  assert all(os.path.getsize(tmp_path / m) == 0 for m in markers)
  _, meta = ckpt.restore(1, tree)
  assert meta == {"step": 1}
  file_size_limit(None)  # room again: saving simply resumes
  ckpt.save(3, tree, {"step": 3})  # a failed step written again: its marker gives way
  ckpt.close()
  assert "Not a directory" in _late_flush(tmp_path, 2)  # after close too, with room to write
  assert sorted(os.listdir(tmp_path)) == ["1", "2.orbax-checkpoint-tmp", "3"]
  again = Checkpointer(str(tmp_path), keep=2, async_save=async_save)  # the next run's
  restored, meta = again.restore(again.latest_step(), tree)
  again.close()
  assert meta == {"step": 3} and sorted(os.listdir(tmp_path)) == ["1", "3"]  # no marker left
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(tree["w"]))


def _run_limit():
  resource.setrlimit(resource.RLIMIT_FSIZE, (RUN_LIMIT, resource.RLIM_INFINITY))


@pytest.mark.slow
def test_run_goes_on_when_checkpoints_fail_and_exits_1_without_its_last(tmp_path):
  """Every checkpoint of a run fails: all steps still train and log, then one line says so, exit 1.
  The log file's writes fail too: said once, not a traceback per record."""
  work = tmp_path / "run"
  cmd = [
    sys.executable,
    "-m",
    "jaxrl.main",
    "--config=configs/tiny.py:test",
    f"--workdir={work}",
    "--config.steps=4",
    "--config.checkpoint.every=1",
    "--config.sft.steps=0",
    "--config.model.hidden_size=256",
    "--config.model.intermediate_size=1024",
  ]

  out = subprocess.run(
    cmd,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    preexec_fn=_run_limit,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 1, out.stderr[-3000:]
  assert [r["step"] for r in read_metrics(work)] == [1, 2, 3, 4]  # training went on
  failed = [
    line for line in out.stderr.splitlines() if "checkpoint at step" in line and "failed" in line
  ]
  assert len(failed) == 4 and "no usable checkpoint" in failed[0]
  assert out.stderr.count("jaxrl: cannot write the log file") == 1, out.stderr[-3000:]
  assert "Logging error" not in out.stderr
  # orbax's threads print to the same stderr concurrently: a line may be glued to another's end.
  (error,) = re.findall(r"jaxrl: error: .*", out.stderr)
  assert "checkpoint of step 4 could not be written" in error and "File too large" in error


@contextlib.contextmanager
def stalled_orbax_log():
  """orbax's error records go to a pipe that is full and that nobody reads: the orbax thread that
  reports a failed write blocks in ``write()`` for real (a log sink that stalled), so the write
  never settles. On exit the pipe is drained until the blocked threads have finished."""
  read_fd, sink = stall_absl_errors()
  try:
    yield
  finally:
    os.set_blocking(read_fd, False)
    deadline = time.monotonic() + 60
    while checkpoint_failures.unsettled() and time.monotonic() < deadline:
      with contextlib.suppress(BlockingIOError):
        os.read(read_fd, 1 << 20)
      time.sleep(0.01)
    logging.getLogger("absl").removeHandler(sink)
    sink.close()
    os.close(read_fd)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_write_that_never_settles_fails_within_the_timeout(tmp_path, file_size_limit, async_save):
  """The write of step 2 blocks (it fails, and reporting that blocks): the wait gives up after
  ``settle_timeout``, step 3 fails at once, close() returns; once the write ends saving resumes."""
  tree = {"w": jax.random.normal(jax.random.PRNGKey(0), (100_000,))}
  ckpt = Checkpointer(str(tmp_path), keep=2, async_save=async_save, settle_timeout=1.0)
  ckpt.save(1, tree, {"step": 1})
  ckpt.wait()
  with stalled_orbax_log():
    file_size_limit(LIMIT)
    start = time.monotonic()
    ckpt.save(2, tree, {"step": 2})
    ckpt.wait()
    assert ckpt.save(3, tree, {"step": 3}) is False
    ckpt.close()
    elapsed = time.monotonic() - start
    assert checkpoint_failures.unsettled()  # orbax's threads are still blocked
    assert ckpt.failed == [2, 3] and ckpt.latest_step() == 1
    assert ckpt.last_error == "not started: the write of step 2 did not finish within 1 s"
    assert elapsed < 30, elapsed  # it gave up (a blocked wait never returns)
  assert not checkpoint_failures.unsettled()
  file_size_limit(None)
  assert ckpt.save(4, tree, {"step": 4})  # the blocked write ended: orbax takes writes again
  ckpt.close()
  assert ckpt.failed == [2, 3] and Checkpointer(str(tmp_path), keep=2).latest_step() == 4


# jaxrl.main with orbax's error log going to a full, unread pipe.
STALLED_MAIN = """
import runpy, sys
from stalled_log import stall_absl_errors
stall_absl_errors()
sys.argv = ["jaxrl.main", *sys.argv[1:]]
runpy.run_module("jaxrl.main", run_name="__main__")
"""


@pytest.mark.slow
def test_run_with_a_write_that_never_settles_exits_1_instead_of_hanging(tmp_path):
  """The first write blocks forever (it fails, and reporting that blocks): training goes on
  without checkpoints, and the run ends with exit 1 and one line, not waiting for orbax's
  threads (they are not daemons: a normal interpreter exit would join them forever)."""
  work = tmp_path / "run"
  cmd = [
    sys.executable,
    "-c",
    STALLED_MAIN,
    "--config=configs/tiny.py:test",
    f"--workdir={work}",
    "--config.steps=4",
    "--config.checkpoint.every=1",
    "--config.sft.steps=0",
    "--config.model.hidden_size=256",
    "--config.model.intermediate_size=1024",
    "--config.log.tensorboard=False",
    "--config.checkpoint.settle_timeout=3",
  ]
  start = time.monotonic()
  path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
  out = subprocess.run(
    cmd,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=path),
    preexec_fn=_run_limit,
    capture_output=True,
    text=True,
    timeout=300,
  )
  elapsed = time.monotonic() - start
  ours = "\n".join(line for line in out.stderr.splitlines() if "jaxrl" in line)
  assert out.returncode == 1, ours
  assert [r["step"] for r in read_metrics(work)] == [1, 2, 3, 4]  # training went on
  assert "checkpoint at step 1 failed (the write did not finish within 3 s)" in ours, ours
  (error,) = re.findall(r"jaxrl: error: .*", out.stderr)
  assert (
    "checkpoint of step 4 could not be written (not started: the write of step 1 did not "
    "finish within 3 s); no usable checkpoint"
  ) in error
  assert "exiting without waiting for it" in out.stderr
  print(f"run with a blocked write ended in {elapsed:.1f} s")


def test_a_tmp_directory_a_late_write_recreates_after_close_is_never_a_checkpoint(tmp_path):
  """After ``close`` nothing of this process removes a failed write's tmp directory that a late
  tensorstore callback recreates. What bounds it: readers never take it for a checkpoint, and the
  next writer on the directory (a resume) removes it before anything else."""
  import numpy as np

  ckpt = Checkpointer(str(tmp_path), keep=2, async_save=False)
  ckpt.save(1, {"x": np.ones(3, np.float32)}, {})
  ckpt.close()
  late = tmp_path / "2.orbax-checkpoint-tmp-1700000000000000" / "tree" / "ocdbt.process_0" / "d"
  late.mkdir(parents=True)
  (late / "part").write_bytes(b"\0" * 1024)
  reader = Checkpointer.reader(str(tmp_path))
  assert reader.all_steps() == [1] and reader.latest_step() == 1
  reader.close()
  assert late.exists()  # a reader removes nothing
  Checkpointer(str(tmp_path), keep=2, async_save=False).close()
  assert sorted(os.listdir(tmp_path)) == ["1"]
