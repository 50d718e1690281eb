"""``tiny:tools`` trains end to end with the JAX engine's multi-turn rollouts: the run finishes,
its rows count turns and tool calls, samples.jsonl shows who wrote each part, the update compiles
once, and a resume continues bit for bit. ``jaxrl-eval`` of its checkpoint evaluates as the
trainer does, and writes nothing in the run directory."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from run_helpers import ROOT, TIMING, jaxrl_eval, read_metrics, snapshot, tiny_config

from jaxrl.config import ConfigError
from jaxrl.nn import model
from jaxrl.nn.arch import model_config
from jaxrl.rollout.build import build_engine
from jaxrl.rollout.vllm_engine import VllmEngine
from jaxrl.run.components import engine_sections, task_sections
from jaxrl.run.train import Trainer
from jaxrl.tasks.task import load_task

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


def test_multi_turn_runs_on_either_engine(tmp_path):
  """``task.environment`` with ``rollout.engine=vllm``: the config is accepted and the engine built
  (its server starts at the first weight push) ends a turn at ``</calc>``, with the JAX
  sampler's turn limits."""
  cfg = tiny_config(
    "tools,test", **{"rollout.engine": "vllm", "model.hidden_size": 64, "model.head_dim": 32}
  )
  assert cfg.task.environment == "calculator"
  task = load_task(task_sections(cfg), str(tmp_path / "tokenizer"))
  try:
    mcfg = model_config(cfg.model, task.vocab_size)
    graphdef, _ = model.abstract(mcfg)
    kw = dict(tokenizer=task.tokenizer, eos_id=task.eos_id, pad_id=task.pad_id)
    kw.update(prompt_len=task.train_prompt_ids.shape[1], environment=task.environment)
    engine = build_engine(graphdef, mcfg, **engine_sections(cfg), workdir=str(tmp_path), **kw)
    jax_cfg = tiny_config("tools,test", **{"model.hidden_size": 64, "model.head_dim": 32})
    jax_engine = build_engine(
      graphdef, mcfg, **engine_sections(jax_cfg), workdir=str(tmp_path), **kw
    )
    try:
      assert isinstance(engine, VllmEngine) and engine.sidecar is not None
      assert engine._turns.turns == jax_engine._turns
      assert engine._turns.turns.stop_ids == tuple(task.environment.stop_sequences[0])
      assert engine._turns.stop_strings == ()  # </calc> is one token: a stop token id
    finally:
      engine.close()
  finally:
    task.close()


def test_multi_turn_limits_are_checked_on_either_engine():
  for engine in ("jax", "vllm"):
    with pytest.raises(ConfigError, match="rollout.max_turns"):
      tiny_config("tools,test", **{"rollout.engine": engine, "rollout.max_turns": 1})


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
  out = jaxrl_eval(
    f"--config={run}/config.json",
    f"--checkpoint={run}",
    f"--out={tmp_path / 'eval'}",
    # without the session's shared cache: the run's own compile_cache is read, never written
    env={
      **{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
      "PYTHONPATH": ROOT,
      "JAX_PLATFORMS": "cpu",
    },
  )
  assert snapshot(run) == before  # a reader: nothing created, changed or removed
  assert os.listdir(tmp_path / "eval" / "compile_cache")  # its programs, beside its results
  with open(tmp_path / "eval" / "eval_results.json") as f:
    results = json.load(f)
  assert results["checkpoint"] == os.path.join(run, "checkpoints", str(STEPS))
  heldout = results["benchmarks"]["heldout"]
  for key in ("pass_at", "greedy", "turns", "num_questions", "questions"):
    assert heldout[key] == trained[key], key
  assert heldout["avg@2"] == trained["pass_at"]["1"]["all"]
  questions = sum(trained["num_questions"][str(level)] for level in trained["levels"])
  assert f"| heldout | {questions} |" in out.stdout and "| turns | tool calls |" in out.stdout


# Every method and rollout option a single-turn run has, with multi-turn rollouts: E3 and DynaMO
# allocation, E3's temperature, EEPO's two stages, the adaptive clip (tiny:all), DAPO's dynamic
# sampling, rollouts one step ahead; and LoRA adapters.
COMPOSED = {
  "all-dynamic-k1": (
    "all,tools,test",
    {"rollout.dynamic_sampling": True, "rollout.max_staleness": 1},
  ),
  "lora": ("tools,test", {"model.lora.rank": 4, "loss.kl_coef": 0.05}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSED))
def test_methods_and_options_compose_with_multi_turn_rollouts(tmp_path, name):
  variant, overrides = COMPOSED[name]
  cfg = tiny_config(variant, steps=4, **overrides)
  Trainer.open(cfg, str(tmp_path)).run()
  rows = _raw_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for row in rows:
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]), row
    assert row["turns_mean"] >= 1
    assert row["compiles_update"] == 1
    for key in COUNTERS:  # the sampler's programs compile once, whatever the methods change
      assert row[key] == rows[0][key], key
  assert any(r["tool_calls_mean"] > 0 for r in rows)
  if name == "all-dynamic-k1":
    assert all(r["eepo_gate"] == 1.0 and np.isfinite(r["entropy_stage1"]) for r in rows)
    assert max(r["alloc_std"] for r in rows) > 0 or len({r["tau"] for r in rows}) > 1
    assert any(r["rollout_staleness"] > 0 for r in rows)
