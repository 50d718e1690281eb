"""A checkpoint records its params' layout; one of another layout is refused by name, never
restored transposed (a square kernel would fit its slot), and a stale SFT cache is rebuilt."""

from __future__ import annotations

import logging
import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxrl.nn import model
from jaxrl.run import sft
from jaxrl.workdir.checkpoint import LAYOUT, Checkpointer, StaleLayout

# One square kernel: the case where a restore by shape alone would silently transpose the model.
SQUARE = {"params": {"q_proj": np.arange(16, dtype=np.float32).reshape(4, 4)}}


def _legacy_checkpoint(directory, step: int, meta: dict) -> None:
  """A checkpoint as jaxrl wrote it before layouts were recorded: orbax's two items, no layout."""
  mgr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True))
  args = ocp.args.Composite(tree=ocp.args.StandardSave(SQUARE), meta=ocp.args.JsonSave(meta))
  mgr.save(step, args=args)
  mgr.wait_until_finished()
  mgr.close()


def test_checkpoints_record_the_layout_and_restore_it(tmp_path):
  ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
  ckpt.save(1, SQUARE, {"step": 1})
  ckpt.wait()
  raw = ckpt._mgr.restore(1, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  assert raw == {"step": 1, LAYOUT: model.PARAM_LAYOUT}
  tree, meta = ckpt.restore(1, SQUARE)
  assert meta == {"step": 1} == ckpt.restore_meta(1)  # the layout is the Checkpointer's own
  np.testing.assert_array_equal(np.asarray(tree["params"]["q_proj"]), SQUARE["params"]["q_proj"])
  ckpt.close()


def test_a_checkpoint_of_the_old_layout_is_refused_by_name(tmp_path):
  _legacy_checkpoint(str(tmp_path), 3, {"step": 3})
  ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
  assert ckpt.latest_step() == 3
  layouts = (re.escape(repr(x)) for x in (model.LEGACY_PARAM_LAYOUT, model.PARAM_LAYOUT))
  expected = "checkpoint 3 .*{}.*{}".format(*layouts)
  with pytest.raises(StaleLayout, match=expected):
    ckpt.restore(3, SQUARE)
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), SQUARE["params"]
  )
  with pytest.raises(StaleLayout, match=expected):  # evaluation and export read params only
    ckpt.restore_params(3, abstract)
  assert ckpt.restore_meta(3) == {"step": 3}  # the metadata alone still reads
  ckpt.close()


def test_a_stale_sft_cache_is_removed_and_the_warm_start_runs_again(tmp_path, caplog):
  cache = os.path.join(tmp_path, sft.CACHE)
  _legacy_checkpoint(cache, 60, {"steps": 60})
  with caplog.at_level(logging.WARNING, logger=sft.log.name):
    assert sft.load_cached(str(tmp_path), nnx.State(SQUARE["params"])) is None
  assert "the SFT warm start runs again" in caplog.text and model.LEGACY_PARAM_LAYOUT in caplog.text
  assert not os.path.exists(cache)
