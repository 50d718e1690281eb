"""Bounded calls in worker processes: the one implementation behind the verifier pool and tools.

A function named by a ``module:function`` spec runs on untrusted input (a verifier on model output,
a tool on a model's call), which can hang in C code, crash or exhaust memory; threads cannot be
stopped, so each call runs in a worker process. Two limits per call: a soft one inside the worker
(an interval timer raises in Python code, and the worker lives on) and a hard one in the parent
(``time_limit_s + kill_grace_s`` after dispatch: the worker is killed with SIGKILL and replaced).
A batch also has a deadline, so many hanging calls cost about one limit, not one limit per call
and worker. Every call ends in one status: ``ok`` (its value), ``timeout``, ``error`` (the
function raised, its value failed the check, or its worker died) or ``skipped`` (never started
before the batch deadline).

Workers are fresh interpreters (``python -c``), talking to the parent over a socket pair: JAX in
the parent is not fork-safe, and multiprocessing's spawn and forkserver children import the
parent's ``__main__`` (``jaxrl.main``, hence JAX) before running anything. A worker imports only
the function and its check (replacements start while the batch goes on), lives in its own session
(the terminal's Ctrl-C is the trainer's), dies with the parent (PR_SET_PDEATHSIG, Linux), and has
an address-space limit, so a blow-up is a MemoryError inside it, not the machine out of memory.
A function that arms SIGALRM itself replaces the soft timer; the hard kill still bounds it.
What runs inside a worker (its boot line, the function loaded, the soft timer, the message loop)
is ``jaxrl.tasks.worker_process``; this module is the parent's side.

``check`` (a second spec, optional) runs in the worker on each returned value, under the same
timer: it returns what is sent back (bounded, picklable) or raises ``BadResult`` with the message
the call's error carries. The verifier pool checks for a finite reward; tools cut their text.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence

from jaxrl.tasks.worker_process import (
  BOOT,
  STARTUP_TIMEOUT_S,
  FunctionSpecError,
  load_function,
)

log = logging.getLogger(__name__)

# Workers in a row that may die while starting (a transient: the machine briefly out of memory or
# processes) before the pool gives up: a spec or limit that cannot work fails every start.
_START_RETRIES = 3
# One BLAS/OpenMP thread per worker: the workers are the parallelism, and each thread OpenBLAS
# starts at import reserves ~40 MiB of the worker's address-space limit (one per core otherwise).
_WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
STATUSES = ("ok", "timeout", "error", "skipped")


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


@dataclasses.dataclass(frozen=True)
class Calls:
  """One ``WorkerPool.run``'s outcome, aligned with its calls."""

  status: tuple[str, ...]  # each call's: ok | timeout | error | skipped
  values: tuple  # the (checked) value where ok, else None
  errors: dict[int, str]  # call index -> message, for each error

  def count(self, status: str) -> int:
    return self.status.count(status)

  @property
  def first_error(self) -> str | None:
    """The error of the lowest-index failed call, for the log."""
    return self.errors[min(self.errors)] if self.errors else None


