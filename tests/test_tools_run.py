"""``tiny:tools`` trains end to end with the JAX engine's multi-turn rollouts: the run finishes,
its rows count turns and tool calls, samples.jsonl shows who wrote each part, the update compiles
once, and a resume continues bit for bit. ``jaxrl-eval`` of its checkpoint evaluates as the
trainer does, and writes nothing in the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from run_helpers import ROOT, TIMING, read_metrics, snapshot, tiny_config

from jaxrl.config import ConfigError
from jaxrl.run.train import Trainer

STEPS = 3
# Compile counters are process-wide (another test may have traced a program first).
COUNTERS = {"compiles_prefill", "compiles_turn", "compiles_observe", "compiles_assemble"}


def _config(steps: int):
  return tiny_config("tools,test", steps=steps)


def _samples(workdir) -> list[dict]:
  with open(workdir / "samples.jsonl") as f:
    return [json.loads(line) for line in f if line.strip()]


def _raw_rows(workdir) -> list[dict]:
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f if line.strip()]


def _leaves(result):
  return [np.asarray(x) for x in jax.tree.leaves(result.rl.params)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """A run of STEPS steps: its workdir (the last step's checkpoint, the trainer's evaluation at
  it) and its result."""
  workdir = tmp_path_factory.mktemp("tools") / "straight"
  return workdir, Trainer.open(_config(STEPS), str(workdir)).run()


@pytest.mark.slow
def test_the_tools_task_trains_with_multi_turn_rollouts_and_resumes_exactly(straight, tmp_path):
  workdir, straight = straight
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for row in rows:
    for key in ("loss", "reward", "entropy_rollout", "turns_mean", "tool_calls_mean"):
      assert np.isfinite(row[key]), (key, row[key])
    assert row["turns_mean"] >= 1
  raw = _raw_rows(workdir)
  for row in raw:  # the update compiled once; the sampler's programs not again after step 1
    assert row["compiles_update"] == 1
    for key in COUNTERS:
      assert row[key] == raw[0][key], key
  assert any(row["tool_calls_mean"] > 0 for row in rows)
  samples = _samples(workdir)
  assert samples and all("parts" in s for s in samples)
  env_parts = [p for s in samples for p in s["parts"] if p["by"] == "environment"]
  assert env_parts and all(p["text"].startswith("<result>") for p in env_parts)

  Trainer.open(_config(2), str(tmp_path / "resumed")).run()
  resumed = Trainer.open(_config(STEPS), str(tmp_path / "resumed")).run()
  drop = lambda r: {k: v for k, v in r.items() if k not in TIMING | COUNTERS}  # noqa: E731
  assert [drop(r) for r in read_metrics(tmp_path / "resumed")] == [drop(r) for r in rows]
  for a, b in zip(_leaves(straight), _leaves(resumed)):
    np.testing.assert_array_equal(a, b)


def test_multi_turn_needs_the_jax_engine():
  with pytest.raises(ConfigError, match="task.environment"):
    tiny_config("tools,test", **{"rollout.engine": "vllm"})


@pytest.mark.slow
def test_jaxrl_eval_of_a_tools_checkpoint_is_the_trainers_evaluation(straight, tmp_path):
  """``jaxrl-eval`` of the run's last checkpoint, in another process: the held-out split with
  multi-turn rollouts gives the trainer's own evaluation at that step (pass@k, greedy, mean turns
  and tool calls, per level), and the run directory is left as it was."""
  run, _ = straight
  with open(run / f"eval_step{STEPS}.json") as f:
    trained = json.load(f)
  assert trained["turns"]["tool_calls"]["all"] > 0
  before = snapshot(run)
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxrl.eval",
      f"--config={run}/config.json",
      f"--checkpoint={run}",
      f"--out={tmp_path / 'eval'}",
    ],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  assert snapshot(run) == before  # a reader: nothing created, changed or removed
  with open(tmp_path / "eval" / "eval_results.json") as f:
    results = json.load(f)
  assert results["checkpoint"] == os.path.join(run, "checkpoints", str(STEPS))
  heldout = results["benchmarks"]["heldout"]
  for key in ("pass_at", "greedy", "turns", "num_questions"):
    assert heldout[key] == trained[key], key
  assert heldout["avg@2"] == trained["pass_at"]["1"]["all"]
  assert "| heldout | 18 |" in out.stdout and "| turns | tool calls |" in out.stdout
