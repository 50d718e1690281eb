"""``Trainer.open``: a setup that fails stops what it started and leaves config.json as it was; the
held-out evaluation's cache is keyed by everything its result depends on."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading

import jax
import math_fixtures
import pytest
from run_helpers import ROOT, tiny_config

from jaxrl.config import ConfigError, from_configdict
from jaxrl.rollout.engine import JaxEngine
from jaxrl.run import cli, train
from jaxrl.run.train import Trainer

WAIT_S = 30.0  # the bound on waiting for a worker process or thread to end (not a delay)


@pytest.fixture(scope="module")
def math_files(tmp_path_factory):
  base = tmp_path_factory.mktemp("math")
  train_path, val_path = math_fixtures.make_math_data(base / "data")
  return math_fixtures.make_checkpoint(base / "ckpt"), train_path, val_path


def _math_config(files, **overrides):
  """``configs/qwen7b.py:test`` on the tiny checkpoint: its verifier in 2 worker processes."""
  ckpt, train_path, val_path = files
  cd = cli.load_config(f"{os.path.join(ROOT, 'configs', 'qwen7b.py')}:test")
  cd.update_from_flattened_dict(
    {
      "model.checkpoint": str(ckpt),
      "data.train": str(train_path),
      "data.heldout": str(val_path),
      "reward.fn": "reward_fns:exact",  # tests/reward_fns.py: workers start fast
      "reward.workers": 2,
      **overrides,
    }
  )
  return from_configdict(cd)


def _ended(proc: subprocess.Popen) -> bool:
  try:
    proc.wait(timeout=WAIT_S)
  except subprocess.TimeoutExpired:
    return False
  return True


def _open_failing(cfg, workdir, monkeypatch):
  """``Trainer.open`` that raises; (the error, the verifier's worker processes it had started,
  the engines it had built, the threads it left running)."""
  workers, engines = [], []
  load_task, task_engine = train.load_task, train.task_engine

  def loaded(*args, **kwargs):
    task = load_task(*args, **kwargs)
    workers.extend(w.proc for w in task.scorer.pool._workers)
    return task

  def built(*args, **kwargs):
    engine = task_engine(*args, **kwargs)
    close = engine.close
    engine.close = lambda: (engines.append(engine), close())[1]
    return engine

  monkeypatch.setattr(train, "load_task", loaded)
  monkeypatch.setattr(train, "task_engine", built)
  before = set(threading.enumerate())
  with pytest.raises(Exception) as failed:
    Trainer.open(cfg, str(workdir))
  left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
  for t in left:
    t.join(WAIT_S)
  return failed.value, workers, engines, [t for t in left if t.is_alive()]


PREVIOUS = '{"seed": 0}'  # config.json of the workdir's last start (its content is not read here)


def test_a_failing_engine_build_stops_the_verifier_and_writes_no_config(
  math_files, tmp_path, monkeypatch
):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(PREVIOUS)
  # vLLM's NCCL weight transfer is refused while the engine is built, after the task's verifier
  # workers have started.
  cfg = _math_config(math_files, **{"rollout.engine": "vllm", "vllm.weight_transfer": "nccl"})
  error, workers, _, threads = _open_failing(cfg, workdir, monkeypatch)
  assert isinstance(error, ConfigError) and error.field == "vllm.weight_transfer", error
  assert len(workers) == 2 and all(_ended(p) for p in workers)
  assert not threads, threads
  assert (workdir / "config.json").read_text() == PREVIOUS  # not this failed start's config


def test_a_failure_after_the_engine_is_built_closes_it_too(math_files, tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  (workdir / "config.json").mkdir(parents=True)  # config.json cannot be written: the last step
  error, workers, engines, threads = _open_failing(_math_config(math_files), workdir, monkeypatch)
  assert isinstance(error, IsADirectoryError), error
  assert len(engines) == 1 and isinstance(engines[0], JaxEngine)  # closed
  assert len(workers) == 2 and all(_ended(p) for p in workers)
  assert not threads, threads
  assert not os.path.exists(workdir / "config.json.tmp")


def test_open_builds_and_close_is_idempotent(tmp_path):
  cfg = tiny_config(**{"sft.steps": 0})
  with Trainer.open(cfg, str(tmp_path)) as trainer:
    with open(tmp_path / "config.json") as f:
      assert json.load(f)["seed"] == cfg.seed
  trainer.close()  # again: nothing left to stop, no error


class _Generations:
  """Counts the rollout engine's calls: an evaluation computed, not read from its cache."""

  def __init__(self, monkeypatch):
    self.calls = 0
    generate = JaxEngine.generate

    def counted(engine, *args, **kwargs):
      self.calls += 1
      return generate(engine, *args, **kwargs)

    monkeypatch.setattr(JaxEngine, "generate", counted)

  def taken(self) -> int:
    calls, self.calls = self.calls, 0
    return calls


def test_an_evaluation_is_recomputed_when_its_config_or_params_change(
  tmp_path, monkeypatch, caplog
):
  generations = _Generations(monkeypatch)
  base = {"sft.steps": 0}  # eval: 2 samples at τ 1.0, k 1 and 2, responses of 4 tokens

  def evaluate(params=None, **overrides):
    caplog.clear()
    with Trainer.open(tiny_config(**{**base, **overrides}), str(tmp_path)) as trainer:
      if params is None:
        params = trainer.init_params()
      with caplog.at_level(logging.WARNING):
        result = trainer.evaluate(params, "sft", step=0)
    return params, result, generations.taken(), caplog.text

  params, first, calls, _ = evaluate()
  assert calls > 0
  _, again, calls, text = evaluate()  # the same config and params: the cache
  assert calls == 0 and again == first and "evaluating again" not in text
  for change, why in [
    ({"eval.temperature": 0.5}, "eval.temperature 1.0 → 0.5"),
    ({"eval.num_samples": 4}, "eval.num_samples 2 → 4"),
    ({"rollout.max_new_tokens": 6}, "rollout.max_new_tokens 4 → 6"),
    ({"seed": 1}, "seed 0 → 1"),
  ]:
    _, _, calls, text = evaluate(params, **change)
    assert calls > 0 and why in text, (change, text)
  # The same name and config, other params (e.g. steps trained again differently): evaluated.
  _, _, calls, text = evaluate(params)
  assert calls > 0  # recomputed for the base config after the last change
  moved = jax.tree.map(lambda x: x * 1.5, params)
  _, _, calls, text = evaluate(moved)
  assert calls > 0 and "params fingerprint" in text, text
  _, _, calls, _ = evaluate(moved)
  assert calls == 0
