"""A LoRA run end to end (configs/tiny.py:test, rank 8, KL to the base): RL moves only the adapters
of the warm-started model, a checkpoint holds the adapters and their moments (not the base), a
resume onto another base is refused, and ``jaxrl-export`` of the run gives the trained model."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from run_helpers import read_metrics, tiny_config

from jaxrl.nn import hf_load, lora
from jaxrl.run import weights
from jaxrl.run.train import Trainer

LORA = {"model.lora.rank": 8, "loss.kl_coef": 0.05, "optim.learning_rate": 3e-3}


def _flat(params) -> dict:
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lora") / "run"
  cfg = tiny_config(steps=4, **LORA)
  trainer = Trainer.open(cfg, str(workdir))
  result = trainer.run()
  return cfg, workdir, trainer, result


def test_rl_moves_the_adapters_of_the_warm_started_model(lora_run):
  cfg, workdir, trainer, result = lora_run
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert rows[0]["kl"] == 0.0  # step 1 starts at the base: the reference itself
  assert rows[0]["grad_norm"] > 0  # a learning signal (the adapters' gradient)
  warm = _flat(weights.run_base(cfg, trainer.model_cfg, str(workdir), trainer.param_shardings))
  final = _flat(result.rl.params)
  assert warm.keys() == final.keys()
  moved = {p for p in warm if not np.array_equal(warm[p], final[p])}
  assert moved and all(lora._is_adapter(p) for p in moved)


def test_a_checkpoint_holds_the_adapters_and_their_moments(lora_run):
  _, workdir, _, result = lora_run
  tree = ocp.PyTreeCheckpointer().metadata(workdir / "checkpoints" / "4" / "tree").item_metadata
  saved = jax.tree_util.tree_flatten_with_path(tree["state"]["params"])[0]
  # each leaf's path ends in the param's name, then the Variable's "value"
  names = {str(path[-2].key) for path, _ in saved}
  assert names and all(n.endswith(("_lora_a", "_lora_b")) for n in names), names
  n_saved = sum(int(np.prod(m.shape)) for _, m in saved)
  n_adapter = sum(x.size for x in jax.tree.leaves(lora.partition(result.rl.params, "adapters")[0]))
  assert n_saved == n_adapter
  moments = [m for m in jax.tree.leaves(tree["state"]["opt_state"]) if len(m.shape)]
  assert sum(int(np.prod(m.shape)) for m in moments) == 2 * n_adapter


def test_a_resume_onto_another_base_is_refused(lora_run, tmp_path, monkeypatch):
  cfg, workdir, _, _ = lora_run
  copy = tmp_path / "copy"
  os.makedirs(copy)
  for name in ("checkpoints", "tokenizer"):
    os.symlink(workdir / name, copy / name)
  # The same config (a resume may change `steps`), but the base it rebuilds is not the one the
  # adapters were trained on (as when a local checkpoint's files were replaced in between).
  warm_start = Trainer.warm_start
  monkeypatch.setattr(
    Trainer,
    "warm_start",
    lambda self, params: jax.tree.map(lambda x: x * 1.001, warm_start(self, params)),
  )
  with pytest.raises(ValueError, match="another base model"):
    Trainer.open(dataclasses.replace(cfg, steps=5), str(copy)).run()


def test_export_of_the_run_is_the_trained_model(lora_run, tmp_path):
  from hf_fixtures import left_padded_batch, our_logits

  cfg, workdir, trainer, result = lora_run
  out = weights.export(str(workdir), str(tmp_path / "hf"), dtype="float32")
  _, graphdef, merged = hf_load.load_hf_checkpoint(out)
  tokens, mask = left_padded_batch(trainer.model_cfg.vocab_size)
  ours = our_logits(trainer.graphdef, result.rl.params, tokens, mask)
  np.testing.assert_allclose(our_logits(graphdef, merged, tokens, mask), ours, atol=1e-5, rtol=0)
  assert (tmp_path / "hf" / "lora" / "adapter_model.safetensors").exists()
  assert (tmp_path / "hf" / "lora" / "base" / "config.json").exists()
