"""Multi-process runs for the tests: `python -m jaxrl.main` as N ranks over jax.distributed (Gloo),
and the params of a tiny run's checkpoints as one vector."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
from run_helpers import ROOT, tiny_config

from jaxrl.nn import arch, model
from jaxrl.parallel import sharding
from jaxrl.run import weights
from jaxrl.tasks import task
from jaxrl.tasks.data import tokenizer


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_ranks(flags, workdir, steps: int, processes: int, devices: int, timeout=600) -> list[str]:
  """Run `python -m jaxrl.main` as ``processes`` ranks; every rank must exit 0. Returns stderrs."""
  port = free_port()
  procs = []
  for rank in range(processes):
    dist = (
      [
        f"--coordinator_address=127.0.0.1:{port}",
        f"--num_processes={processes}",
        f"--process_id={rank}",
      ]
      if processes > 1
      else []
    )
    procs.append(
      subprocess.Popen(
        [
          sys.executable,
          "-m",
          "jaxrl.main",
          *flags,
          f"--workdir={workdir}",
          f"--config.steps={steps}",
          f"--cpu_devices={devices}",
          *dist,
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
    )
  errs = []
  try:
    for rank, p in enumerate(procs):
      _, err = p.communicate(timeout=timeout)
      assert p.returncode == 0, f"rank {rank}: {err[-3000:]}"
      errs.append(err)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return errs


def checkpoint_params(workdir, step=None, sft=False, variant="test", **overrides) -> np.ndarray:
  """All params of checkpoint ``step`` (or the SFT warm start) of a ``configs/tiny.py:VARIANT``
  run as one flat vector (a LoRA run's: its adapters on the base it rebuilds, as ``jaxrl-export``
  loads them)."""
  cfg = tiny_config(variant, **overrides)
  model_cfg = arch.model_config(cfg.model, tokenizer.vocab_size(task.tokenizer_variant(cfg.task)))
  _, abstract = model.abstract(model_cfg)
  shardings = sharding.tree_shardings(abstract, sharding.make_mesh(1, 1, 1))
  if sft:  # the warm start, and a LoRA model's fresh adapters (of the config's seed)
    params = weights.run_base(cfg, model_cfg, str(workdir), shardings)
  else:
    path = os.path.join(workdir, "checkpoints", str(step))
    params = weights.load_params(cfg, path, (abstract, shardings), model_cfg)
  return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])


def assert_same_metrics(one: list[dict], two: list[dict], rtol: float, skip=()) -> None:
  """Two runs' metrics (``read_metrics``), step by step: every key present in both, non-floats
  (counts, allocations, the step) equal, floats within ``rtol``; the steps must update the policy.

  ``rtol`` is the caller's: how far its two runs' sums (another all-reduce order, another mesh)
  and the optimizer steps after them may move a metric. The fixed atol 1e-6 is for metrics that
  are ~0 and so have no relative scale: the on-policy loss, rounding noise of ρ − 1 times the
  advantages (measured within 3e-7 of 0 in the tiny runs here)."""
  assert any(r["loss"] != 0 for r in one)
  assert len(one) == len(two)
  for a, b in zip(one, two):
    assert a.keys() == b.keys()
    for key in a.keys() - set(skip):
      if isinstance(a[key], float):
        np.testing.assert_allclose(b[key], a[key], rtol=rtol, atol=1e-6, err_msg=key)
      else:
        assert a[key] == b[key], key
