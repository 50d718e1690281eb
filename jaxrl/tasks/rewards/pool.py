"""Bounded reward computation: a reusable pool of worker processes with per-answer time limits.

A reward function (a ``module:function`` spec: the math verifier, or a custom one) runs on model
output, which can make sympy hang in C code or exhaust memory; threads cannot be stopped, so each
answer runs in a worker process. Two limits per answer: a soft one inside the worker (an interval
timer raises in Python code, and the worker lives on) and a hard one in the parent
(``time_limit_s + kill_grace_s`` after dispatch: the worker is killed with SIGKILL and replaced).
A batch also has a deadline, so many hanging answers cost about one limit, not one limit per
answer and worker.
Every answer that does not finish (timed out, skipped at the deadline, the function raised or its
worker died) is counted in ``VerifyResult`` and marked unscored (``scored_R``): the trainer leaves
it out of the update rather than train on a reward the verifier never gave.

Workers are fresh interpreters (``python -c``), talking to the parent over a socket pair: JAX in
the parent is not fork-safe, and multiprocessing's spawn and forkserver children import the
parent's ``__main__`` (``jaxrl.main``, hence JAX) before running anything. A worker imports only
the reward function (~0.5 s; replacements start while the batch goes on), lives in its own session
(the terminal's Ctrl-C is the trainer's), dies with the parent (PR_SET_PDEATHSIG, Linux), and has
an address-space limit, so a blow-up is a MemoryError inside it, not the machine out of memory.
A reward function that arms SIGALRM itself (math-verify with its own timeouts on) replaces the
soft timer; the hard kill still bounds it.

The pool knows nothing of any task: whoever builds it may pass ``prepare`` (run in the parent on
each response: the text sent to the function, and whether it was cut) and ``warm_up`` (a (response,
answer) pair each worker scores once before it says ready). The math task passes math's answer
window and warm-up pair (``jaxrl.tasks.math_task``).
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

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 60.0
# Workers in a row that may die while starting (a transient: the machine briefly out of memory or
# processes) before the pool gives up: a spec or limit that cannot work fails every start.
_START_RETRIES = 3
_PR_SET_PDEATHSIG = 1
# Run by a worker's interpreter: the parent's sys.path first (custom reward modules), then the loop.
_BOOT = (
  "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
  "from jaxrl.tasks.rewards.pool import _worker_entry; _worker_entry()"
)
_MESSAGE_CHARS = 300
# One BLAS/OpenMP thread per worker: the workers are the parallelism, and each thread OpenBLAS
# starts at import reserves ~40 MiB of the worker's address-space limit (one per core otherwise).
_WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


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
  truncated: int  # cut by the pool's ``prepare`` (math: the answer window; still scored)
  first_error: str | None = None  # the error of the lowest-index failed answer, for the log
  scored_R: np.ndarray | None = None  # bool[R]: the function returned a reward; None = all

  @property
  def scored(self) -> np.ndarray:
    """bool[R]: which answers have a reward from the function (timeouts, errors, skips do not)."""
    if self.scored_R is None:
      return np.ones(len(self.rewards_R), bool)
    return np.asarray(self.scored_R, bool)

  def metrics(self, prefix: str = "verify_") -> dict[str, float]:
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
  """Worker process: ``_BOOT SYS_PATH_JSON PARENT_PID FD SPEC LIMIT_S MEMORY_LIMIT_MB WARM_UP``
  (``WARM_UP``: a JSON (response, answer) pair or null)."""
  parent_pid, fd, spec = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  limit_s, memory_limit_mb = float(sys.argv[5]), int(sys.argv[6])
  warm_up = json.loads(sys.argv[7])
  try:
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # not glibc Linux: workers end on EOF instead
    pass
  if os.getppid() != parent_pid:  # the parent died before prctl took effect
    return
  _worker_main(
    multiprocessing.connection.Connection(fd), spec, limit_s, memory_limit_mb or None, warm_up
  )


def _worker_main(
  conn, spec: str, limit_s: float, memory_limit_mb: int | None, warm_up: list[str] | None = None
) -> None:
  """Worker loop: load the function (and score ``warm_up`` once), say ready, then answer
  (task, response, answer) messages."""
  # The parent stops us, not a stray Ctrl-C nor a job-wide SIGTERM (a scheduler signals every
  # process of the job): the trainer finishes its step, our answers included, then closes the pool.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
  if warm_up is not None:
    # One-time costs of the function (caches, parsers built on first use) are paid before ready,
    # not inside the first answer's time limit; the warm-up's result does not matter.
    response, answer = warm_up
    _run_one(fn, response, answer, _STARTUP_TIMEOUT_S)
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

  ``reward_fn`` is a ``module:function`` spec, imported by each worker. ``prepare`` (optional, run
  in the parent) maps a response to (the text the function is given, whether it was cut; counted
  in ``VerifyResult.truncated``). ``warm_up`` (optional) is a (response, answer) pair each worker
  scores once before it says ready, under the start-up limit, its result ignored.
  """

  def __init__(
    self,
    reward_fn: str,
    *,
    prepare: Callable[[str], tuple[str, bool]] | None = None,
    warm_up: tuple[str, str] | None = None,
    num_workers: int | None = None,
    time_limit_s: float = 5.0,
    kill_grace_s: float = 0.5,
    batch_time_limit_s: float | None = None,
    per_answer_budget_s: float = 0.25,
    memory_limit_mb: int | None = 4096,
  ):
    if num_workers is None:
      num_workers = min(8, os.cpu_count() or 1)
    for name, value in (
      ("num_workers", num_workers),
      ("time_limit_s", time_limit_s),
      ("per_answer_budget_s", per_answer_budget_s),
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
    if warm_up is not None and not (len(warm_up) == 2 and all(isinstance(x, str) for x in warm_up)):
      raise ValueError(f"VerifierPool: warm_up must be a (response, answer) pair, got {warm_up!r}")
    load_reward_fn(reward_fn)  # a bad spec fails here, in the caller, with its message
    self.reward_fn = reward_fn
    self.prepare = prepare
    self.warm_up = None if warm_up is None else tuple(warm_up)
    self.num_workers = num_workers
    self.time_limit_s = time_limit_s
    self.kill_grace_s = kill_grace_s
    self.batch_time_limit_s = batch_time_limit_s
    self.per_answer_budget_s = per_answer_budget_s
    self.memory_limit_mb = memory_limit_mb
    self.restarts = 0  # workers replaced after a kill or a crash, over the pool's life
    self.start_failures = 0  # workers in a row that died before saying ready
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
        json.dumps(self.warm_up),
      ]
      proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        pass_fds=(child_sock.fileno(),),
        start_new_session=True,
        env={**os.environ, **_WORKER_ENV},
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

  def _check_and_prepare(
    self, responses: Sequence[str], answers: Sequence[str]
  ) -> tuple[list[str], int]:
    """The texts to score (``prepare`` applied) and how many were cut; raises on bad arguments."""
    if len(responses) != len(answers):
      raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    for i, (r, a) in enumerate(zip(responses, answers)):
      if not isinstance(r, str) or not isinstance(a, str):
        raise TypeError(
          f"item {i}: response and answer must be str, got {type(r).__name__} "
          f"and {type(a).__name__}"
        )
    if self.prepare is None:
      return list(responses), 0
    prepared = [self.prepare(r) for r in responses]
    return [text for text, _ in prepared], sum(cut for _, cut in prepared)

  def score(self, responses: Sequence[str], answers: Sequence[str]) -> VerifyResult:
    """Rewards of aligned responses and gold answers; never longer than the batch deadline."""
    if not self._finalizer.alive:
      raise RuntimeError("VerifierPool.score after close()")
    texts, truncated = self._check_and_prepare(responses, answers)
    try:
      return self._score(texts, list(answers), truncated)
    finally:
      # Only an exception (Ctrl-C included) leaves answers running: their workers must not
      # deliver stale results into the next batch.
      for w in list(self._workers):
        if w.task is not None:
          self._replace(w)

  def _score(self, texts: list[str], answers: list[str], truncated: int) -> VerifyResult:
    """Until every answer is scored, timed out, failed or skipped: send answers to idle workers,
    take what workers say, stop what is overdue."""
    batch = _Batch(self, texts, answers, self._batch_limit_s(len(texts)))
    while batch.unfinished():
      batch.dispatch()
      for w in batch.wait():
        batch.receive(w)
      batch.expire()
    return batch.result(truncated)

  def _batch_limit_s(self, n: int) -> float:
    """The batch deadline, counted from the first ready worker: the set one, or the default."""
    if self.batch_time_limit_s is not None:
      return self.batch_time_limit_s
    return (
      self.time_limit_s
      + self.kill_grace_s
      + self.per_answer_budget_s * math.ceil(n / self.num_workers)
    )


