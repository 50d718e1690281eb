"""Command line: ``jaxrl-train --config=tiny --workdir=DIR [--config.x=y]`` (or
``python -m jaxrl.main``).

A thin shell over ``jaxrl.run.train``: parse flags, convert the config once, run. A broken config (or
flag) prints one line naming the field and exits with code 2, before anything is compiled.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxrl.run import cli
from jaxrl.workdir import run_log

USAGE = """Train a policy by RL (GRPO and the methods of E3, DynaMO, EEPO, Entropy Scheduling).

  jaxrl-train --config=tiny --workdir=runs/tiny                  (or python -m jaxrl.main ...)
  jaxrl-train --config=tiny:e3,anneal --workdir=DIR --config.steps=100 --config.seed=1
  jaxrl-train --config=qwen7b --plan                              memory per device, no weights
  jaxrl-train --config=tiny --config.rollout.max_staleness=1 --print_config
"""

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "A built-in config by name (tiny, tiny:e3, qwen7b:grpo), a config file "
  "(configs/tiny.py[:ARG]) or a JSON config (a run's config.json).",
)
_PRINT_CONFIG = flags.DEFINE_bool(
  "print_config",
  False,
  "Print the resolved config (after every --config.* override) as JSON and exit; "
  "--config=THAT.json gives the same config back.",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for everything the run writes.")
_PLAN = flags.DEFINE_bool(
  "plan",
  False,
  "Print the per-device memory plan of the configured mesh and exit (no weights "
  "needed; with fake devices via XLA_FLAGS it also compiles the train step ahead of time).",
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  "",
  "Multi-process runs: host:port of process 0 (or $JAXRL_COORDINATOR); "
  "'auto' lets JAX read the cluster (SLURM, TPU pods).",
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", 0, "Processes of the run ($JAXRL_NUM_PROCESSES)."
)
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "This process's index ($JAXRL_PROCESS_ID).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "CPU devices per process (0: JAX's default).")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
  "heartbeat_timeout",
  60,
  "Seconds after which a process that died without a word (SIGKILL, a crash) ends the other "
  "processes of a multi-process run (one that fails with an error ends them at once).",
)

USAGE_ERROR = cli.USAGE_ERROR


_BAD_FLAG_ERRORS = (flags.Error, OSError, ValueError, TypeError, AttributeError, KeyError)


def _usage_error(e: BaseException):
  """Print one line for a bad flag or config file and exit 2."""
  cause = e.args[0] if e.args else None
  if isinstance(e, AttributeError) and isinstance(cause, KeyError):  # ml_collections' unknown key
    message = f"unknown config field {cause.args[0]}"
  else:
    # Errors raised inside a config file arrive wrapped with their traceback: keep the last line.
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    message = lines[-1] if lines else type(e).__name__
  print(f"jaxrl: error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except _BAD_FLAG_ERRORS as e:
    _usage_error(e)


def _fail(message) -> None:
  cli.fail("jaxrl", message)


def _config():
  """The converted, checked config; a bad one exits 2 with one line."""
  from jaxrl.config import ConfigError, from_configdict
  from jaxrl.methods import registry
  from jaxrl.tasks.envs import registry as environments

  if _CONFIG.value is None or not (_WORKDIR.value or _PLAN.value or _PRINT_CONFIG.value):
    _fail("--config and --workdir are required")
  try:
    cfg = from_configdict(_CONFIG.value)  # the config file is loaded lazily, here
    registry.check(cfg)  # method names: whatever the registry holds
    environments.check(cfg)
  except ConfigError as e:
    _fail(e)
  except _BAD_FLAG_ERRORS as e:
    _usage_error(e)
  return cfg


def _plan(cfg) -> None:
  from jaxrl.parallel import distributed
  from jaxrl.run import plan, plan_report

  distributed.initialize(cpu_devices=_CPU_DEVICES.value)
  try:
    cfg = cli.with_local_checkpoint(cfg, config_only=True)
    print(plan_report.render(plan.build(cfg)))
  except ValueError as e:  # ConfigError, HubError
    _fail(e)


def _check_inputs(cfg, workdir: str) -> None:
  """What comes from outside the run, checked before its directory is written: the checkpoint's
  files, whether the run's buffers can fit, the task's inputs, the compile cache's directory. The
  first that fails is one line, exit 2."""
  from jaxrl.nn.arch import checkpoint_error
  from jaxrl.parallel import distributed
  from jaxrl.run import plan
  from jaxrl.tasks import task
  from jaxrl.workdir import compile_cache

  if (error := checkpoint_error(cfg)) is not None:
    _fail(error)
  try:
    if (error := plan.memory_error(cfg)) is not None:  # before anything is allocated
      _fail(error)
    distributed.main_first(lambda: task.check_inputs(cfg))  # process 0 downloads Hub datasets
    compile_cache.check(cfg.compile_cache, workdir)
  except ValueError as e:  # a ConfigError, a HubError
    _fail(e)


def main(argv):
  del argv
  # Past a file-size limit, writes fail with EFBIG (handled: a failed checkpoint is logged, the
  # previous one kept) instead of the default SIGXFSZ killing the run.
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  cfg = _config()
  if _PRINT_CONFIG.value:
    from jaxrl.config import to_dict

    print(json.dumps(to_dict(cfg), indent=1))
    return
  if _PLAN.value:
    return _plan(cfg)
  from jaxrl.parallel import distributed

  try:
    distributed.initialize(
      _COORDINATOR.value,
      _NUM_PROCESSES.value,
      _PROCESS_ID.value,
      _CPU_DEVICES.value,
      heartbeat_timeout_s=_HEARTBEAT_TIMEOUT.value,
    )
    cfg = cli.with_local_checkpoint(cfg)  # a Hub id: process 0 downloads, the others wait
  except ValueError as e:  # a bad cluster setting, a HubError
    _fail(e)
  workdir = os.path.abspath(_WORKDIR.value)
  _check_inputs(cfg, workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    _fail(f"--workdir={workdir}: not a directory")
  os.makedirs(workdir, exist_ok=True)
  _hold_workdir(workdir)
  run_log.setup(workdir)
  from jaxrl.workdir import compile_cache

  try:
    compile_cache.enable(cfg.compile_cache, workdir)
  except ValueError as e:  # ConfigError: a cache directory others could plant programs in
    _fail(e)
  _leave(_run(cfg, workdir))


def _hold_workdir(workdir: str) -> None:
  """One trainer per run directory, taken before anything in it is written. Process 0 holds the
  lock for the whole job (its processes are one trainer: they write each checkpoint together);
  the others wait for it, so that a job refused the directory writes nothing there, not even
  their logs: process 0 exits 2 naming the holder, the others 1 naming process 0's error."""
  from jaxrl.parallel import distributed
  from jaxrl.workdir import lock

  if distributed.is_main():
    try:
      lock.hold(workdir)  # for the process's life: the kernel releases it however it ends
    except lock.WorkdirBusy as e:
      _fail(e)
  distributed.rendezvous("workdir-lock")


