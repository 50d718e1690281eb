"""Multi-process runs on JAX's own multi-controller SPMD (``jax.distributed``).

Every process runs the same program on the global mesh; the jitted steps see global arrays. What the
host reads (rollouts to decode and score, metrics) is gathered to every process, so rewards,
statistics and controller decisions are computed identically everywhere; files are written by
process 0 only (orbax checkpoints are written by all processes together).

One failure ends every process: a process that fails with an error announces it in the
coordination service's key-value store (``announce_failure``) and exits; every other process
watches that store (a thread polling every ``WATCH_INTERVAL_S``), logs the cause (so process 0's
log names it, whichever process failed) and exits with code 1, even while it waits in a
collective. A process that dies without a word (SIGKILL, a crash) stops its heartbeats: the
coordination service ends the others ``heartbeat_timeout_s`` later.

Process 0 hosts the coordination service and leaves last: every process's coordination agent
aborts its process (SIGABRT, not the exit code jaxrl chose) once the service is gone, so process 0
exits only after the others have read the failure and had ``LEAVE_GRACE_S`` to exit.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

# How often each process looks for another's failure, and how long a failing process waits for
# the others to have read its cause before it exits (process 0 hosts the store: its exit ends it).
WATCH_INTERVAL_S = 0.5
ACK_TIMEOUT_S = 10.0
# What process 0 gives the others, once they have read a failure, to finish exiting: a process
# that has acknowledged runs only ``os._exit`` after it, but may wait that long for the GIL
# while its main thread is in C code. No signal of their exit reaches process 0 sooner: the
# service notices a process gone only when its heartbeats stop (HEARTBEAT_TIMEOUT_S).
LEAVE_GRACE_S = 2.0
HEARTBEAT_TIMEOUT_S = 60  # a silent death (SIGKILL) ends the other processes within this
STORE_LOST_S = 10.0  # the store unreachable this long (not one slow answer): process 0 is gone
_FAILED = "jaxrl/failed/"  # + the failing process's index: its cause
_READ = "jaxrl/read/"  # + a watching process's index: it has read a failure
_watch: threading.Event | None = None  # set to stop the watcher at a normal exit

ENV = {
  "coordinator": "JAXRL_COORDINATOR",
  "num_processes": "JAXRL_NUM_PROCESSES",
  "process_id": "JAXRL_PROCESS_ID",
}


def initialize(
  coordinator: str = "",
  num_processes: int = 0,
  process_id: int = -1,
  cpu_devices: int = 0,
  timeout_s: int = 300,
  heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
) -> None:
  """Join the run's processes. ``coordinator`` "host:port" (or $JAXRL_COORDINATOR) with the process
  count and id (or $JAXRL_NUM_PROCESSES / $JAXRL_PROCESS_ID); "auto": let JAX read the cluster
  (SLURM, TPU pods, ...); nothing: a single process. ``cpu_devices`` > 0: that many CPU devices per
  process (tests and planning)."""
  if cpu_devices:
    # The CPU backend's device count (public config, read when that backend starts): asked for by
    # tests and planning only; a GPU or TPU backend leaves it unused.
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  coordinator = coordinator or os.environ.get(ENV["coordinator"], "")
  num_processes = num_processes or int(os.environ.get(ENV["num_processes"], "0") or 0)
  if process_id < 0:
    process_id = int(os.environ.get(ENV["process_id"], "-1") or -1)
  if not coordinator:
    return
  timeouts = {"initialization_timeout": timeout_s}
  # heartbeat_timeout_seconds is in jax.distributed.initialize from jax 0.4.36 on; older ones
  # keep their own (100 s).
  if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
    timeouts["heartbeat_timeout_seconds"] = heartbeat_timeout_s
  if coordinator == "auto":
    jax.distributed.initialize(**timeouts)
  else:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(
        f"--coordinator_address={coordinator} needs --num_processes >= 1 and "
        f"0 <= --process_id < num_processes (got {num_processes}, {process_id})"
      )
    # The coordination service has no authentication: whoever reaches its port can write the
    # failure key and end every process. It listens on the address given (JAX's default is every
    # interface, [::]:PORT); a multi-host job still exposes it on that host's address, which the
    # cluster's firewall must keep to the job's hosts (docs/running.md).
    if "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters:
      timeouts["coordinator_bind_address"] = coordinator
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
      **timeouts,
    )
  log.info(
    "process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  if jax.process_count() > 1:
    _start_watch()


def _client():
  """The coordination service's client of this process (``jax.distributed``'s own; the key-value
  store has no public API), or None in a single-process run."""
  # The one private name jaxrl reads (multi-process runs only), the same in jax 0.10-0.11: a jax
  # that moves it fails here by name, not later inside the failure watch.
  try:
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client
  except (ImportError, AttributeError) as e:
    raise RuntimeError(
      f"jax {jax.__version__} has no jax._src.distributed.global_state.client, which jaxrl's "
      f"multi-process failure watch uses ({e})"
    ) from e


def _start_watch() -> None:
  """The watcher thread: another process's announced failure ends this one (see the module)."""
  global _watch
  client, me = _client(), jax.process_index()
  stop = _watch = threading.Event()

  def watch() -> None:
    unreachable_since = None
    while not stop.wait(WATCH_INTERVAL_S):
      try:
        failed = [(k, v) for k, v in client.key_value_dir_get(_FAILED) if k != f"{_FAILED}{me}"]
        unreachable_since = None
      except Exception as e:  # unreachable: a slow moment, or process 0 (its host) is gone
        if stop.is_set():
          return
        now = time.monotonic()
        unreachable_since = unreachable_since or now
        if now - unreachable_since >= STORE_LOST_S:
          _exit_now(f"lost the coordination service on process 0 ({type(e).__name__}: {e})")
          return
        continue
      if failed and not stop.is_set():
        key, cause = failed[0]
        failing = int(key[len(_FAILED) :])

        def acknowledge() -> None:
          try:
            client.key_value_set(f"{_READ}{me}", "1")
            _leave_last(client, me, readers=_others(me, failing))
          except Exception:  # the failing process exits after a bounded wait anyway
            pass

        _exit_now(f"process {failing} failed: {cause}", last=acknowledge)
        return

  thread = threading.Thread(target=watch, name="jaxrl-failure-watch", daemon=True)
  thread.start()

  def stop_watch() -> None:
    """Stopped, and ended, before jax.distributed's own exit handler (registered earlier, so run
    later) shuts the client down under it. A watch already ending the process (another's failure
    read, acknowledged) ends it with ``os._exit`` before the join returns: a shutdown beside it
    would find process 0 gone and the coordination agent would abort the process (SIGABRT)."""
    stop.set()
    thread.join(timeout=ACK_TIMEOUT_S + LEAVE_GRACE_S)

  atexit.register(stop_watch)


