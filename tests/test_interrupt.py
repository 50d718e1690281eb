"""Ctrl-C (SIGINT) or SIGTERM during `python -m jaxrl.main` finishes the step, saves a checkpoint and
exits 0; the same command then resumes."""

import json
import os
import signal
import subprocess
import sys
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
