"""What ``jaxrl-train`` does once its flags and config are checked (``run/train_cli.py``): the
memory plan (``--plan``), or a run: the processes joined (``jax.distributed.initialize`` before any
device is touched), the inputs from outside the run checked, the run directory held, ``train``,
and the process's exit code for each way a run ends.

Every error found before the run directory is written is one line and exit 2 (``cli.fail``).
"""

from __future__ import annotations

import os
import sys
import traceback

from jaxrl.fields import ConfigError
from jaxrl.nn.arch import checkpoint_error
from jaxrl.parallel import distributed
from jaxrl.rollout.sidecar import SidecarError
from jaxrl.run import cli, plan, plan_report
from jaxrl.run.components import task_sections
from jaxrl.run.stops import NonFiniteError, Stopped
from jaxrl.run.train import train
from jaxrl.tasks import task
from jaxrl.workdir import checkpoint_failures, compile_cache, lock, run_log
from jaxrl.workdir.checkpoint import CheckpointError, UnreadableCheckpoint
from jaxrl.workdir.metric_writers import MetricsError

USAGE_ERROR = cli.USAGE_ERROR


def _fail(message) -> None:
  cli.fail("jaxrl", message)


def memory_plan(cfg, cpu_devices: int) -> None:
  """``--plan``: print the per-device memory plan of ``cfg``'s mesh (no weights needed)."""
  distributed.initialize(cpu_devices=cpu_devices)
  try:
    cfg = cli.with_local_checkpoint(cfg, config_only=True)
    print(plan_report.render(plan.build(cfg)))
  except ValueError as e:  # ConfigError, HubError
    _fail(e)


def start(
  cfg,
  workdir: str,
  *,
  coordinator: str,
  num_processes: int,
  process_id: int,
  cpu_devices: int,
  heartbeat_timeout_s: int,
) -> None:
  """Train ``cfg`` in ``workdir`` and exit with the run's code; the processes of a multi-process
  run joined first (``distributed.initialize``'s arguments)."""
  try:
    distributed.initialize(
      coordinator, num_processes, process_id, cpu_devices, heartbeat_timeout_s=heartbeat_timeout_s
    )
    cfg = cli.with_local_checkpoint(cfg)  # a Hub id: process 0 downloads, the others wait
  except ValueError as e:  # a bad cluster setting, a HubError
    _fail(e)
  workdir = os.path.abspath(workdir)
  _check_inputs(cfg, workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    _fail(f"--workdir={workdir}: not a directory")
  os.makedirs(workdir, exist_ok=True)
  _hold_workdir(workdir)
  run_log.setup(workdir)
  try:
    compile_cache.enable(cfg.compile_cache, workdir)
  except ValueError as e:  # ConfigError: a cache directory others could plant programs in
    _fail(e)
  _leave(_run(cfg, workdir))


def _check_inputs(cfg, workdir: str) -> None:
  """What comes from outside the run, checked before its directory is written: the checkpoint's
  files, whether the run's buffers can fit, the task's inputs, the compile cache's directory. The
  first that fails is one line, exit 2."""
  if (error := checkpoint_error(cfg.model)) is not None:
    _fail(error)
  try:
    if (error := plan.memory_error(cfg)) is not None:  # before anything is allocated
      _fail(error)
    distributed.main_first(
      lambda: task.check_inputs(task_sections(cfg))
    )  # process 0 downloads Hub datasets
    compile_cache.check(cfg.compile_cache, workdir)
  except ValueError as e:  # a ConfigError, a HubError
    _fail(e)


def _hold_workdir(workdir: str) -> None:
  """One trainer per run directory, taken before anything in it is written. Process 0 holds the
  lock for the whole job (its processes are one trainer: they write each checkpoint together);
  the others wait for it, so that a job refused the directory writes nothing there, not even
  their logs: process 0 exits 2 naming the holder, the others 1 naming process 0's error."""
  if distributed.is_main():
    try:
      lock.hold(workdir)  # for the process's life: the kernel releases it however it ends
    except lock.WorkdirBusy as e:
      _fail(e)
  distributed.rendezvous("workdir-lock")


def _run(cfg, workdir: str) -> int:
  """Train; the process's exit code (0 after printing the results)."""
  try:
    result = train(cfg, workdir)
  # Found while building (an unknown level, a busy run directory, no checkpoint that reads).
  except (ConfigError, lock.WorkdirBusy, UnreadableCheckpoint) as e:
    return _error(USAGE_ERROR, f"jaxrl: error: {e}")
  except SidecarError as e:  # checkpoints up to the last completed save are intact
    return _error(
      1,
      f"jaxrl: error: vLLM sidecar: {e}\njaxrl: the last checkpoint in {workdir}/checkpoints "
      "is intact; run the same command again to resume.",
    )
  except (CheckpointError, NonFiniteError) as e:  # CheckpointError: the final write failed
    return _error(1, f"jaxrl: error: {e}")
  except MetricsError as e:  # the step it failed on was not checkpointed: a resume redoes it
    return _error(
      1,
      f"jaxrl: error: {e}\njaxrl: the last checkpoint in {workdir}/checkpoints is intact; "
      "free space and run the same command again to resume.",
    )
  except Stopped as e:  # SIGINT / SIGTERM: the step finished and its checkpoint is saved
    print(f"\njaxrl: {e}; run the same command again to resume.", file=sys.stderr)
    return 0
  except KeyboardInterrupt:
    return _error(130, "\njaxrl: interrupted; run the same command again to resume.")
  except Exception as e:  # noqa: BLE001 - a bug or an I/O error: its traceback, and an exit that ends
    if distributed.watching():  # several processes: the traceback, then every process ends
      traceback.print_exc()
      _error(1, f"jaxrl: error: {type(e).__name__}: {e}")
    _leave_if_unsettled(1, print_traceback=True)
    raise
  print("\nHeld-out evaluation, SFT warm start vs after RL (percent):\n")
  print(result.table)
  print(f"\nworkdir: {workdir} (metrics.jsonl, tensorboard/, run.png, checkpoints/, results.md)")
  return 0


def _error(code: int, text: str) -> int:
  """Print ``text``; in a multi-process run, end every process (this one with ``code``)."""
  print(text, file=sys.stderr)
  distributed.announce_failure(text, code)
  return code


def _leave(code: int) -> None:
  _leave_if_unsettled(code)
  sys.exit(code)


def _leave_if_unsettled(code: int, print_traceback: bool = False) -> None:
  """Exit now with ``os._exit`` if a checkpoint write never settled: its orbax threads are not
  daemons, blocked (e.g. on a dead disk), and a normal exit would wait for them forever. Exit
  handlers are skipped: the trainer has already closed its engine, writers and pools, and every
  log handler flushes each record."""
  if not checkpoint_failures.unsettled():
    return
  if print_traceback:
    traceback.print_exc()
  print(
    "jaxrl: a checkpoint write is still blocked; exiting without waiting for it", file=sys.stderr
  )
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except OSError:
      pass
  os._exit(code)
