"""One trainer per run directory (jaxrl.workdir.lock): a second trainer on a live run's --workdir is
refused with exit 2 naming the holder, and the first finishes with its checkpoints whole; a lock
left by a killed run is taken over; a second multi-process job writes nothing in the directory;
readers take none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from multihost_helpers import free_port
from run_helpers import ROOT, read_metrics, wait_until

from jaxrl.workdir import lock

HOLDER = """
import sys, time
from jaxrl.workdir import lock
lock.hold(sys.argv[1])
print("held", flush=True)
sys.stdin.read()  # until the test closes it, or kills this process
"""


def _holder(workdir):
  proc = subprocess.Popen(
    [sys.executable, "-c", HOLDER, str(workdir)],
    env=dict(os.environ, PYTHONPATH=ROOT),
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_second_holder_is_refused_naming_the_first_and_a_killed_ones_lock_is_taken_over(
  tmp_path,
):
  proc = _holder(tmp_path)
  try:
    with pytest.raises(lock.WorkdirBusy, match=f"pid {proc.pid} on "):
      lock.hold(str(tmp_path))
    assert oct(os.stat(tmp_path / lock.LOCK_FILE).st_mode & 0o777) == "0o600"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  # The kernel dropped the dead process's lock: the file it left is simply taken over.
  key = lock.hold(str(tmp_path))
  try:
    assert lock.hold(str(tmp_path)) == key  # this process's holds are shared, not refused
    lock.release(key)
    other = subprocess.run(
      [sys.executable, "-c", "import sys; from jaxrl.workdir import lock; lock.hold(sys.argv[1])",
       str(tmp_path)],
      env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
    )  # fmt: skip
    assert other.returncode != 0 and "WorkdirBusy" in other.stderr  # the first hold still holds
  finally:
    lock.release(key)
  assert key not in lock._HELD  # the last release unlocked it (other tests' runs may hold theirs)
  proc = _holder(tmp_path)  # free again
  proc.stdin.close()
  assert proc.wait() == 0


def _train(workdir, steps, *extra):
  return subprocess.Popen(
    [
      sys.executable, "-m", "jaxrl.main", "--config=tiny:test", f"--workdir={workdir}",
      f"--config.steps={steps}", "--config.checkpoint.every=1", *extra,
    ],
    cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
    stderr=subprocess.PIPE, text=True,
  )  # fmt: skip


@pytest.mark.slow  # two trainer processes (~40 s)
def test_a_second_trainer_on_a_live_run_exits_2_and_the_first_finishes_whole(tmp_path):
  run = tmp_path / "run"
  first = _train(run, 6)
  try:
    # The first trainer holds the run once it has checkpointed a step: it is mid-run.
    wait_until(lambda: (run / "checkpoints" / "1").is_dir(), 600, "step 1 checkpointed")
    second = _train(run, 6)
    _, err = second.communicate(timeout=600)
    assert second.returncode == 2, err[-2000:]
    (line,) = [x for x in err.strip().splitlines() if "error" in x]
    assert f"pid {first.pid} on " in line and "in use by another trainer" in line, line
    assert "Traceback" not in err
    _, err = first.communicate(timeout=600)
  finally:
    first.kill()
  assert first.returncode == 0, err[-3000:]
  assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))
  assert "ERROR" not in (run / "log.txt").read_text()  # no failed checkpoint write
  steps = sorted(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit())
  assert steps and steps[-1] == 6


def test_a_second_multi_process_job_on_a_live_run_writes_nothing_there(tmp_path):
  """The job's process 0 is refused the lock; its other process waits for that lock before
  writing anything (its log file included), so the live run's directory holds no trace of it."""
  holder = _holder(tmp_path)  # the live run's lock
  port = free_port()
  try:
    ranks = [
      subprocess.Popen(
        [
          sys.executable,
          "-m",
          "jaxrl.main",
          "--config=tiny:test",
          f"--workdir={tmp_path}",
          "--cpu_devices=1",
          f"--coordinator_address=127.0.0.1:{port}",
          "--num_processes=2",
          f"--process_id={rank}",
          "--heartbeat_timeout=10",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )  # fmt: skip
      for rank in (0, 1)
    ]
    errs = [rank.communicate(timeout=300)[1] for rank in ranks]
  finally:
    for proc in (holder, *ranks):
      proc.kill()
      proc.wait()
  assert ranks[0].returncode == 2, errs[0][-2000:]
  line = errs[0].strip().splitlines()[-1]
  assert f"pid {holder.pid} on " in line and "in use by another trainer" in line, line
  assert ranks[1].returncode == 1 and "process 0 failed" in errs[1], errs[1][-2000:]
  assert "in use by another trainer" in errs[1] and "Traceback" not in errs[0] + errs[1]
  assert os.listdir(tmp_path) == [lock.LOCK_FILE]
