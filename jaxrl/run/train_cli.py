"""Command line: ``jaxrl-train --config=tiny --workdir=DIR [--config.x=y]`` (or
``python -m jaxrl.main``).

A thin shell over ``jaxrl.run.launch``: parse flags, convert and check the config once, then launch
(``--plan``, or a run). A broken config (or flag) prints one line naming the field and exits with
code 2, before the run's modules load.
"""

from __future__ import annotations

import json
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxrl.config import from_configdict, to_dict
from jaxrl.fields import ConfigError
from jaxrl.run import cli
from jaxrl.tasks.envs import registry as environments

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
  from jaxrl.methods import registry  # lazy: it loads JAX, after the flags and config file

  if _CONFIG.value is None or not (_WORKDIR.value or _PLAN.value or _PRINT_CONFIG.value):
    _fail("--config and --workdir are required")
  try:
    cfg = from_configdict(_CONFIG.value)  # the config file is loaded lazily, here
    # Method names: whatever the registry holds.
    registry.check(allocation=cfg.allocation, temperature=cfg.temperature, clip=cfg.clip)
    environments.check(cfg.task)
  except ConfigError as e:
    _fail(e)
  except _BAD_FLAG_ERRORS as e:
    _usage_error(e)
  return cfg


def main(argv):
  del argv
  # Past a file-size limit, writes fail with EFBIG (handled: a failed checkpoint is logged, the
  # previous one kept) instead of the default SIGXFSZ killing the run.
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  cfg = _config()
  if _PRINT_CONFIG.value:
    print(json.dumps(to_dict(cfg), indent=1))
    return
  # Lazy: the library (JAX) loads once the config is checked, so a bad one exits 2 at once.
  from jaxrl.run import launch

  if _PLAN.value:
    return launch.memory_plan(cfg, _CPU_DEVICES.value)
  launch.start(
    cfg,
    _WORKDIR.value,
    coordinator=_COORDINATOR.value,
    num_processes=_NUM_PROCESSES.value,
    process_id=_PROCESS_ID.value,
    cpu_devices=_CPU_DEVICES.value,
    heartbeat_timeout_s=_HEARTBEAT_TIMEOUT.value,
  )


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
