"""One trainer per run directory: an exclusive ``flock`` on ``WORKDIR/.lock``, held while the run
lives.

Two trainers on one ``--workdir`` would clean each other's checkpoint writes and interleave their
state; the second is refused (``WorkdirBusy``, naming the holder: pid, host, start time, which
the holder writes into the file). The kernel releases a ``flock`` when its process ends, however
it ends (SIGKILL included), so a lock file left behind by a dead run is simply taken over: there
is no stale lock to clean. Readers (``jaxrl-eval``, ``jaxrl-export``) take no lock: they may run
beside a trainer. In a multi-process run process 0 holds it for the job: the processes of one job
are one trainer and share the directory (they write each checkpoint together), and a lock per
process would let through a second job's processes that the first has no counterpart of. So a
second job is refused as a whole at its process 0, which its other processes wait for before they
write anything (``run/launch.py``). ``flock`` is local to a host: on a network filesystem whose
locks do not reach other hosts, two jobs on different hosts are not kept apart.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

LOCK_FILE = ".lock"
# Locks this process holds, by path, with how many holders share each: the CLI holds its run's for
# the process's life and ``Trainer.open`` holds it again (a second flock of the same file from
# this process would be refused as another trainer's).
_HELD: dict[str, list] = {}


class WorkdirBusy(RuntimeError):
  """Another live process holds the run directory's lock."""


def _holder(fd: int) -> str:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 4096).decode(errors="replace")
  try:
    info = json.loads(text)
    return f"pid {info['pid']} on {info['host']}, started {info['started']}"
  except (ValueError, KeyError, TypeError):
    return "a process that has not written its name yet"


def hold(workdir: str) -> str:
  """Take ``workdir``'s lock (or share this process's hold of it); returns the key ``release``
  takes. ``WorkdirBusy`` when another process holds it."""
  path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
  if path in _HELD:
    _HELD[path][1] += 1
    return path
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _holder(fd)
    os.close(fd)
    raise WorkdirBusy(
      f"{workdir} is in use by another trainer ({holder}; its lock: {path}): wait for it to "
      "end, or give this run another --workdir"
    ) from None
  started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
  info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
  os.ftruncate(fd, 0)
  os.pwrite(fd, info.encode(), 0)
  _HELD[path] = [fd, 1]
  return path


def release(key: str | None) -> None:
  """Drop one hold of ``hold``'s lock (None: nothing); the last one unlocks it (the file stays: a
  later run takes it over)."""
  held = _HELD.get(key) if key is not None else None
  if held is None:
    return
  held[1] -= 1
  if held[1] == 0:
    del _HELD[key]
    fcntl.flock(held[0], fcntl.LOCK_UN)
    os.close(held[0])
