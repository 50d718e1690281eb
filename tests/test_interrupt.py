"""Ctrl-C (SIGINT) or SIGTERM during `python -m jaxrl.main` finishes the step, saves a checkpoint and
exits 0; the same command then resumes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(workdir, steps):
  env = dict(os.environ, PYTHONPATH=ROOT)
  cmd = [
    sys.executable,
    "-m",
    "jaxrl.main",
    "--config=configs/tiny.py:test",
    f"--workdir={workdir}",
    f"--config.steps={steps}",
    "--config.checkpoint.every=1000",
  ]
  return subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_checkpoints_and_rerun_resumes(tmp_path, sig):
  workdir = str(tmp_path / "run")
  proc = _main(workdir, steps=400)
  deadline = time.time() + 300
  while len(_steps(workdir)) < 3 and time.time() < deadline and proc.poll() is None:
    time.sleep(0.2)
  assert proc.poll() is None, proc.communicate()[1][-3000:]
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert "run the same command again to resume" in err
  done = _steps(workdir)
  # checkpoint.every is 1000: the only checkpoint is the one the signal asked for, at the last step.
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert ckpts == [done[-1]], (ckpts, done)

  total = done[-1] + 2
  proc = _main(workdir, steps=total)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert _steps(workdir) == list(range(1, total + 1))
  assert f"resumed from step {done[-1]}" in err


def _blocked_in_a_wait(thread: threading.Thread) -> bool:
  """Whether ``thread`` is asleep in the kernel inside threading's ``wait`` (on a lock)."""
  frame = sys._current_frames().get(thread.ident)
  if frame is None or frame.f_code.co_name != "wait" or "threading" not in frame.f_code.co_filename:
    return False
  with open(f"/proc/self/task/{thread.native_id}/stat") as f:
    return f.read().rsplit(")", 1)[-1].split()[0] == "S"


def test_a_signal_another_thread_takes_is_handled_while_the_step_waits_for_its_batch():
  """The kernel may hand SIGINT / SIGTERM to any thread of the trainer; Python runs the handler in
  the main thread, once it next executes bytecode. Waiting for the step's batch must not hold it
  off: the handler is what stops the rollout thread restarting a server the signal has ended.
  Here the batch is only generated once the handler has run."""
  import concurrent.futures

  import numpy as np

  from jaxrl.run import batches

  handled = threading.Event()
  previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.set())

  def generate():
    while not _blocked_in_a_wait(threading.main_thread()):  # the main thread waits for the batch
      time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # taken by this thread, not main
    if not handled.wait(timeout=120):  # a bound for the failure only: it is set within 0.5 s
      raise AssertionError("the main thread never ran the signal handler")
    return "batch"

  issue = batches.Issue(
    step=0,
    version=0,
    phase=0,
    qids_B=np.zeros(1, np.int32),
    counts_B=np.ones(1, np.int32),
    tau=1.0,
    epoch_ended=-1,
  )
  pool = concurrent.futures.ThreadPoolExecutor(1)
  try:
    assert batches.InFlight(issue, pool.submit(generate)).result() == "batch"
  finally:
    pool.shutdown()
    signal.signal(signal.SIGUSR1, previous)
