"""Bounded reward computation: a reusable pool of worker processes with per-answer time limits.

A reward function (the math verifier, or a custom ``module:function``) runs on model output, which
can make sympy hang in C code or exhaust memory; threads cannot be stopped, so each answer runs in
a worker process. Two limits per answer: a soft one inside the worker (an interval timer raises
in Python code, and the worker lives on) and a hard one in the parent (``time_limit_s +
kill_grace_s`` after dispatch: the worker is killed with SIGKILL and replaced). A batch also has a
deadline, so many hanging answers cost about one limit, not one limit per answer and worker.
Every answer that does not finish scores 0 and is counted in ``VerifyResult``.

Workers are fresh interpreters (``python -c``), talking to the parent over a socket pair: JAX in
the parent is not fork-safe, and multiprocessing's spawn and forkserver children import the
parent's ``__main__`` (``jaxrl.main``, hence JAX) before running anything. A worker imports only
the reward function (~0.5 s; replacements start while the batch goes on), lives in its own session
(the terminal's Ctrl-C is the trainer's), dies with the parent (PR_SET_PDEATHSIG, Linux), and has
an address-space limit, so a blow-up is a MemoryError inside it, not the machine out of memory.
A reward function that arms SIGALRM itself (math-verify with its own timeouts on) replaces the
soft timer; the hard kill still bounds it.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import importlib
import json
import logging
import math
import multiprocessing.connection
import numbers
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.rewards.math import MAX_ANSWER_CHARS, answer_window

log = logging.getLogger(__name__)

MATH_REWARD = "jaxrl.rewards.math:score"
_STARTUP_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1
# Run by a worker's interpreter: the parent's sys.path first (custom reward modules), then the loop.
_BOOT = (
  "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
  "from jaxrl.rewards.pool import _worker_entry; _worker_entry()"
)
_MESSAGE_CHARS = 300


class RewardFnError(ValueError):
  """A reward function spec that cannot be loaded; the message names what failed."""


def load_reward_fn(spec: str) -> Callable[[str, str], float]:
  """The callable named by ``"package.module:function"`` (the attribute may be dotted)."""
  if not isinstance(spec, str) or spec.count(":") != 1:
    raise RewardFnError(f"reward function {spec!r} is not of the form 'module:function'")
  module_name, attr = spec.split(":")
  if not module_name or not attr:
    raise RewardFnError(f"reward function {spec!r} is not of the form 'module:function'")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name == module_name or module_name.startswith(f"{e.name}."):
      raise RewardFnError(f"reward function {spec!r}: module {e.name!r} not found") from e
    raise RewardFnError(f"reward function {spec!r}: importing {module_name!r} failed: {e}") from e
  except Exception as e:
    raise RewardFnError(
      f"reward function {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
    ) from e
  obj = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise RewardFnError(
        f"reward function {spec!r}: {type(obj).__name__} "
        f"{getattr(obj, '__name__', module_name)!r} has no attribute {part!r}"
      )
    obj = getattr(obj, part)
  if not callable(obj):
    raise RewardFnError(f"reward function {spec!r} is a {type(obj).__name__}, not callable")
  return obj


@dataclasses.dataclass(frozen=True)
class VerifyResult:
  rewards_R: np.ndarray  # f32[R]; 0 for every answer counted below
  timeouts: int  # stopped at the per-answer limit, or while running at the batch deadline
  errors: int  # the function raised or returned a non-finite non-number, or its worker died
  skipped: int  # never started before the batch deadline
  truncated: int  # answer region cut by the input cap (math verifier only; still scored)
  first_error: str | None = None  # the error of the lowest-index failed answer, for the log

  def metrics(self, prefix: str = "reward/") -> dict[str, float]:
    """The counters as floats, for the metrics writer."""
    return {
      prefix + k: float(getattr(self, k)) for k in ("timeouts", "errors", "skipped", "truncated")
    }


class _SoftTimeout(BaseException):
  """Raised by the worker's interval timer; not an Exception, so library code does not catch it."""


