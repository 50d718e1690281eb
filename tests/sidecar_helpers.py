"""What a sidecar server's processes expose, read from /proc: the sockets they hold and listen on,
whether a process was sent SIGKILL, and what a process of another user gets when it connects
(tests/test_sidecar_security.py against a stand-in server, tests/test_sidecar.py against vLLM)."""

from __future__ import annotations

import os
import signal
import socket
import urllib.parse
import warnings

NOBODY = 65534  # the uid ``as_nobody`` switches to


def socket_path(url: str) -> str:
  assert url.startswith("http+unix://"), url
  return urllib.parse.unquote(url[len("http+unix://") :])


def _socket_inodes(pid: int) -> set[str]:
  inodes = set()
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
      continue
    if target.startswith("socket:["):
      inodes.add(target[8:-1])
  return inodes


def tcp_sockets(pid: int) -> list[str]:
  """The TCP sockets process ``pid`` holds, in any state: their local addresses as
  /proc/net/tcp* writes them (hex)."""
  inodes, found = _socket_inodes(pid), []
  for table in ("tcp", "tcp6"):
    with open(f"/proc/net/{table}") as f:
      found += [x[1] for x in map(str.split, f.readlines()[1:]) if x[9] in inodes]
  return found


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1, ::1 (hex, as in /proc)


def listeners(pids) -> list[tuple[str, str, int]]:
  """(family, address, pid) of every listening socket of ``pids``: TCP addresses as hex
  ``ADDR:PORT`` (``LOOPBACK``), Unix sockets by path ("@..." for an abstract one)."""
  found = []
  for pid in pids:
    inodes = _socket_inodes(pid)
    for table in ("tcp", "tcp6"):
      with open(f"/proc/net/{table}") as f:
        for x in map(str.split, f.readlines()[1:]):
          if x[9] in inodes and x[3] == "0A":
            found.append((table, x[1], pid))
    with open("/proc/net/unix") as f:
      for x in map(str.split, f.readlines()[1:]):
        if x[6] in inodes and x[3] == "00010000":  # __SO_ACCEPTCON: a listening socket
          found.append(("unix", x[7] if len(x) > 7 else "(unnamed)", pid))
  return found


def as_nobody(url: str) -> str:
  """What a process of user ``nobody`` gets when it asks ``url`` to load weight version "owned":
  "EACCES" (it cannot connect), "answered <status line>", or another error's name."""
  read, write = os.pipe()
  with warnings.catch_warnings():  # JAX's: the child only makes system calls, then _exits
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
    pid = os.fork()
  if pid == 0:
    os.close(read)
    try:
      os.setgroups([])
      os.setgid(NOBODY)
      os.setuid(NOBODY)
      body = b'{"new_version": "owned"}'
      request = (
        b"POST /update_weight_version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
      )
      if url.startswith("http+unix://"):
        s = socket.socket(socket.AF_UNIX)
        target = socket_path(url)
      else:
        s = socket.socket()
        host, port = urllib.parse.urlsplit(url).netloc.rsplit(":", 1)
        target = (host, int(port))
      s.settimeout(30)
      s.connect(target)
      s.sendall(request)
      out = b"answered " + s.recv(200).split(b"\r\n")[0]
    except PermissionError:
      out = b"EACCES"
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
      out = type(e).__name__.encode()
    os.write(write, out)
    os._exit(0)
  os.close(write)
  with os.fdopen(read, "rb") as f:
    out = f.read().decode()
  os.waitpid(pid, 0)
  return out


def killed(pid: int) -> bool:
  """True if process ``pid`` is gone, a zombie, or has a SIGKILL pending for the whole process
  (``kill``, a parent-death signal): such a signal stays in the shared pending set (ShdPnd)
  until the last thread has exited, so a False here is not a race with a kill already sent."""
  try:
    with open(f"/proc/{pid}/status") as f:
      fields = dict(line.split(":", 1) for line in f if ":" in line)
  except FileNotFoundError:
    return True
  state, pending = fields["State"].split()[0], int(fields["ShdPnd"], 16)
  return state in ("Z", "X") or bool(pending & (1 << (signal.SIGKILL - 1)))
