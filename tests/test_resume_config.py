"""A resume continues the run its checkpoint records, or is refused: every checkpoint records the
resolved config (Hub ids as commits); a resume that changes a field outside the safe list stops
with exit 2 naming the fields, before anything in the workdir is written. The SFT warm start and
the held-out evaluations are cached with the config they were computed from: a cache of another
config is computed again, never reused."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from run_helpers import ROOT, read_metrics, tiny_config

from jaxrl.config import ConfigError, to_dict
from jaxrl.run import cli, eval_cache, run_config
from jaxrl.run.train import Trainer
from jaxrl.workdir.checkpoint import Checkpointer

FIRST = {"steps": 2, "sft.steps": 4}  # a short run: 4 SFT steps, 2 RL steps, checkpoint at 2


def test_a_resume_with_another_config_is_refused_by_name(tmp_path):
  workdir = tmp_path / "run"
  Trainer.open(tiny_config(**FIRST), str(workdir)).run()
  with open(workdir / "config.json") as f:
    first = f.read()

  changed = {
    "seed": 1,
    "optim.learning_rate": 1e-3,
    "loss.kl_coef": 0.1,
    "rollout.max_staleness": 1,
    "task.num_train_per_level": 9,
  }
  with pytest.raises(ConfigError) as refused:
    Trainer.open(tiny_config(**FIRST, **changed), str(workdir))
  message = str(refused.value)
  for field, value in changed.items():
    assert f"{field} " in message and repr(value) in message, (field, message)
  assert refused.value.fields == sorted(changed)
  assert "steps, compile_cache, log" in message  # what a resume may change instead
  with open(workdir / "config.json") as f:
    assert f.read() == first  # nothing written

  # The command: one line, exit 2.
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxrl.main",
      "--config=configs/tiny.py:test",
      f"--workdir={workdir}",
      "--config.steps=2",
      "--config.sft.steps=4",
      "--config.optim.learning_rate=0.001",
    ],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 2, out.stderr[-3000:]
  (line,) = [x for x in out.stderr.splitlines() if x.startswith("jaxrl: error:")]
  assert "optim.learning_rate 0.0003 → 0.001" in line, line

  # What a resume may change: its length, logging, checkpoint and evaluation cadence, workers.
  safe = {
    "steps": 3,
    "log.tensorboard": False,
    "log.samples_per_step": 1,
    "checkpoint.every": 5,
    "checkpoint.keep": 3,
    "eval.every": 10,
    "reward.workers": 2,
    "compile_cache": str(tmp_path / "programs"),
  }
  Trainer.open(tiny_config(**{**FIRST, **safe}), str(workdir)).run()
  assert [r["step"] for r in read_metrics(workdir)] == [1, 2, 3]


def _lay_out(cache, kind: str, repo: str, files: dict, sha: str):
  """A snapshot of ``repo`` as huggingface_hub leaves it (``refs/main`` → ``snapshots/<sha>``);
  ``files``: path → rows written as parquet, or text."""
  root = cache / f"{kind}s--{repo.replace('/', '--')}"
  snapshot = root / "snapshots" / sha
  for name, content in files.items():
    (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, list):
      pq.write_table(pa.Table.from_pylist(content), snapshot / name)
    else:
      (snapshot / name).write_text(content)
  (root / "refs").mkdir(exist_ok=True)
  (root / "refs" / "main").write_text(sha)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
  from huggingface_hub import constants

  path = tmp_path / "hub-cache"
  path.mkdir()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  return path


def _hub_config(cache, sha: str):
  """A math config on a Hub model and a Hub dataset, both at commit ``sha`` (``refs/main``)."""
  _lay_out(cache, "model", "acme/tiny", {"config.json": "{}"}, sha)
  rows = [{"problem": "1 + 1?", "answer": "2"}]
  _lay_out(cache, "dataset", "acme/math", {"data/train-00000-of-00001.parquet": rows}, sha)
  cfg = tiny_config()
  cfg = dataclasses.replace(
    cfg,
    model=dataclasses.replace(cfg.model, checkpoint="acme/tiny"),
    task=dataclasses.replace(cfg.task, name="math"),
    data=dataclasses.replace(cfg.data, train="hf:acme/math:2"),
  )
  return cli.with_local_checkpoint(cfg)  # as jaxrl-train resolves it: the snapshot's directory


def test_hub_revisions_are_recorded_and_another_one_is_refused(tmp_path, hub_cache):
  old, new = "a" * 40, "b" * 40
  first = run_config.record(_hub_config(hub_cache, old))
  assert first["revisions"] == {"model.checkpoint": f"acme/tiny@{old}", "hf:acme/math": old}
  directory = str(tmp_path / "checkpoints")
  ckpt = Checkpointer(directory, keep=1, async_save=False, record=first)
  ckpt.save(1, {"x": jnp.zeros(2)}, {"step": 1})
  ckpt.close()
  reader = Checkpointer.reader(directory)
  assert reader.recorded_config(1) == first and reader.restore_meta(1) == {"step": 1}
  reader.close()
  assert run_config.check_resume(first, directory) == 1  # the same config resumes

  # The Hub's main branch moved on: the same ids now resolve to other commits.
  again = run_config.record(_hub_config(hub_cache, new))
  with pytest.raises(run_config.ChangedConfig) as refused:
    run_config.check_resume(again, directory)
  assert refused.value.fields == ["model.checkpoint", "revision of hf:acme/math"]
  assert f"'acme/tiny@{old}' → 'acme/tiny@{new}'" in str(refused.value)
  assert f"--config.model.checkpoint=acme/tiny@{old} resumes" in str(refused.value)
  # The same commit in another cache (another machine) is the same model.
  moved = copy.deepcopy(first)
  moved["config"]["model"]["checkpoint"] = f"/elsewhere/models--acme--tiny/snapshots/{old}"
  del moved["revisions"]["model.checkpoint"]
  assert run_config.resume_changes(first, moved) == []


def _with_reward(cfg, **fields):
  return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, **fields))


# A reward term's Hub model: (the reward fields naming it, those naming its commit C, the
# revision's key, the hint's flag)
HUB_TERMS = {
  "reward model": (
    {"terms": "verifier, model:acme/rm*0.5"},
    {"terms": "verifier, model:acme/rm@C*0.5"},
    "model:acme/rm",
    "model:acme/rm@C in reward.terms",
  ),
  "served judge": (
    {"terms": "verifier, judge:sidecar*0.5", "judge_model": "acme/rm"},
    {"terms": "verifier, judge:sidecar*0.5", "judge_model": "acme/rm@C"},
    "judge:acme/rm",
    "--config.reward.judge_model=acme/rm@C",
  ),
}


@pytest.mark.parametrize("term", HUB_TERMS)
def test_a_reward_terms_hub_commit_is_recorded_and_another_one_is_refused(
  tmp_path, hub_cache, term
):
  """A reward model's or a served judge's Hub id: its commit recorded, a resume on another
  refused with the flag that pins the recorded one, and a resume pinned to it accepted."""
  named, pinned, key, hint = HUB_TERMS[term]
  old, new = "c" * 40, "d" * 40
  cfg = _with_reward(tiny_config(), **named)
  _lay_out(hub_cache, "model", "acme/rm", {"config.json": "{}"}, old)
  first = run_config.record(cfg)
  assert first["revisions"] == {key: old}
  directory = str(tmp_path / "checkpoints")
  ckpt = Checkpointer(directory, keep=1, async_save=False, record=first)
  ckpt.save(1, {"x": jnp.zeros(2)}, {"step": 1})
  ckpt.close()
  assert run_config.check_resume(first, directory) == 1
  _lay_out(hub_cache, "model", "acme/rm", {"config.json": "{}"}, new)  # main moved on
  with pytest.raises(run_config.ChangedConfig) as refused:
    run_config.check_resume(run_config.record(cfg), directory)
  assert refused.value.fields == [f"revision of {key}"]
  assert f"{hint.replace('@C', '@' + old)} resumes on the checkpoint's commit" in str(refused.value)
  # Named at the recorded commit, the same model resumes.
  at_old = _with_reward(cfg, **{k: v.replace("@C", f"@{old}") for k, v in pinned.items()})
  assert run_config.record(at_old)["revisions"] == {key: old}
  assert run_config.check_resume(run_config.record(at_old), directory) == 1


def test_a_judge_at_a_url_names_a_served_model_not_a_hub_one(hub_cache):
  cfg = _with_reward(
    tiny_config(), terms="verifier, judge:http://127.0.0.1:8001*0.5", judge_model="acme/judge"
  )
  assert run_config.record(cfg)["revisions"] == {}  # nothing looked up: the server names it


def test_a_checkpoint_without_a_recorded_config_is_checked_against_config_json(tmp_path):
  cfg = tiny_config()
  with open(tmp_path / "config.json", "w") as f:
    json.dump(to_dict(cfg), f)
  directory = str(tmp_path / "checkpoints")
  ckpt = Checkpointer(directory, keep=1, async_save=False)  # records no config
  ckpt.save(3, {"x": jnp.zeros(2)}, {"step": 3})
  ckpt.close()
  assert run_config.check_resume(run_config.record(cfg), directory) == 3
  other = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, eps_high=0.3))
  with pytest.raises(ConfigError, match="loss.eps_high 0.28 → 0.3"):
    run_config.check_resume(run_config.record(other), directory)


def _flat(params):
  return [np.asarray(x) for x in jax.tree.leaves(params)]


def _cached_sft(workdir, caplog, **overrides):
  """(SFT params, held-out evaluation at the warm start, the log) of a run of ``overrides`` in
  ``workdir``, reusing or recomputing what the workdir caches."""
  caplog.clear()
  with Trainer.open(tiny_config(**{**FIRST, **overrides}), str(workdir)) as trainer:
    with caplog.at_level(logging.INFO):
      params = trainer.warm_start(trainer.init_params())
      result = trainer.evaluate(params, "sft", step=0)
  return params, result, caplog.text


def _mtime(path) -> int:
  return os.stat(path).st_mtime_ns


@pytest.mark.parametrize("text", ['{"config": {"steps": ', "[1, 2]"])
def test_a_damaged_evaluation_cache_is_evaluated_again(tmp_path, caplog, text):
  """A cache cut short (a kill mid-write of an older jaxrl, a full disk) or not an object: a
  cache miss saying why, not a JSONDecodeError ending the run."""
  path = tmp_path / "eval_sft.json"
  path.write_text(text)
  with caplog.at_level(logging.WARNING):
    assert eval_cache.cached_eval(str(path), {"steps": 2}) is None
  assert f"{path}: not a cached evaluation" in caplog.text and "evaluating again" in caplog.text


def test_caches_are_keyed_by_the_config_they_were_computed_from(tmp_path, caplog):
  workdir = tmp_path / "run"
  params, result, _ = _cached_sft(workdir, caplog)
  evaluated = _mtime(workdir / "eval_sft.json")

  # Another RL learning rate: neither the warm start nor its evaluation depends on it.
  again, same, text = _cached_sft(workdir, caplog, **{"optim.learning_rate": 1e-3})
  assert "SFT warm start loaded" in text and "evaluating again" not in text
  assert _mtime(workdir / "eval_sft.json") == evaluated and same == result
  for a, b in zip(_flat(params), _flat(again)):
    np.testing.assert_array_equal(a, b)

  # Another k of pass@k: the evaluation is computed again (its cache has no pass@4).
  _, wider, text = _cached_sft(workdir, caplog, **{"eval.num_samples": 4, "eval.ks": "1,4"})
  assert "evaluating again" in text and "eval.ks '1,2' → '1,4'" in text
  assert sorted(wider.pass_at) == [1, 4]

  # Another SFT learning rate: the warm start runs again, and says why.
  other, _, text = _cached_sft(workdir, caplog, **{"sft.learning_rate": 5e-3})
  assert "sft.learning_rate 0.01 → 0.005" in text and "the SFT warm start runs again" in text
  assert any(not np.array_equal(a, b) for a, b in zip(_flat(params), _flat(other)))
  assert "evaluating again" in text  # its evaluation too


def test_a_longer_resume_may_not_move_the_annealing_phase():
  """`steps` may change on resume, but not where it puts a phase boundary (the annealing phase
  starts at a fraction of the steps unless set): that would switch a run back and forth."""
  cfg = tiny_config("e3,test,anneal", steps=10)
  pinned = tiny_config("e3,test,anneal", steps=10, **{"anneal_phase.start": 6})
  saved = run_config.record(cfg)
  assert (
    run_config.resume_changes(saved, run_config.record(dataclasses.replace(cfg, steps=10))) == []
  )
  moved = run_config.resume_changes(saved, run_config.record(dataclasses.replace(cfg, steps=20)))
  assert [c[0] for c in moved] == ["phase starts (from steps and the schedules)"], moved
  longer = dataclasses.replace(pinned, steps=20)  # a set start does not move
  assert run_config.resume_changes(run_config.record(pinned), run_config.record(longer)) == []
