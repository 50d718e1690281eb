"""Multi-process runs on JAX's own multi-controller SPMD (``jax.distributed``).

Every process runs the same program on the global mesh; the jitted steps see global arrays. What the
host reads (rollouts to decode and score, metrics) is gathered to every process, so rewards,
statistics and controller decisions are computed identically everywhere; files are written by
process 0 only (orbax checkpoints are written by all processes together).
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

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
) -> None:
  """Join the run's processes. ``coordinator`` "host:port" (or $JAXRL_COORDINATOR) with the process
  count and id (or $JAXRL_NUM_PROCESSES / $JAXRL_PROCESS_ID); "auto": let JAX read the cluster
  (SLURM, TPU pods, ...); nothing: a single process. ``cpu_devices`` > 0: that many CPU devices per
  process (tests and planning)."""
  if cpu_devices:
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  coordinator = coordinator or os.environ.get(ENV["coordinator"], "")
  num_processes = num_processes or int(os.environ.get(ENV["num_processes"], "0") or 0)
  if process_id < 0:
    process_id = int(os.environ.get(ENV["process_id"], "-1") or -1)
  if not coordinator:
    return
  if coordinator == "auto":
    jax.distributed.initialize(initialization_timeout=timeout_s)
  else:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(
        f"--coordinator_address={coordinator} needs --num_processes >= 1 and "
        f"0 <= --process_id < num_processes (got {num_processes}, {process_id})"
      )
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=timeout_s,
    )
  log.info(
    "process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )


def is_main() -> bool:
  """The process that writes files (metrics, evaluations, exports)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def to_host(tree):
  """Every array of ``tree`` as a numpy array of its global value, on every process."""

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x) if isinstance(x, jax.Array) else x

  return jax.tree.map(one, tree)


def main_first(fn):
  """``fn()`` on process 0, then on the others (e.g. building a cache the others then read)."""
  if is_main():
    out = fn()
    barrier("main_first")
    return out
  barrier("main_first")
  return fn()
