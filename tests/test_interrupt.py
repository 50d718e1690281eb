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


def _sft_run(workdir, *extra):
  """A run whose SFT warm start takes long enough to be signalled in its middle."""
  return subprocess.Popen(
    [
      sys.executable, "-m", "jaxrl.main", "--config=configs/tiny.py:test", f"--workdir={workdir}",
      "--config.steps=1", "--config.sft.steps=1500", "--config.sft.target_loss=0", *extra,
    ],
    cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
    stderr=subprocess.PIPE, text=True,
  )  # fmt: skip


def _sft_meta(workdir):
  from jaxrl.workdir.checkpoint import Checkpointer

  ckpt = Checkpointer.reader(os.path.join(workdir, "sft"))
  try:
    return ckpt.restore_meta(ckpt.latest_step())
  finally:
    ckpt.close()


@pytest.mark.slow
def test_sigterm_during_sft_saves_its_progress_and_the_rerun_ends_as_an_uninterrupted_one(tmp_path):
  """SIGTERM in the middle of the warm start: exit 0 with a line saying where it stopped, its
  state saved; the same command resumes it from there, and the warm start it finishes is the
  uninterrupted one's (its final loss, the evaluation and first RL step after it, to the bit)."""
  from run_helpers import read_metrics, wait_until

  whole, cut = tmp_path / "whole", tmp_path / "cut"
  proc = _sft_run(whole)
  _, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err[-3000:]
  proc = _sft_run(cut)
  log = cut / "log.txt"
  wait_until(lambda: log.exists() and "sft step 201/" in log.read_text(), 900, "SFT past step 200")
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert "SFT warm start stopped at step" in err and "Traceback" not in err, err[-3000:]
  assert os.path.isdir(cut / "sft_progress") and not os.path.exists(cut / "sft")
  proc = _sft_run(cut)
  _, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err[-3000:]
  assert "SFT warm start resumed at step" in err
  assert not os.path.exists(cut / "sft_progress")  # superseded by the finished warm start
  a, b = _sft_meta(whole), _sft_meta(cut)
  assert (
    (a["steps"], a["final_loss_ema"])
    == (b["steps"], b["final_loss_ema"])
    == (1500, a["final_loss_ema"])
  )
  assert (
    json.loads((whole / "eval_sft.json").read_text())["pass_at"]
    == json.loads((cut / "eval_sft.json").read_text())["pass_at"]
  )
  ra, rb = read_metrics(whole)[0], read_metrics(cut)[0]
  assert (ra["loss"], ra["grad_norm"]) == (rb["loss"], rb["grad_norm"])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_stops_at_once(sig):
  """The run's handler: the first signal asks for a stop at the phase's next stopping point and
  returns; a second one raises KeyboardInterrupt wherever the run is (a step that hangs)."""
  from jaxrl.run.stops import StopFlag, Stopped

  flag = StopFlag()
  try:
    signal.raise_signal(sig)  # handled in this thread before raise_signal returns
    assert flag.requested and flag.signal_name == sig.name
    with pytest.raises(Stopped, match=f"{sig.name}: at the stopping point"):
      flag.check("at the stopping point")
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(sig)
  finally:
    flag.restore()
  assert signal.getsignal(sig) != flag._handle  # the handlers before it are back


def test_a_stop_during_an_evaluation_leaves_it_for_the_next_run(tmp_path):
  """A signal during a held-out evaluation ends it at its next call with ``Stopped``, writing no
  ``eval_*.json``: the evaluation is not taken as done, so the next run does it again."""
  from run_helpers import tiny_config

  from jaxrl.run.rl_phase import stop_flag
  from jaxrl.run.stops import Stopped
  from jaxrl.run.train import Trainer

  with Trainer.open(tiny_config("test"), str(tmp_path)) as trainer:
    params = trainer.init_params()
    with stop_flag(trainer.engine) as trainer._stop:  # as Trainer.run holds it
      signal.raise_signal(signal.SIGTERM)
      with pytest.raises(Stopped, match="SIGTERM: evaluation sft stopped"):
        trainer.evaluate(params, "sft", step=0)
    trainer._stop = None
    assert not os.path.exists(tmp_path / "eval_sft.json")
    trainer.evaluate(params, "sft", step=0)  # the next run's: evaluated, then cached
  assert os.path.isfile(tmp_path / "eval_sft.json")


_BUILD_STOPPED = """
import signal, sys
sys.path.insert(0, {tests!r})
from run_helpers import tiny_config
from jaxrl.run import launch, train

def engine_then_sigterm(*args, **kwargs):  # the signal arrives while the run is being built
  engine = built(*args, **kwargs)
  signal.raise_signal(signal.SIGTERM)
  return engine

built, train.task_engine = train.task_engine, engine_then_sigterm
sys.exit(launch._run(tiny_config("test"), {workdir!r}))
"""


def test_sigterm_while_the_run_is_built_ends_it_as_ctrl_c_does(tmp_path):
  """SIGTERM before the run's own handlers are in place (its engine started, programs not yet
  compiled): the parts already started are stopped and the run ends with Ctrl-C's one line and
  exit 130, not killed by the signal; the workdir's lock is free for the next run."""
  from jaxrl.workdir import lock

  workdir = str(tmp_path / "w")
  script = _BUILD_STOPPED.format(tests=os.path.join(ROOT, "tests"), workdir=workdir)
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run(
    [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
  assert "interrupted; run the same command again" in proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  lock.release(lock.hold(workdir))  # taken: the stopped run released it