class WorkerPool:
  """Runs batches of calls of ``fn`` in ``num_workers`` bounded processes.

  Reusable across batches (workers persist between ``run`` calls) and not thread-safe; stop it
  with ``close()`` or a ``with`` block. The batch deadline defaults to ``time_limit_s +
  kill_grace_s + per_call_budget_s * ceil(calls / num_workers)``: room for a normal batch plus
  one hard limit. ``fn`` and ``check`` are ``module:function`` specs, loaded by each worker (and
  once here, so a bad spec fails in the caller); ``warm_up`` is the arguments of one call each
  worker makes before it says ready, under the start-up limit, its result ignored. ``kind`` names
  the function in messages ("reward function", "tool").
  """

  spec_error = FunctionSpecError  # raised for a spec that does not load

  def __init__(
    self,
    fn: str,
    *,
    check: str | None = None,
    kind: str = "function",
    warm_up: Sequence | None = None,
    num_workers: int | None = None,
    time_limit_s: float = 5.0,
    kill_grace_s: float = 0.5,
    batch_time_limit_s: float | None = None,
    per_call_budget_s: float = 0.25,
    memory_limit_mb: int | None = 4096,
  ):
    name = type(self).__name__
    if num_workers is None:
      num_workers = min(8, os.cpu_count() or 1)
    for field, value in (
      ("num_workers", num_workers),
      ("time_limit_s", time_limit_s),
      ("per_call_budget_s", per_call_budget_s),
    ):
      if not value > 0:
        raise ValueError(f"{name}: {field} must be positive, got {value}")
    if kill_grace_s < 0:
      raise ValueError(f"{name}: kill_grace_s must be >= 0, got {kill_grace_s}")
    if batch_time_limit_s is not None and not batch_time_limit_s > 0:
      raise ValueError(f"{name}: batch_time_limit_s must be positive, got {batch_time_limit_s}")
    if memory_limit_mb is not None and not memory_limit_mb > 0:
      raise ValueError(f"{name}: memory_limit_mb must be positive or None, got {memory_limit_mb}")
    self._load(fn, check, kind)  # a bad spec fails here, in the caller, with its message
    self.fn, self.check, self.kind = fn, check, kind
    self.warm_up = None if warm_up is None else list(warm_up)
    self.num_workers = num_workers
    self.time_limit_s = time_limit_s
    self.kill_grace_s = kill_grace_s
    self.batch_time_limit_s = batch_time_limit_s
    self.per_call_budget_s = per_call_budget_s
    self.memory_limit_mb = memory_limit_mb
    self.restarts = 0  # workers replaced after a kill or a crash, over the pool's life
    self.start_failures = 0  # workers in a row that died before saying ready
    self._workers: list[_Worker] = []
    self._finalizer = weakref.finalize(self, _stop, self._workers, False)
    for _ in range(num_workers):
      self._workers.append(self._spawn())

  def _load(self, fn: str, check: str | None, kind: str) -> None:
    load_function(fn, kind, self.spec_error)
    if check is not None:
      load_function(check, f"{kind} check", self.spec_error)

  def _spawn(self) -> _Worker:
    """Starts a worker; it says ready on its socket once its function is loaded."""
    parent_sock, child_sock = socket.socketpair()
    with child_sock:
      settings = dict(
        parent_pid=os.getpid(),
        fd=child_sock.fileno(),
        spec=self.fn,
        check=self.check,
        kind=self.kind,
        limit_s=self.time_limit_s,
        memory_limit_mb=self.memory_limit_mb or 0,
        warm_up=self.warm_up,
      )
      argv = [
        sys.executable,
        "-c",
        BOOT,
        json.dumps([str(p) for p in sys.path]),
        json.dumps(settings),
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
    """Stops the workers; idempotent. ``run`` after ``close`` raises."""
    _stop(self._workers, graceful=True)
    self._finalizer.detach()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def run(self, calls: Sequence[Sequence]) -> Calls:
    """Each call's status and value (``calls``: argument tuples); never longer than the batch
    deadline."""
    if not self._finalizer.alive:
      raise RuntimeError(f"{type(self).__name__} used after close()")
    try:
      batch = _Batch(self, [tuple(c) for c in calls], self._batch_limit_s(len(calls)))
      while batch.unfinished():
        batch.dispatch()
        for w in batch.wait():
          batch.receive(w)
        batch.expire()
      return batch.result()
    finally:
      # Only an exception (Ctrl-C included) leaves calls running: their workers must not
      # deliver stale results into the next batch.
      for w in list(self._workers):
        if w.task is not None:
          self._replace(w)

  def _batch_limit_s(self, n: int) -> float:
    """The batch deadline, counted from the first ready worker: the set one, or the default."""
    if self.batch_time_limit_s is not None:
      return self.batch_time_limit_s
    return (
      self.time_limit_s
      + self.kill_grace_s
      + self.per_call_budget_s * math.ceil(n / self.num_workers)
    )


class _Batch:
  """One ``run``'s bookkeeping: the calls not yet sent, statuses, values and messages, the batch
  deadline; it drives the pool's workers (``pool._workers``, ``_replace``)."""

  def __init__(self, pool: WorkerPool, calls: list[tuple], limit_s: float):
    self.pool = pool
    self.calls = calls
    self.status = ["skipped"] * len(calls)
    self.values: list = [None] * len(calls)
    self.pending = collections.deque(range(len(calls)))
    self.errors: dict[int, str] = {}  # call index -> message
    self.limit_s = limit_s
    # Set when a worker is ready: start-up does not eat into the batch.
    self.deadline: float | None = None
    self.started = time.monotonic()

  def _busy(self) -> list[_Worker]:
    return [w for w in self.pool._workers if w.task is not None]

  def unfinished(self) -> bool:
    """True while a call waits to be sent or is running."""
    return bool(self.pending) or bool(self._busy())

  def dispatch(self) -> None:
    """Starts the batch deadline once a worker is ready; sends the next calls to idle workers."""
    now = time.monotonic()
    if self.deadline is None and any(w.ready for w in self.pool._workers):
      self.deadline = now + self.limit_s
    for w in list(self.pool._workers):
      if w.ready and w.task is None and self.pending:
        i = self.pending[0]
        # Busy before the send: an interrupt (Ctrl-C) between the two would otherwise leave a
        # worker that holds a call marked idle, and its late result would reach the next batch.
        w.task, w.deadline = i, now + self.pool.time_limit_s + self.pool.kill_grace_s
        try:
          w.conn.send((i, self.calls[i]))
        except OSError:  # died while idle: replace it, the call waits for the next worker
          w.task, w.deadline = None, math.inf
          self.pool._replace(w)
          continue
        self.pending.popleft()

  def wait(self) -> list[_Worker]:
    """The workers with a message, waited for until the next deadline at most: a running
    call's hard deadline, the batch deadline, or (no worker ready yet) the start-up limit."""
    workers = self.pool._workers
    first = self.deadline if self.deadline is not None else self.started + STARTUP_TIMEOUT_S
    wake = min([w.deadline for w in self._busy()] + [first])
    conns = multiprocessing.connection.wait(
      [w.conn for w in workers], max(0.0, wake - time.monotonic())
    )
    return [next(w for w in workers if w.conn is conn) for conn in conns]

  def receive(self, w: _Worker) -> None:
    """Handles one message of ``w`` (ready, failed to load, a call's result) or its death."""
    try:
      msg = w.conn.recv()
    except (EOFError, OSError):
      self._died(w)
      return
    if msg[0] == "ready":
      w.ready = True
      self.pool.start_failures = 0
    elif msg[0] == "failed":
      raise self.pool.spec_error(msg[1])
    else:
      self._record(w, *msg)

  def _died(self, w: _Worker) -> None:
    """A worker's socket closed: replaced; its call (if it had one) is an error. One that dies
    while starting is retried, up to ``_START_RETRIES`` times in a row across the pool."""
    code = w.proc.wait(timeout=5.0)
    pool = self.pool
    if not w.ready:
      pool.start_failures += 1
      if pool.start_failures > _START_RETRIES:
        raise RuntimeError(
          f"{pool.kind} workers died while starting {pool.start_failures} times in a row "
          f"(last exit code {code}; memory limit {pool.memory_limit_mb} MiB): their stderr "
          "says why"
        ) from None
      log.warning(
        "a %s worker died while starting (exit code %s): starting another (%d/%d)",
        pool.kind,
        code,
        pool.start_failures,
        _START_RETRIES,
      )
      pool._replace(w)
      return
    if w.task is not None:
      self.status[w.task] = "error"
      self.errors[w.task] = f"worker died (exit code {code})"
    pool._replace(w)

  def _record(self, w: _Worker, i: int, status: str, value: object) -> None:
    """Call ``i`` finished in ``w``: its value, or a timeout or an error."""
    assert i == w.task, (i, w.task)
    w.task, w.deadline = None, math.inf
    self.status[i] = status
    if status == "ok":
      self.values[i] = value
    elif status == "error":
      self.errors[i] = str(value)

  def expire(self) -> None:
    """Kills and replaces workers past their hard deadline; past the batch deadline, every busy
    worker, and the calls never sent are skipped. Raises if no worker started in time."""
    now = time.monotonic()
    for w in list(self.pool._workers):
      if w.task is not None and now >= w.deadline:
        self.status[w.task] = "timeout"
        self.pool._replace(w)
    if self.deadline is None and now - self.started > STARTUP_TIMEOUT_S:
      raise RuntimeError(f"no {self.pool.kind} worker started within {STARTUP_TIMEOUT_S:.0f} s")
    if self.deadline is not None and now >= self.deadline:
      for w in self._busy():
        self.status[w.task] = "timeout"
        self.pool._replace(w)
      self.pending.clear()  # their status stays "skipped"

  def result(self) -> Calls:
    return Calls(tuple(self.status), tuple(self.values), dict(self.errors))