def _on_alarm(signum, frame):
  raise _SoftTimeout()


def _run_one(fn, response: str, answer: str, limit_s: float) -> tuple[str, object]:
  """("ok", reward) | ("timeout", None) | ("error", message), under the soft time limit."""
  try:
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
      try:
        value = fn(response, answer)
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
          return "ok", float(value)
        return (
          "error",
          f"returned {type(value).__name__} {str(value)[:_MESSAGE_CHARS]!r}, not a finite number",
        )
      except _SoftTimeout:
        raise
      except BaseException as e:  # noqa: BLE001 — the answer scores 0 whatever the function did
        # Formatted under the timer: str() of a sympy object can itself hang.
        return "error", f"{type(e).__name__}: {str(e)[:_MESSAGE_CHARS]}"
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  except _SoftTimeout:
    return "timeout", None


def _worker_entry() -> None:
  """Worker process: ``_BOOT SYS_PATH_JSON PARENT_PID FD SPEC LIMIT_S MEMORY_LIMIT_MB``."""
  parent_pid, fd, spec = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  limit_s, memory_limit_mb = float(sys.argv[5]), int(sys.argv[6])
  try:
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # not glibc Linux: workers end on EOF instead
    pass
  if os.getppid() != parent_pid:  # the parent died before prctl took effect
    return
  _worker_main(multiprocessing.connection.Connection(fd), spec, limit_s, memory_limit_mb or None)


