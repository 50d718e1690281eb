"""Old checkpoints leave by one rename into ``checkpoints/deleted`` before they are removed, so a
kill during a deletion never leaves a half-deleted step directory that looks like a checkpoint. A
writing checkpointer empties it; a reader leaves it alone."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from jaxrl.workdir.checkpoint import TRASH, Checkpointer


def test_old_steps_are_renamed_then_removed_and_leftovers_cleared(tmp_path):
  directory = str(tmp_path / "checkpoints")
  ckpt = Checkpointer(directory, keep=2, async_save=True)
  for step in (1, 2, 3, 4):
    ckpt.save(step, {"x": jnp.full((3,), step, jnp.float32)}, {"step": step})
  ckpt.close()
  assert sorted(os.listdir(directory)) == ["3", "4"]  # nothing half-deleted, no trash left
  # A run killed after orbax moved a step to the trash but before it was emptied: the partial
  # copy is not a checkpoint, and the next checkpointer clears it.
  leftover = os.path.join(directory, TRASH, "2")
  os.makedirs(leftover)
  with open(os.path.join(leftover, "half"), "w") as f:
    f.write("x")
  reader = Checkpointer.reader(directory)  # a reader leaves it: the trash may be a live run's
  assert reader.latest_step() == 4
  reader.close()
  assert os.path.exists(os.path.join(leftover, "half"))
  ckpt = Checkpointer(directory, keep=2, async_save=True)
  try:
    assert ckpt.latest_step() == 4 and sorted(os.listdir(directory)) == ["3", "4"]
    tree, meta = ckpt.restore(4, {"x": np.zeros((3,), np.float32)})
    assert meta == {"step": 4} and np.asarray(tree["x"]).tolist() == [4.0] * 3
  finally:
    ckpt.close()
