"""Checkpoints: orbax, atomic (orbax writes to a temporary directory and renames), async,
keep-last-k. One checkpoint holds everything a resumed run needs: the train state, the question
statistics, controller states, and JSON metadata (data cursor, config, evaluation so far).
RNG needs no state: every key is ``fold_in(seed, step)``.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """A thin wrapper over ``ocp.CheckpointManager`` with one pytree item and one JSON item."""

  def __init__(self, directory: str, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self._mgr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, tree, meta: dict) -> None:
    self._mgr.save(step, args=ocp.args.Composite(tree=ocp.args.StandardSave(tree),
                                                 meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, abstract_tree):
    """(tree, meta) restored into the structure, dtypes and shardings of ``abstract_tree``."""
    target = jax.tree.map(
        lambda x: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "shape") else x, abstract_tree)
    out = self._mgr.restore(step, args=ocp.args.Composite(tree=ocp.args.StandardRestore(target),
                                                          meta=ocp.args.JsonRestore()))
    return out["tree"], out["meta"]

  def restore_params(self, step: int, abstract_params):
    """Only the train state's params (e.g. for evaluation), restored onto ``abstract_params``'
    shapes, dtypes and shardings; the optimizer state and statistics are not read."""
    target = {"state": {"params": abstract_params}}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype),
                                target)
    out = self._mgr.restore(step, args=ocp.args.Composite(tree=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True)))
    return out["tree"]["state"]["params"]

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()
