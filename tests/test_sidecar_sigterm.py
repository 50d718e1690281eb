"""A job-wide SIGTERM (a scheduler's `scancel` or preemption signals every process of the job at
once: trainer, sidecar guard, vLLM server and its engine processes) ends the run as Ctrl-C does:
a checkpoint of every trained step, nothing left running or in /dev/shm, exit 0, and the same
command resumes to the end. With k = 1 a batch is in flight on the rollout thread when it lands:
the test freezes the server first (SIGSTOP), so the signal finds a rollout waiting on it, which
fails with the server; the run neither waits for it nor restarts a server, and records it to be
generated again on resume."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from run_helpers import ROOT

pytestmark = pytest.mark.slow

FLAGS = [
  "--config=configs/tiny.py:test",
  "--config.rollout.engine=vllm",
  "--config.model.hidden_size=64",
  "--config.model.head_dim=32",
  "--config.rollout.max_staleness=1",
  "--config.checkpoint.every=1000",  # only the stop writes a checkpoint
  "--config.sft.steps=30",
]
STEPS = 40


def _start(workdir, steps):
  return subprocess.Popen(
    [sys.executable, "-m", "jaxrl.main", *FLAGS, f"--workdir={workdir}", f"--config.steps={steps}"],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1"),  # SIGABRT: every thread's stack
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )


def _rows(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if line.strip())


def _checkpoints(workdir) -> list[int]:
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def _weights_roots(workdir) -> set[str]:
  """The weights directories this run's servers were started on (other runs on the machine have
  their own: a test beside this one may hold some under /dev/shm at the same time)."""
  log_txt = (workdir / "vllm.log").read_text(errors="replace")
  return {
    os.path.dirname(m) for m in re.findall(r"^=== jaxrl: start .* --model (\S+)", log_txt, re.M)
  }


def _cmdline(pid: int) -> bytes:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read()
  except OSError:
    return b""


def _signal(pids, sig) -> None:
  for pid in pids:
    try:
      os.kill(pid, sig)
    except ProcessLookupError:
      pass


def _communicate(proc, timeout: float) -> str:
  """The run's stderr once it has exited; a run still going after ``timeout`` fails the test with
  every thread's stack (faulthandler, on SIGABRT) and the log's tail."""
  try:
    return proc.communicate(timeout=timeout)[1]
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGABRT)
    err = proc.communicate()[1]
    pytest.fail(f"the run did not end {timeout:.0f} s after SIGTERM:\n{err[-12000:]}")


def test_sigterm_to_every_process_of_the_job_ends_like_ctrl_c(tmp_path):
  from jaxrl.rollout.sidecar import owned_pids

  workdir = tmp_path / "run"
  proc = _start(workdir, STEPS)
  try:
    while _rows(workdir) < 2:  # two RL steps done: the sidecar is serving, a batch in flight
      assert proc.poll() is None, proc.stderr.read()[-3000:]
      time.sleep(0.05)  # polling for an event (a metrics row), not a timing assumption
    sidecar = owned_pids(proc.pid)
    job = [proc.pid, *sidecar]
    assert len(job) > 2  # the trainer, the guard, the server (and its engine processes)
    server = [pid for pid in sidecar if b"vllm" in _cmdline(pid)]
    _signal(server, signal.SIGSTOP)  # the next rollout waits on a server that cannot answer
    _signal(job, signal.SIGTERM)  # what a scheduler does: every process of the job at once
    _signal(server, signal.SIGCONT)  # (the scheduler never froze it)
    err = _communicate(proc, timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, err[-3000:]
  log_txt = (workdir / "log.txt").read_text()
  assert "sidecar failed during" not in log_txt, log_txt[-3000:]  # no server was restarted
  trained = _rows(workdir)
  assert 2 <= trained < STEPS
  assert _checkpoints(workdir)[-1] == trained, (_checkpoints(workdir), trained, err[-3000:])
  deadline = time.monotonic() + 60
  while owned_pids(proc.pid) and time.monotonic() < deadline:  # the guard's own grace period
    time.sleep(0.2)
  assert not owned_pids(proc.pid)
  roots = _weights_roots(workdir)
  assert roots and not [r for r in roots if os.path.exists(r)]
  # The same command resumes and finishes (a shorter run of the same config: steps may change).
  again = _start(workdir, trained + 2)
  err = again.communicate(timeout=600)[1]
  assert again.returncode == 0, err[-3000:]
  assert _rows(workdir) == trained + 2