def _run(cfg, workdir: str) -> int:
  """Train; the process's exit code (0 after printing the results)."""
  from jaxrl.config import ConfigError
  from jaxrl.rollout.sidecar import SidecarError
  from jaxrl.run.stops import NonFiniteError, Stopped
  from jaxrl.run.train import train
  from jaxrl.workdir.checkpoint import CheckpointError, UnreadableCheckpoint
  from jaxrl.workdir.lock import WorkdirBusy
  from jaxrl.workdir.metric_writers import MetricsError

  try:
    result = train(cfg, workdir)
  # Found while building (an unknown level, a busy run directory, no checkpoint that reads).
  except (ConfigError, WorkdirBusy, UnreadableCheckpoint) as e:
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
    from jaxrl.parallel import distributed

    if distributed.watching():  # several processes: the traceback, then every process ends
      import traceback

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
  from jaxrl.parallel import distributed

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
  from jaxrl.workdir import checkpoint

  if not checkpoint.unsettled():
    return
  if print_traceback:
    import traceback

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


def run_cli():
  if cli.wants_help(sys.argv):
    cli.print_help(USAGE, [__name__])
    return
  try:
    sys.argv = cli.resolve_argv(sys.argv)
  except FileNotFoundError as e:
    _fail(e)
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run_cli()