def _worker_main(conn, spec: str, limit_s: float, memory_limit_mb: int | None) -> None:
  """Worker loop: load the function, say ready, then answer (task, response, answer) messages."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us, not a stray Ctrl-C
  signal.signal(signal.SIGALRM, _on_alarm)
  # math-verify warns once per process that its own timeouts are off: they are, on purpose.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  if memory_limit_mb:
    import resource

    limit = memory_limit_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  try:
    fn = load_reward_fn(spec)
  except RewardFnError as e:
    conn.send(("failed", str(e)))
    return
  if spec == MATH_REWARD:
    # The first parse builds math-verify's regexes and the LaTeX parser (~0.2-1 s): pay it before
    # ready, not inside the first answer's time limit.
    _run_one(fn, "\\boxed{\\frac{1}{2}}", "0.5", _STARTUP_TIMEOUT_S)
  conn.send(("ready", os.getpid()))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    task, response, answer = msg
    conn.send((task, *_run_one(fn, response, answer, limit_s)))


@dataclasses.dataclass(eq=False)
class _Worker:
  proc: subprocess.Popen
  conn: multiprocessing.connection.Connection
  ready: bool = False
  task: int | None = None  # index into the batch, while busy
  deadline: float = math.inf  # hard deadline of the running task (monotonic)


def _stop(workers: list[_Worker], graceful: bool) -> None:
  """Ends every worker: a shutdown message first if graceful, SIGKILL for what remains."""
  for w in workers:
    if graceful and w.proc.poll() is None:
      try:
        w.conn.send(None)
      except OSError:
        pass
  for w in workers:
    if graceful:
      try:
        w.proc.wait(timeout=1.0)
      except subprocess.TimeoutExpired:
        pass
    _kill(w)
  workers.clear()


def _kill(w: _Worker) -> None:
  """SIGKILL (it may be stuck in C code), reap, close the socket."""
  if w.proc.poll() is None:
    w.proc.kill()
    w.proc.wait(timeout=5.0)
  w.conn.close()


class VerifierPool:
  """Scores batches of (response, gold) with ``reward_fn`` in ``num_workers`` bounded processes.

  Reusable across steps (workers persist between ``score`` calls) and not thread-safe; stop it
  with ``close()`` or a ``with`` block. The batch deadline defaults to ``time_limit_s +
  kill_grace_s + per_answer_budget_s * ceil(R / num_workers)``: room for a normal batch plus one
  hard limit.
  """

  def __init__(
    self,
    reward_fn: str = MATH_REWARD,
    *,
    num_workers: int | None = None,
    time_limit_s: float = 5.0,
    kill_grace_s: float = 0.5,
    batch_time_limit_s: float | None = None,
    per_answer_budget_s: float = 0.25,
    max_answer_chars: int = MAX_ANSWER_CHARS,
    memory_limit_mb: int | None = 4096,
  ):
    if num_workers is None:
      num_workers = min(8, os.cpu_count() or 1)
    for name, value in (
      ("num_workers", num_workers),
      ("time_limit_s", time_limit_s),
      ("per_answer_budget_s", per_answer_budget_s),
      ("max_answer_chars", max_answer_chars),
    ):
      if not value > 0:
        raise ValueError(f"VerifierPool: {name} must be positive, got {value}")
    if kill_grace_s < 0:
      raise ValueError(f"VerifierPool: kill_grace_s must be >= 0, got {kill_grace_s}")
    if batch_time_limit_s is not None and not batch_time_limit_s > 0:
      raise ValueError(
        f"VerifierPool: batch_time_limit_s must be positive, got {batch_time_limit_s}"
      )
    if memory_limit_mb is not None and not memory_limit_mb > 0:
      raise ValueError(
        f"VerifierPool: memory_limit_mb must be positive or None, got {memory_limit_mb}"
      )
    load_reward_fn(reward_fn)  # a bad spec fails here, in the caller, with its message
    self.reward_fn = reward_fn
    self.num_workers = num_workers
    self.time_limit_s = time_limit_s
    self.kill_grace_s = kill_grace_s
    self.batch_time_limit_s = batch_time_limit_s
    self.per_answer_budget_s = per_answer_budget_s
    self.max_answer_chars = max_answer_chars
    self.memory_limit_mb = memory_limit_mb
    self.restarts = 0  # workers replaced after a kill or a crash, over the pool's life
    self._workers: list[_Worker] = []
    self._finalizer = weakref.finalize(self, _stop, self._workers, False)
    for _ in range(num_workers):
      self._workers.append(self._spawn())

  def _spawn(self) -> _Worker:
    """Starts a worker; it says ready on its socket once its reward function is loaded."""
    parent_sock, child_sock = socket.socketpair()
    with child_sock:
      argv = [
        sys.executable,
        "-c",
        _BOOT,
        json.dumps([str(p) for p in sys.path]),
        str(os.getpid()),
        str(child_sock.fileno()),
        self.reward_fn,
        repr(self.time_limit_s),
        str(self.memory_limit_mb or 0),
      ]
      proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, pass_fds=(child_sock.fileno(),), start_new_session=True
      )
    return _Worker(proc, multiprocessing.connection.Connection(parent_sock.detach()))

  def _replace(self, w: _Worker) -> None:
    """Kills ``w`` and puts a fresh worker in its place."""
    _kill(w)
    self._workers[self._workers.index(w)] = self._spawn()
    self.restarts += 1

  def close(self) -> None:
    """Stops the workers; idempotent. ``score`` after ``close`` raises."""
    _stop(self._workers, graceful=True)
    self._finalizer.detach()

  def __enter__(self) -> VerifierPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _prepare(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[str], int]:
    if len(responses) != len(answers):
      raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    for i, (r, a) in enumerate(zip(responses, answers)):
      if not isinstance(r, str) or not isinstance(a, str):
        raise TypeError(
          f"item {i}: response and answer must be str, got {type(r).__name__} "
          f"and {type(a).__name__}"
        )
    if self.reward_fn != MATH_REWARD:
      return list(responses), 0
    windows = [answer_window(r, self.max_answer_chars) for r in responses]
    return [w for w, _ in windows], sum(cut for _, cut in windows)

  def score(self, responses: Sequence[str], answers: Sequence[str]) -> VerifyResult:
    """Rewards of aligned responses and gold answers; never longer than the batch deadline."""
    if not self._finalizer.alive:
      raise RuntimeError("VerifierPool.score after close()")
    texts, truncated = self._prepare(responses, answers)
    try:
      return self._score(texts, list(answers), truncated)
    finally:
      # Only an exception (Ctrl-C included) leaves answers running: their workers must not
      # deliver stale results into the next batch.
      for w in list(self._workers):
        if w.task is not None:
          self._replace(w)

  def _score(self, texts: list[str], answers: list[str], truncated: int) -> VerifyResult:
    n = len(texts)
    rewards_R = np.zeros(n, np.float32)
    pending = collections.deque(range(n))
    counts = collections.Counter()
    errors = {}  # answer index -> message
    batch_limit = self.batch_time_limit_s
    if batch_limit is None:
      batch_limit = (
        self.time_limit_s
        + self.kill_grace_s
        + self.per_answer_budget_s * math.ceil(n / self.num_workers)
      )
    batch_deadline = None  # set when a worker is ready: start-up does not eat into the batch
    started = time.monotonic()

    while pending or any(w.task is not None for w in self._workers):
      now = time.monotonic()
      if batch_deadline is None and any(w.ready for w in self._workers):
        batch_deadline = now + batch_limit
      for w in list(self._workers):
        if w.ready and w.task is None and pending:
          i = pending[0]
          try:
            w.conn.send((i, texts[i], answers[i]))
          except OSError:  # died while idle: replace it, the answer waits for the next worker
            self._replace(w)
            continue
          pending.popleft()
          w.task, w.deadline = i, now + self.time_limit_s + self.kill_grace_s
      wake = min(
        [w.deadline for w in self._workers if w.task is not None]
        + [batch_deadline if batch_deadline is not None else started + _STARTUP_TIMEOUT_S]
      )
      for conn in multiprocessing.connection.wait(
        [w.conn for w in self._workers], max(0.0, wake - time.monotonic())
      ):
        w = next(w for w in self._workers if w.conn is conn)
        try:
          msg = conn.recv()
        except (EOFError, OSError):
          if not w.ready:
            raise RuntimeError(
              f"a verifier worker died while starting (exit code "
              f"{w.proc.wait(timeout=5.0)}); its stderr says why"
            ) from None
          code = w.proc.wait(timeout=5.0)
          if w.task is not None:
            counts["errors"] += 1
            errors[w.task] = f"worker died (exit code {code})"
          self._replace(w)
          continue
        if msg[0] == "ready":
          w.ready = True
        elif msg[0] == "failed":
          raise RewardFnError(msg[1])
        else:
          i, status, value = msg
          assert i == w.task, (i, w.task)
          w.task, w.deadline = None, math.inf
          if status == "ok":
            rewards_R[i] = value
          else:
            counts[status + "s"] += 1
            if status == "error":
              errors[i] = str(value)
      now = time.monotonic()
      for w in list(self._workers):
        if w.task is not None and now >= w.deadline:
          counts["timeouts"] += 1
          self._replace(w)
      if batch_deadline is None and now - started > _STARTUP_TIMEOUT_S:
        raise RuntimeError(f"no verifier worker started within {_STARTUP_TIMEOUT_S:.0f} s")
      if batch_deadline is not None and now >= batch_deadline:
        for w in list(self._workers):
          if w.task is not None:
            counts["timeouts"] += 1
            self._replace(w)
        counts["skipped"] += len(pending)
        pending.clear()

    first_error = errors[min(errors)] if errors else None
    result = VerifyResult(
      rewards_R, counts["timeouts"], counts["errors"], counts["skipped"], truncated, first_error
    )
    if result.timeouts or result.errors or result.skipped:
      log.warning(
        "verifier: %d timeouts, %d errors, %d skipped of %d answers%s",
        result.timeouts,
        result.errors,
        result.skipped,
        n,
        f" (first error: {first_error})" if first_error else "",
      )
    return result