class _Batch:
  """One ``score`` call's bookkeeping: the answers not yet sent, rewards, failure counts and
  messages, the batch deadline; it drives the pool's workers (``pool._workers``, ``_replace``)."""

  def __init__(self, pool: VerifierPool, texts: list[str], answers: list[str], limit_s: float):
    self.pool = pool
    self.texts, self.answers = texts, answers
    self.rewards_R = np.zeros(len(texts), np.float32)
    self.scored_R = np.zeros(len(texts), bool)
    self.pending = collections.deque(range(len(texts)))
    self.counts = collections.Counter()
    self.errors: dict[int, str] = {}  # answer index -> message
    self.limit_s = limit_s
    # Set when a worker is ready: start-up does not eat into the batch.
    self.deadline: float | None = None
    self.started = time.monotonic()

  def _busy(self) -> list[_Worker]:
    return [w for w in self.pool._workers if w.task is not None]

  def unfinished(self) -> bool:
    """True while an answer waits to be sent or is running."""
    return bool(self.pending) or bool(self._busy())

  def dispatch(self) -> None:
    """Starts the batch deadline once a worker is ready; sends the next answers to idle workers."""
    now = time.monotonic()
    if self.deadline is None and any(w.ready for w in self.pool._workers):
      self.deadline = now + self.limit_s
    for w in list(self.pool._workers):
      if w.ready and w.task is None and self.pending:
        i = self.pending[0]
        try:
          w.conn.send((i, self.texts[i], self.answers[i]))
        except OSError:  # died while idle: replace it, the answer waits for the next worker
          self.pool._replace(w)
          continue
        self.pending.popleft()
        w.task, w.deadline = i, now + self.pool.time_limit_s + self.pool.kill_grace_s

  def wait(self) -> list[_Worker]:
    """The workers with a message, waited for until the next deadline at most: a running
    answer's hard deadline, the batch deadline, or (no worker ready yet) the start-up limit."""
    workers = self.pool._workers
    first = self.deadline if self.deadline is not None else self.started + _STARTUP_TIMEOUT_S
    wake = min([w.deadline for w in self._busy()] + [first])
    conns = multiprocessing.connection.wait(
      [w.conn for w in workers], max(0.0, wake - time.monotonic())
    )
    return [next(w for w in workers if w.conn is conn) for conn in conns]

  def receive(self, w: _Worker) -> None:
    """Handles one message of ``w`` (ready, failed to load, an answer's result) or its death."""
    try:
      msg = w.conn.recv()
    except (EOFError, OSError):
      self._died(w)
      return
    if msg[0] == "ready":
      w.ready = True
      self.pool.start_failures = 0
    elif msg[0] == "failed":
      raise RewardFnError(msg[1])
    else:
      self._record(w, *msg)

  def _died(self, w: _Worker) -> None:
    """A worker's socket closed: replaced; its answer (if it had one) is an error. One that dies
    while starting is retried, up to ``_START_RETRIES`` times in a row across the pool."""
    code = w.proc.wait(timeout=5.0)
    if not w.ready:
      self.pool.start_failures += 1
      if self.pool.start_failures > _START_RETRIES:
        raise RuntimeError(
          f"verifier workers died while starting {self.pool.start_failures} times in a row "
          f"(last exit code {code}; reward.memory_limit_mb={self.pool.memory_limit_mb}): their "
          "stderr says why"
        ) from None
      log.warning(
        "a verifier worker died while starting (exit code %s): starting another (%d/%d)",
        code,
        self.pool.start_failures,
        _START_RETRIES,
      )
      self.pool._replace(w)
      return
    if w.task is not None:
      self.counts["errors"] += 1
      self.errors[w.task] = f"worker died (exit code {code})"
    self.pool._replace(w)

  def _record(self, w: _Worker, i: int, status: str, value: object) -> None:
    """Answer ``i`` finished in ``w``: its reward, or a counted timeout or error."""
    assert i == w.task, (i, w.task)
    w.task, w.deadline = None, math.inf
    if status == "ok":
      self.rewards_R[i] = value
      self.scored_R[i] = True
    else:
      self.counts[status + "s"] += 1
      if status == "error":
        self.errors[i] = str(value)

  def expire(self) -> None:
    """Kills and replaces workers past their hard deadline; past the batch deadline, every busy
    worker, and the answers never sent are skipped. Raises if no worker started in time."""
    now = time.monotonic()
    for w in list(self.pool._workers):
      if w.task is not None and now >= w.deadline:
        self.counts["timeouts"] += 1
        self.pool._replace(w)
    if self.deadline is None and now - self.started > _STARTUP_TIMEOUT_S:
      raise RuntimeError(f"no verifier worker started within {_STARTUP_TIMEOUT_S:.0f} s")
    if self.deadline is not None and now >= self.deadline:
      for w in self._busy():
        self.counts["timeouts"] += 1
        self.pool._replace(w)
      self.counts["skipped"] += len(self.pending)
      self.pending.clear()

  def result(self, truncated: int) -> VerifyResult:
    """The batch's rewards and counters; failures are logged."""
    errors = self.errors
    first_error = errors[min(errors)] if errors else None
    counts = self.counts
    result = VerifyResult(
      self.rewards_R,
      counts["timeouts"],
      counts["errors"],
      counts["skipped"],
      truncated,
      first_error,
      self.scored_R,
    )
    if result.timeouts or result.errors or result.skipped:
      log.warning(
        "verifier: %d timeouts, %d errors, %d skipped of %d answers%s",
        result.timeouts,
        result.errors,
        result.skipped,
        len(self.rewards_R),
        f" (first error: {first_error})" if first_error else "",
      )
    return result
