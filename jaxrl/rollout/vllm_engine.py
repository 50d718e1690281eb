"""``VllmEngine``: the rollout protocol served by vLLM sidecars (launched here, or attached by URL).

``set_weights(params, version)`` exports the params as an HF-layout directory (tmpfs when it has
room) and loads it into every server; ``generate`` sends one request per question with ``n = G_i``
and returns the same ``SampleOutput`` layout as the JAX sampler. The server returns sampled-token
log-probs at τ but no entropies (``provides_entropy = False``): the trainer scores the rollouts
under the sampling params, which gives both.

Faults: a server that dies or hangs mid-rollout (connection refused or reset, timeout) is restarted
from the current weights directory (launch mode), and the whole rollout is retried; after
``max_restarts`` consecutive failures, ``SidecarError``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from jaxrl import hf
from jaxrl.rollout.sampler import SampleOutput
from jaxrl.rollout.sidecar import LaunchConfig, Sidecar, SidecarError
from jaxrl.rollout.vllm_client import ServerError, VllmClient

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  launch: LaunchConfig | None        # None: attach to ``urls``
  urls: tuple[str, ...] = ()
  request_timeout: float = 120.0
  retries: int = 2
  max_restarts: int = 2
  weights_root: str = ""             # "" = /dev/shm when it has room, else the run's workdir
  sync_every: int = 1                # push every k-th new version (EEPO's θ' always)


def _weights_root(configured: str, fallback: str, need_bytes: int) -> str:
  if configured:
    return configured
  shm = "/dev/shm"
  if os.path.isdir(shm) and shutil.disk_usage(shm).free > 3 * need_bytes:
    return tempfile.mkdtemp(prefix="jaxrl-weights-", dir=shm)
  return fallback


class VllmEngine:
  provides_entropy = False

  def __init__(self, model_cfg, tokenizer, cfg: EngineConfig, *, workdir: str, max_new_tokens: int,
               eos_id: int, pad_id: int, top_p: float = 1.0):
    self.model_cfg, self.tokenizer, self.cfg = model_cfg, tokenizer, cfg
    self.workdir = workdir
    self.max_new_tokens = max_new_tokens  # set by the loop when a phase changes it
    self._eos, self._pad, self._top_p = eos_id, pad_id, top_p
    self.sidecar = Sidecar(cfg.launch) if cfg.launch is not None else None
    self.client = VllmClient(list(cfg.urls), timeout=cfg.request_timeout,
                             retries=cfg.retries) if cfg.urls else None
    self.version: str | None = None       # the version the servers hold
    self._dir: str | None = None          # ... and the directory it was loaded from
    self._root: str | None = None
    self._pushes = 0
    self.push_seconds: list[float] = []

  # -- weights -------------------------------------------------------------------------------------

  def set_weights(self, params, version) -> None:
    """Load ``params`` as ``version`` into every server (a no-op if it holds that version)."""
    version = str(version)
    if version == self.version:
      return
    if (self.version is not None and self.cfg.sync_every > 1 and version.lstrip("-").isdigit()
        and int(version) % self.cfg.sync_every):
      return  # between syncs the servers keep sampling from the last pushed version
    t0 = time.time()
    if self._root is None:
      size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
      self._root = _weights_root(self.cfg.weights_root, os.path.join(self.workdir, "sidecar"), size)
    self._pushes += 1
    new_dir = os.path.join(self._root, f"v{self._pushes:06d}")
    hf.save_hf_checkpoint(self.model_cfg, params, new_dir, tokenizer=self.tokenizer, untie=True)
    if self.sidecar is not None and not self.sidecar.alive():
      self._start(new_dir)
    else:
      self.client.load_weights(os.path.abspath(new_dir), version)
    old, self._dir, self.version = self._dir, new_dir, version
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    self.push_seconds.append(time.time() - t0)
    log.debug("weights %s pushed in %.2f s", version, self.push_seconds[-1])

  def _start(self, model_dir: str) -> None:
    """(Re)start the launched server on ``model_dir`` and point the client at it."""
    self.sidecar.restart(os.path.abspath(model_dir))
    if self.client is not None:
      self.client.close()
    self.client = VllmClient([self.sidecar.url], timeout=self.cfg.request_timeout,
                             retries=self.cfg.retries)

  # -- rollouts ------------------------------------------------------------------------------------

  def generate(self, prompt_ids_BxP, prompt_mask_BxP, counts_B, temperature, key, *,
               greedy: bool = False) -> SampleOutput:
    ids_BxP, mask_BxP = np.asarray(prompt_ids_BxP), np.asarray(prompt_mask_BxP, bool)
    counts_B = np.asarray(counts_B, np.int64)
    prompts = [row[m].tolist() for row, m in zip(ids_BxP, mask_BxP)]
    # One seed per call from the step's key: a resumed run sends the same requests.
    seed = int(jax.random.randint(key, (), 0, 2**30))
    tau = 0.0 if greedy else float(temperature)
    for attempt in range(self.cfg.max_restarts + 1):
      try:
        done = self.client.complete(prompts, counts_B.tolist(), temperature=tau,
                                    max_tokens=self.max_new_tokens, stop_token_ids=[self._eos],
                                    seed=seed, top_p=1.0 if greedy else self._top_p)
        break
      except ServerError as e:
        if self.sidecar is None or attempt == self.cfg.max_restarts:
          raise SidecarError(f"rollout failed after {attempt} sidecar restart(s): {e}") from None
        log.warning("sidecar failed mid-rollout (%s): restarting from %s (%d/%d)", e, self._dir,
                    attempt + 1, self.cfg.max_restarts)
        self._start(self._dir)
        self.client.load_weights(os.path.abspath(self._dir), self.version)  # re-sync the version
    return self._assemble(ids_BxP, mask_BxP, counts_B, done)

  def _assemble(self, ids_BxP, mask_BxP, counts_B, done) -> SampleOutput:
    """Rows grouped in question order, responses right-padded with pad_id to max_new_tokens."""
    n = self.max_new_tokens
    group_ids_R = np.repeat(np.arange(len(counts_B), dtype=np.int32), counts_B)
    flat = [c for per_question in done for c in per_question]
    r = len(flat)
    tokens_RxN = np.full((r, n), self._pad, np.int32)
    logp_RxN = np.zeros((r, n), np.float32)
    lengths_R = np.zeros((r,), np.int32)
    finished_R = np.zeros((r,), bool)
    for i, c in enumerate(flat):
      length = min(len(c.token_ids), n)
      tokens_RxN[i, :length] = c.token_ids[:length]
      logp_RxN[i, :length] = c.logprobs[:length]
      lengths_R[i] = length
      finished_R[i] = length > 0 and c.token_ids[length - 1] == self._eos
    mask_RxN = np.arange(n)[None, :] < lengths_R[:, None]
    return SampleOutput(prompt_ids_RxP=ids_BxP[group_ids_R], prompt_mask_RxP=mask_BxP[group_ids_R],
                        tokens_RxN=tokens_RxN, mask_RxN=mask_RxN, logp_RxN=logp_RxN,
                        entropy_RxN=np.zeros((r, n), np.float32), lengths_R=lengths_R,
                        group_ids_R=group_ids_R, finished_R=finished_R)

  def close(self) -> None:
    if self.client is not None:
      self.client.close()
    if self.sidecar is not None:
      self.sidecar.stop()
    if self._root and os.path.basename(self._root).startswith("jaxrl-weights-"):
      shutil.rmtree(self._root, ignore_errors=True)