def _exit_now(reason: str, last=None) -> None:
  """Log why this process ends (its log file and stderr) and exit with code 1 at once; ``last``
  runs after the logs are flushed, right before the exit."""
  log.error("ending this process: %s", reason)
  print(f"jaxrl: error: {reason}", file=sys.stderr)
  _flush_and_exit(1, last)


def _flush_and_exit(code: int, last=None) -> None:
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  # The acknowledgement of another process's failure goes last: once the failing process has
  # read it, it exits, and when that is process 0 the coordination service goes with it (after
  # LEAVE_GRACE_S); an agent still running here then would abort the process on the lost
  # service (SIGABRT, not exit 1). Nothing is left to do by then.
  if last is not None:
    last()
  os._exit(code)


def watching() -> bool:
  """Whether this process is one of several, watching for the others' failures."""
  return _watch is not None


def announce_failure(cause: str, code: int) -> None:
  """This process failed with ``cause``: tell the others (each logs it and exits), wait until they
  have read it (at most ``ACK_TIMEOUT_S``), and exit with ``code``. A no-op in a single-process
  run. The exit skips jax.distributed's shutdown barrier, which would wait for the others."""
  if not watching():  # not a multi-process run (or not joined yet)
    return
  _watch.set()
  client, me = _client(), jax.process_index()
  try:
    client.key_value_set(f"{_FAILED}{me}", cause.strip().splitlines()[-1][:2000] if cause else "?")
    _read_by(client, _others(me))
  except Exception as e:  # a store already gone, a process already gone: exit
    log.warning("could not tell every process about the failure: %s", e)
  _leave_last(client, me, readers=[])
  _flush_and_exit(code)


def _others(*but: int) -> list[int]:
  return [p for p in range(jax.process_count()) if p not in but]


def _read_by(client, readers: list[int]) -> None:
  """Wait until each of ``readers`` has acknowledged the failure: one wait of at most
  ``ACK_TIMEOUT_S`` for all of them (raises when it runs out)."""
  deadline = time.monotonic() + ACK_TIMEOUT_S
  for other in readers:
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    client.blocking_key_value_get(f"{_READ}{other}", left_ms)


def _leave_last(client, me: int, readers: list[int]) -> None:
  """On process 0, the service's host: wait until ``readers`` (besides the acknowledgements the
  failing process waits for) have read the failure, then ``LEAVE_GRACE_S`` for every process to
  finish exiting before this one's exit ends the service (see the module). Elsewhere: nothing."""
  if me != 0:
    return
  try:
    _read_by(client, readers)
  finally:
    time.sleep(LEAVE_GRACE_S)


def is_main() -> bool:
  """The process that writes files (metrics, evaluations, exports)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def rendezvous(name: str, timeout_s: int = 300) -> None:
  """Wait until every process is here, through the coordination service: unlike ``barrier`` it
  compiles nothing, so it may come before a run points JAX's compile cache at its directory (a
  program compiled earlier turns the cache off for the process)."""
  if jax.process_count() > 1:
    _client().wait_at_barrier(f"jaxrl/{name}", timeout_in_ms=timeout_s * 1000)


def to_host(tree):
  """Every array of ``tree`` as a numpy array of its global value, on every process."""

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x) if isinstance(x, jax.Array) else x

  return jax.tree.map(one, tree)


def from_main(tree):
  """Process 0's value of ``tree`` (host arrays) on every process: for what a wall clock can
  make differ between them (the verifier's time limits), so every process takes the same path."""
  if jax.process_count() == 1:
    return tree
  return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def main_first(fn):
  """``fn()`` on process 0, then on the others (e.g. building a cache the others then read)."""
  if is_main():
    out = fn()
    barrier("main_first")
    return out
  barrier("main_first")
  return fn()
