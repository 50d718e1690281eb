"""One failure ends every process of a multi-process run (two real processes over
jax.distributed): an error on process 0 inside a main-first block (the others wait at its
barrier), and a process killed outright in the middle of training. Each process exits non-zero,
and process 0's output names the cause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from multihost_helpers import free_port
from run_helpers import ROOT

pytestmark = pytest.mark.slow
# A hang detector, not a timing claim: without the failure watch these runs wait for JAX's
# shutdown barrier (300 s) or its heartbeat timeout (100 s) and more.
HANG_S = 90
HEARTBEAT_S = 10


def _start(flags, workdir, processes=2):
  port = free_port()
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "jaxrl.main",
        "--config=configs/tiny.py:test",
        f"--workdir={workdir}",
        "--cpu_devices=1",
        f"--coordinator_address=127.0.0.1:{port}",
        f"--num_processes={processes}",
        f"--process_id={rank}",
        f"--heartbeat_timeout={HEARTBEAT_S}",
        *flags,
      ],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1"),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for rank in range(processes)
  ]


def _ends(procs) -> list[tuple[int, str]]:
  """(exit code, stderr) of each process; a process still running after HANG_S is killed and the
  test fails."""
  out = []
  try:
    for rank, p in enumerate(procs):
      try:
        _, err = p.communicate(timeout=HANG_S)
      except subprocess.TimeoutExpired:
        pytest.fail(f"process {rank} still running {HANG_S} s after the failure")
      out.append((p.returncode, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return out


def test_an_error_on_process_0_inside_main_first_ends_every_process(tmp_path):
  # A Hub id that is not cached (offline): process 0 fails while the other waits at main_first.
  procs = _start(["--config.model.checkpoint=jaxrl-test/not-cached"], tmp_path / "run")
  (code0, err0), (code1, err1) = _ends(procs)
  assert code0 == 2 and "jaxrl-test/not-cached" in err0, err0[-2000:]
  assert code1 == 1 and "process 0 failed" in err1 and "not-cached" in err1, err1[-2000:]


def test_a_killed_process_ends_the_others(tmp_path):
  workdir = tmp_path / "run"
  procs = _start(["--config.steps=200", "--config.sft.steps=0", "--config.mesh.fsdp=2"], workdir)
  metrics = workdir / "metrics.jsonl"
  try:
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # training is underway
      assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
      time.sleep(0.2)  # polling for the event (a first metrics row), not a timing assumption
    procs[1].send_signal(signal.SIGKILL)
  except BaseException:
    for p in procs:
      p.kill()
    raise
  (code0, err0), (code1, _) = _ends(procs)
  assert code1 == -signal.SIGKILL
  assert code0 != 0, err0[-2000:]
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert rows and rows[-1]["step"] < 200
