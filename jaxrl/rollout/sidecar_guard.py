"""Runs under the sidecar's own Python (stdlib only): starts the vLLM server as its child and makes
sure the server's whole process group goes away with it.

  python sidecar_guard.py TRAINER_PID CLEANUP_DIR RUNTIME_DIR SERVER_ARGV...

The guard leads its own process group (the launcher starts it in a new session). It stops the
server when the trainer asks (SIGTERM from ``Sidecar.stop``) and when the trainer *process* dies,
however it dies: a watcher thread sees the guard re-parented away from TRAINER_PID (polled; not
``PR_SET_PDEATHSIG``, which fires when the *thread* that started the guard exits, so a sidecar
launched from a short-lived thread would be killed at once). A dead trainer cannot remove its tmpfs
weight directories: the guard removes CLEANUP_DIR then ("" = nothing to remove). RUNTIME_DIR (the
server's socket directory, "" = none) is removed whenever the guard exits after its server: nothing
in it outlives the server.

Stopping: SIGTERM (and SIGCONT, for a stopped server) to the server, which shuts down in well under
a second; once it has exited, SIGKILL to the rest of the group (vLLM's engine-core and worker
processes would otherwise outlive a killed API server) except multiprocessing's resource trackers,
which exit by themselves after unlinking vLLM's shared memory. After a grace period, SIGKILL to
every process of the group but the guard, which then cleans up and exits. When the server exits by
itself (a crash), the same, and the guard exits with the server's code.
"""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

_GRACE_SECONDS = 10.0  # for the server to exit after SIGTERM
_TRACKER_SECONDS = 5.0  # for resource trackers to clean up after the server
_POLL_SECONDS = 0.25


def _rest_of_group() -> list[tuple[int, bytes]]:
  """(pid, command line) of every other live process of this group."""
  me, group, out = os.getpid(), os.getpgrp(), []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[-1].split()
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if int(pid) != me and int(fields[2]) == group and fields[0] != "Z":
      out.append((int(pid), cmdline))
  return out


def _kill_rest_of_group() -> None:
  """SIGKILL every other process of this group, at once."""
  for pid, _ in _rest_of_group():
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _end_rest_of_group() -> None:
  """SIGKILL what is left of the group once the server has exited, but let multiprocessing's
  resource trackers finish first: they unlink vLLM's shared-memory segments in /dev/shm when the
  processes that registered them are gone (SIGKILLed with them, the segments would stay)."""
  deadline = time.time() + _TRACKER_SECONDS
  while rest := _rest_of_group():
    late = time.time() > deadline
    for pid, cmdline in rest:
      if late or b"multiprocessing.resource_tracker" not in cmdline:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    time.sleep(0.05)


def _pin_cpus() -> None:
  """Pin the guard, and so the server it starts, to the cores in $JAXRL_SIDECAR_CPUS ("0,2-3")."""
  spec = os.environ.get("JAXRL_SIDECAR_CPUS", "")
  cpus = set()
  for part in filter(None, spec.split(",")):
    lo, _, hi = part.partition("-")
    cpus.update(range(int(lo), int(hi or lo) + 1))
  if cpus:
    os.sched_setaffinity(0, cpus)


def main() -> int:
  trainer_pid, cleanup_dir, runtime_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  argv = sys.argv[4:]
  _pin_cpus()
  stopping = threading.Event()
  server: list[subprocess.Popen] = []  # set once started; the handlers may run before that

  def stop(orphaned: bool) -> None:
    """Ask the server to exit; SIGKILL the whole group if it has not after the grace period.

    Never waits on the server itself: it runs in the main thread's signal handler, between the
    main thread's polls of the server.
    """
    if stopping.is_set():
      return
    stopping.set()
    if orphaned and cleanup_dir:
      shutil.rmtree(cleanup_dir, ignore_errors=True)
    for sig in (signal.SIGTERM, signal.SIGCONT):
      try:
        if server:
          server[0].send_signal(sig)
      except ProcessLookupError:
        pass
    killer = threading.Timer(_GRACE_SECONDS, _kill_rest_of_group)
    killer.daemon = True
    killer.start()

  def watch_trainer() -> None:
    while os.getppid() == trainer_pid:
      time.sleep(_POLL_SECONDS)
    stop(orphaned=True)

  signal.signal(signal.SIGTERM, lambda signum, frame: stop(orphaned=False))
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's Ctrl-C is the trainer's to handle
  threading.Thread(target=watch_trainer, daemon=True).start()
  if stopping.is_set():
    if runtime_dir:
      shutil.rmtree(runtime_dir, ignore_errors=True)
    return 1
  server.append(subprocess.Popen(argv))
  if stopping.is_set():  # stopped while the server was being spawned
    server[0].send_signal(signal.SIGTERM)
  # Polled, not one blocking wait: the kernel may hand SIGTERM to the watcher thread (after a
  # SIGSTOP/SIGCONT, to whichever thread wakes first), and Python runs the handler only when the
  # main thread next executes bytecode. Blocked in waitpid, it would never see the signal, and the
  # server it should stop could wait forever on a request of the trainer's.
  while (code := server[0].poll()) is None:
    time.sleep(_POLL_SECONDS)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  _end_rest_of_group()
  if runtime_dir:
    shutil.rmtree(runtime_dir, ignore_errors=True)
  return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
  sys.exit(main())
