"""What runs inside a worker process of ``jaxrl.tasks.workers``: the interpreter's boot line, the
function loaded from its ``module:function`` spec, each call under the soft time limit (an
interval timer), and the loop that answers the parent's messages. It imports nothing of JAX: a
worker is a fresh interpreter that loads only this module, the function and its check.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import multiprocessing.connection
import os
import signal
import sys
from collections.abc import Callable, Sequence

# The least time a worker gets to start (its imports, its warm-up call).
STARTUP_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1
# Run by a worker's interpreter: the parent's sys.path first (custom modules), then the loop.
BOOT = (
  "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
  "from jaxrl.tasks.worker_process import worker_entry; worker_entry()"
)
MESSAGE_CHARS = 300


class FunctionSpecError(ValueError):
  """A function spec that cannot be loaded; the message names what failed."""


class BadResult(Exception):
  """Raised by a ``check``: the call is an error whose message is this exception's text."""


def load_function(spec: str, kind: str = "function", error=FunctionSpecError) -> Callable:
  """The callable named by ``"package.module:function"`` (the attribute may be dotted); a spec
  that does not load raises ``error`` with a message that starts with ``kind`` and the spec."""
  what = f"{kind} {spec!r}"
  if not isinstance(spec, str) or spec.count(":") != 1:
    raise error(f"{what} is not of the form 'module:function'")
  module_name, attr = spec.split(":")
  if not module_name or not attr:
    raise error(f"{what} is not of the form 'module:function'")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name == module_name or module_name.startswith(f"{e.name}."):
      raise error(f"{what}: module {e.name!r} not found") from e
    raise error(f"{what}: importing {module_name!r} failed: {e}") from e
  except Exception as e:
    raise error(f"{what}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
  obj = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise error(
        f"{what}: {type(obj).__name__} "
        f"{getattr(obj, '__name__', module_name)!r} has no attribute {part!r}"
      )
    obj = getattr(obj, part)
  if not callable(obj):
    raise error(f"{what} is a {type(obj).__name__}, not callable")
  return obj


class _SoftTimeout(BaseException):
  """Raised by the worker's interval timer; not an Exception, so library code does not catch it."""


def _on_alarm(signum, frame):
  raise _SoftTimeout()


def _run_one(fn, check, args: Sequence, limit_s: float) -> tuple[str, object]:
  """("ok", value) | ("timeout", None) | ("error", message), under the soft time limit."""
  try:
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
      try:
        value = fn(*args)
        return "ok", value if check is None else check(value)
      except _SoftTimeout:
        raise
      except BadResult as e:
        return "error", str(e)[:MESSAGE_CHARS]
      except BaseException as e:  # noqa: BLE001 — the call fails whatever the function did
        # Formatted under the timer: str() of a sympy object can itself hang.
        return "error", f"{type(e).__name__}: {str(e)[:MESSAGE_CHARS]}"
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  except _SoftTimeout:
    return "timeout", None


def worker_entry() -> None:
  """Worker process: ``BOOT SYS_PATH_JSON SETTINGS_JSON`` (``_spawn`` writes the settings)."""
  s = json.loads(sys.argv[2])
  try:
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # not glibc Linux: workers end on EOF instead
    pass
  if os.getppid() != s["parent_pid"]:  # the parent died before prctl took effect
    return
  _worker_main(multiprocessing.connection.Connection(s["fd"]), s)


def _worker_main(conn, s: dict) -> None:
  """Worker loop: load the function and its check (and run ``warm_up`` once), say ready, then
  answer (task, args) messages."""
  # The parent stops us, not a stray Ctrl-C nor a job-wide SIGTERM (a scheduler signals every
  # process of the job): the trainer finishes its step, our calls included, then closes the pool.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGALRM, _on_alarm)
  # math-verify warns once per process that its own timeouts are off: they are, on purpose.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  if s["memory_limit_mb"]:
    import resource

    limit = s["memory_limit_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  try:
    fn = load_function(s["spec"], s["kind"])
    check = load_function(s["check"], f"{s['kind']} check") if s["check"] else None
  except FunctionSpecError as e:
    conn.send(("failed", str(e)))
    return
  if s["warm_up"] is not None:
    # One-time costs of the function (caches, parsers built on first use) are paid before ready,
    # not inside the first call's time limit; the warm-up's result does not matter.
    _run_one(fn, check, s["warm_up"], STARTUP_TIMEOUT_S)
  conn.send(("ready", os.getpid()))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    task, args = msg
    status, value = _run_one(fn, check, args, s["limit_s"])
    try:
      conn.send((task, status, value))
    except (EOFError, OSError):
      return
    except Exception as e:  # noqa: BLE001 — a value that does not pickle
      conn.send((task, "error", f"the value does not pickle: {type(e).__name__}"))
