"""The math task end to end through ``configs/qwen7b.py``'s code path, on a tiny checkpoint.

A tiny Qwen2 checkpoint (2+ safetensors shards, BPE tokenizer with a chat template, two stop ids)
and tiny math jsonl files stand in for R1-Distill-Qwen-7B and the E3 data; ``configs/qwen7b.py:test``
changes only sizes and the engine (JAX), so the run takes the 7B config's path: checkpoint load with
scanned, rematerialised layers, chat-template prompts, E3 allocation and temperature, math-verify
rewards in the worker pool, periodic validation, checkpoints; then ``python -m jaxrl.eval`` on the
run's checkpoint and on the HF directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import math_fixtures
import numpy as np
import pytest
from run_helpers import ROOT, jaxrl_eval, read_metrics

pytestmark = pytest.mark.slow


def _env():
  return dict(
    os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", JAX_PLATFORMS="cpu"
  )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  base = tmp_path_factory.mktemp("math")
  ckpt = math_fixtures.make_checkpoint(base / "ckpt")
  train, val = math_fixtures.make_math_data(base / "data")
  return ckpt, train, val, base


def _flags(ckpt, train, val):
  return [
    f"--config.model.checkpoint={ckpt}",
    f"--config.data.train={train}",
    f"--config.data.heldout={val}",
  ]


def test_qwen7b_config_trains_two_steps_on_a_tiny_checkpoint(tiny):
  ckpt, train, val, base = tiny
  work = base / "run"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxrl.main",
      "--config=configs/qwen7b.py:test",
      f"--workdir={work}",
      *_flags(ckpt, train, val),
    ],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  rows = read_metrics(str(work))
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert np.isfinite(r["loss"]) and r["verify_timeouts"] == 0 and r["verify_errors"] == 0
  raw = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
  assert [r["compiles_update"] for r in raw] == [1, 1]  # compiled once
  assert "val/pass@1" in rows[0]  # eval.every = 1: validated after step 1
  assert rows[1]["alloc_min"] >= 2  # E3 bounds of the test variant
  cfg = json.loads((work / "config.json").read_text())
  assert cfg["model"]["scan_layers"] and cfg["model"]["remat"] == "full"
  assert cfg["allocation"]["method"] == "e3" and cfg["temperature"]["method"] == "e3"
  assert (work / "checkpoints" / "2").is_dir()
  assert (work / "eval_step2.json").exists() and (work / "eval_sft.json").exists()
  # The trained policy exported in HF layout loads back (with the checkpoint's stop ids).
  from jaxrl.nn import hf_load

  _, _, exported = hf_load.load_hf_checkpoint(work / "hf")
  assert json.loads((work / "hf" / "generation_config.json").read_text())["eos_token_id"]
  assert (work / "hf" / "tokenizer.json").exists() and len(jax.tree.leaves(exported)) > 0

  # The evaluation CLI on the run's last checkpoint and on the HF directory.
  for checkpoint, out_dir in ((work, base / "eval_run"), (ckpt, base / "eval_hf")):
    jaxrl_eval(
      "--config=configs/qwen7b.py:test",
      f"--checkpoint={checkpoint}",
      f"--benchmarks=val={val},train={train}",
      f"--out={out_dir}",
      "--num_samples=2",
      "--ks=1,2",
      *_flags(ckpt, train, val),
      env=_env(),
    )
    results = json.loads((out_dir / "eval_results.json").read_text())
    assert set(results["benchmarks"]) == {"val", "train"}
    val_result = results["benchmarks"]["val"]
    assert sum(val_result["num_questions"].values()) == 6
    assert 0.0 <= val_result["avg@2"] <= val_result["pass_at"]["2"]["all"] <= 1.0
    assert "| val | 6 |" in (out_dir / "eval_results.md").read_text()


def test_missing_checkpoint_says_what_to_download(tiny, tmp_path):
  _, train, val, _ = tiny
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxrl.main",
      "--config=configs/qwen7b.py",
      f"--workdir={tmp_path}",
      "--config.model.checkpoint=/nowhere/R1",
      f"--config.data.train={train}",
    ],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 2
  last = out.stderr.strip().splitlines()[-1]
  assert "model.checkpoint" in last and "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B" in last
  assert "Traceback" not in out.stderr
