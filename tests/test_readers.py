"""Reading a run while it trains: ``jaxrl-export`` and ``jaxrl-eval`` open its checkpoints
read-only. A save in flight (orbax's temporary directory, its final rename held back here until
the reader is done) completes and restores; the reader creates, changes and deletes nothing in the
run directory but its own results (``RUN/eval/stepN``), never inside ``checkpoints/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import jax
import jax.numpy as jnp
import math_fixtures
import numpy as np
import pytest
from orbax.checkpoint._src.path import atomicity
from run_helpers import ROOT, jaxrl_eval, snapshot, tiny_config

from jaxrl.config import from_configdict, to_dict
from jaxrl.nn import arch, lora, model
from jaxrl.parallel import sharding
from jaxrl.run import cli, weights
from jaxrl.tasks.data.tokenizer import build_tokenizer
from jaxrl.workdir.checkpoint import TRASH, Checkpointer


class HeldCommit:
  """Once ``armed``, orbax's last act of a save, the rename of the step's temporary directory,
  waits for ``release``; ``reached`` is set once every file of the save is written and it waits."""

  def __init__(self, monkeypatch):
    self.armed = False
    self.reached, self.release = threading.Event(), threading.Event()
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(path, *args, **kwargs):
      if self.armed and path.get_final().name.isdigit():  # the step's, not one of its items'
        store = path._checkpoint_metadata_store  # its metadata written too, as finalize waits
        if store is not None:
          await asyncio.to_thread(store.wait_until_finished)
        self.reached.set()
        await asyncio.to_thread(self.release.wait)
      return await original(path, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)


@pytest.fixture
def held_commit(monkeypatch):
  held = HeldCommit(monkeypatch)
  yield held
  held.release.set()  # never leave orbax's thread waiting


def _params(cfg, model_cfg):
  mesh = sharding.make_mesh(1, 1, 1)
  _, abstract = model.abstract(model_cfg)
  return weights.initial_params(cfg, model_cfg, sharding.tree_shardings(abstract, mesh))


def _live_run(run, cfg, held_commit):
  """A run directory as a trainer leaves it mid-run: config, tokenizer, checkpoint 1, the trash of
  a rotation in progress, and the write of checkpoint 2 in flight (held before its rename).
  Returns the trainer's checkpointer and the tree it is writing."""
  os.makedirs(run)
  with open(os.path.join(run, "config.json"), "w") as f:
    json.dump(to_dict(cfg), f)
  if cfg.model.checkpoint:
    model_cfg = arch.model_config(cfg.model)
  else:  # the task's own tokenizer, cached in the run directory
    model_cfg = arch.model_config(cfg.model, len(build_tokenizer(os.path.join(run, "tokenizer"))))
  params = _params(cfg, model_cfg)
  meta = {}
  if lora.has_adapters(params):  # a LoRA checkpoint holds the adapters and the base's fingerprint
    meta[lora.FINGERPRINT] = lora.fingerprint(params)
    params = lora.partition(params, "adapters")[0]
  # (a bounded wait: a write that never commits fails the test instead of hanging it)
  writer = Checkpointer(os.path.join(run, "checkpoints"), keep=2, settle_timeout=120)
  writer.save(1, {"state": {"params": params}}, meta)
  writer.wait()
  trash = os.path.join(run, "checkpoints", TRASH, "0")
  os.makedirs(trash)
  with open(os.path.join(trash, "data"), "w") as f:
    f.write("a step on its way out")
  moved = jax.tree.map(lambda x: x + 1, params)
  held_commit.armed = True
  assert writer.save(2, {"state": {"params": moved}}, meta)
  assert held_commit.reached.wait(120), "the save never reached its commit"
  return writer, moved


def _finished(writer, run, moved):
  """The held write completes: checkpoint 2 is the latest, whole and restorable."""
  writer.wait()
  assert writer.failed == [] and writer.latest_step() == 2, (writer.failed, writer.last_error)
  writer.close()
  reader = Checkpointer.reader(os.path.join(run, "checkpoints"))
  try:
    target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), moved
    )
    restored = reader.restore_part(2, {"state": {"params": target}})["state"]["params"]
  finally:
    reader.close()
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
def test_export_of_a_live_run_leaves_its_save_in_flight_and_its_files_alone(
  tmp_path, held_commit, rank
):
  cfg = tiny_config(**{"sft.steps": 0, "model.lora.rank": rank})
  run = str(tmp_path / "run")
  writer, moved = _live_run(run, cfg, held_commit)
  before = snapshot(run)
  assert any(".orbax-checkpoint-tmp" in p for p in before)  # the write is in flight

  out = weights.export(run, str(tmp_path / "hf"))

  assert snapshot(run) == before  # no file created, changed or deleted in the run directory
  assert os.path.exists(os.path.join(out, "model.safetensors"))
  held_commit.release.set()
  _finished(writer, run, moved)


def test_a_reader_writes_nothing_where_it_reads(tmp_path):
  """A reader of a directory without checkpoints creates none; one of a run's SFT cache neither."""
  missing = tmp_path / "checkpoints"
  reader = Checkpointer.reader(str(missing))
  assert reader.latest_step() is None and reader.all_steps() == []
  with pytest.raises(RuntimeError, match="read-only"):
    reader.save(1, {"x": jnp.zeros(2)}, {})
  reader.close()
  assert not missing.exists()


@pytest.mark.slow
def test_eval_of_a_live_run_writes_its_results_beside_the_checkpoints(tmp_path, held_commit):
  """``jaxrl-eval`` of ``RUN/checkpoints/1`` while checkpoint 2 is being written: the write
  completes, and the results go to ``RUN/eval/step1`` (not into the step directory, which the
  run deletes when it rotates out)."""
  ckpt = math_fixtures.make_checkpoint(tmp_path / "hf")
  train, val = math_fixtures.make_math_data(tmp_path / "data")
  cd = cli.load_config(os.path.join(ROOT, "configs", "qwen7b.py") + ":test")
  cd.update_from_flattened_dict(
    {"model.checkpoint": str(ckpt), "data.train": str(train), "data.heldout": str(val)}
  )
  cfg = from_configdict(cd)
  run = str(tmp_path / "run")
  writer, moved = _live_run(run, cfg, held_commit)
  before = snapshot(run)
  out = jaxrl_eval(
    f"--config={run}/config.json",
    f"--checkpoint={run}/checkpoints/1",
    f"--benchmarks=val={val}",
    "--num_samples=2",
    "--ks=1,2",
    env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
  )
  results = os.path.join(run, "eval", "step1")
  assert f"written: {results}/eval_results.json" in out.stdout, out.stdout
  after = snapshot(run)
  written = {p for p in after if p == "eval" or p.startswith("eval" + os.sep)}
  assert {os.path.join("eval", "step1", "eval_results.json")} < written
  assert {p: v for p, v in after.items() if p not in written} == before
  with open(os.path.join(results, "eval_results.json")) as f:
    assert json.load(f)["checkpoint"] == os.path.join(run, "checkpoints", "1")
  held_commit.release.set()
  _finished(writer, run, moved)
