"""A checkpoint write that fails keeps the previous checkpoint usable, says so, and training goes on.

The failure is real: a file-size limit (RLIMIT_FSIZE) makes orbax's writes fail with EFBIG the way a
full disk fails them with ENOSPC (a tmpfs of fixed size would need root). SIGXFSZ is ignored so the
write returns the error instead of the signal killing the process (``jaxrl.main`` does the same).
"""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import ROOT, read_metrics

from jaxrl.checkpoint import Checkpointer

LIMIT = 100_000       # bytes: below the tree's data file in the unit test
RUN_LIMIT = 2_000_000  # bytes: below a run's checkpoint data file (hidden 256), above its logs


@pytest.fixture
def file_size_limit():
  """set(n): writes past n bytes fail from now on; set(None): no limit. Restored afterwards."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

  def set_limit(n):
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY if n is None else n, hard))

  yield set_limit
  resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  signal.signal(signal.SIGXFSZ, previous)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_failed_writes_keep_the_previous_checkpoint(tmp_path, file_size_limit, async_save):
  key = jax.random.PRNGKey(0)
  tree = {"w": jax.random.normal(key, (100_000,)), "b": {"c": jnp.arange(3), "n": jnp.int32(7)}}
  ckpt = Checkpointer(str(tmp_path), keep=2, async_save=async_save)
  ckpt.save(1, tree, {"step": 1})
  ckpt.wait()
  file_size_limit(LIMIT)                              # the disk is "full"
  for step in (2, 3):
    ckpt.save(step, tree, {"step": step})
  ckpt.wait()
  assert ckpt.failed == [2, 3] and ckpt.latest_step() == 1 and "File too large" in ckpt.last_error
  assert sorted(os.listdir(tmp_path)) == ["1"]        # no partial checkpoint is left behind
  _, meta = ckpt.restore(1, tree)
  assert meta == {"step": 1}
  file_size_limit(None)                               # room again: saving simply resumes
  ckpt.save(4, tree, {"step": 4})
  ckpt.close()
  again = Checkpointer(str(tmp_path), keep=2, async_save=async_save)
  restored, meta = again.restore(again.latest_step(), tree)
  again.close()
  assert meta == {"step": 4} and sorted(os.listdir(tmp_path)) == ["1", "4"]
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(tree["w"]))


@pytest.mark.slow
def test_run_goes_on_when_checkpoints_fail_and_exits_1_without_its_last(tmp_path):
  """Every checkpoint of a run fails: all steps still train and log, then one line says so, exit 1."""
  work = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl.main", "--config=configs/tiny.py:test", f"--workdir={work}",
         "--config.steps=4", "--config.checkpoint.every=1", "--config.sft.steps=0",
         "--config.model.hidden_size=256", "--config.model.intermediate_size=1024"]

  def limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (RUN_LIMIT, resource.RLIM_INFINITY))

  out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), preexec_fn=limit,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 1, out.stderr[-3000:]
  assert [r["step"] for r in read_metrics(work)] == [1, 2, 3, 4]     # training went on
  failed = [l for l in out.stderr.splitlines() if "checkpoint at step" in l and "failed" in l]
  assert len(failed) == 4 and "no usable checkpoint" in failed[0]
  # orbax's threads print to the same stderr concurrently: a line may be glued to another's end.
  (error,) = re.findall(r"jaxrl: error: .*", out.stderr)
  assert "checkpoint of step 4 could not be written" in error and "File too large" in error
