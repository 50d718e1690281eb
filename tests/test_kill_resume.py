"""SIGKILL at random moments, 10 times in a row, resuming each time: the run ends with exactly the
params and question statistics of an uninterrupted run, and no checkpoint is ever unreadable.

Checkpoints are written every step (async), so kills land during writes too; orbax writes a step
into a temporary directory and renames it when complete, so a kill leaves either the whole step or
nothing that counts.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from run_helpers import ROOT

from jaxrl.checkpoint import Checkpointer

pytestmark = pytest.mark.slow
STEPS = 14
KILLS = 10


def _start(workdir):
  cmd = [sys.executable, "-m", "jaxrl.main", "--config=configs/tiny.py:test", f"--workdir={workdir}",
         f"--config.steps={STEPS}", "--config.checkpoint.every=1", "--config.sft.steps=30"]
  return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _steps_done(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if line.strip())


def _read(workdir, step, part):
  """A sub-tree ("state" params or "stats") of checkpoint ``step`` as numpy arrays."""
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=100, async_save=False)
  try:
    path = os.path.join(workdir, "checkpoints", str(step), "tree")
    meta = ocp.PyTreeCheckpointer().metadata(path).item_metadata[part]
    if part == "state":
      meta = {"params": meta["params"]}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    return [np.asarray(x) for x in jax.tree.leaves(ckpt.restore_part(step, {part: target}))]
  finally:
    ckpt.close()


def _checkpoints(workdir):
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def test_ten_sigkills_then_resume_equal_an_uninterrupted_run(tmp_path):
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  proc = _start(straight)
  assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]

  rng = np.random.default_rng(0)
  kills, during_rl = 0, 0
  while kills < KILLS:
    proc = _start(killed)
    # Half of the kills at a random time after start (start-up, SFT, evaluation, RL), half a
    # random time after the next RL step lands (mostly inside a step or its checkpoint write).
    if kills % 2 == 0:
      time.sleep(rng.uniform(0.5, 6.0))
    else:
      target = _steps_done(killed) + 1
      deadline = time.time() + 120
      while _steps_done(killed) < target and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
      time.sleep(rng.uniform(0.0, 0.3))
    if proc.poll() is not None:   # finished before the kill: the run is complete
      break
    during_rl += _steps_done(killed) > 0
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    kills += 1
    for step in _checkpoints(killed):   # every checkpoint that exists is complete and readable
      assert len(_read(killed, step, "state")) > 0
  assert kills == KILLS and during_rl >= KILLS // 2, (kills, during_rl)
  proc = _start(killed)                 # the last resume runs to the end
  assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]

  for part in ("state", "stats"):
    for a, b in zip(_read(straight, STEPS, part), _read(killed, STEPS, part)):
      np.testing.assert_array_equal(a, b, err_msg=part)
