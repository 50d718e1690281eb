"""Checkpoints: orbax, atomic (orbax writes to a temporary directory and renames), async,
keep-last-k. One checkpoint holds everything a resumed run needs: the train state, the question
statistics, controller states, and JSON metadata (data cursor, config, evaluation so far).
RNG needs no state: every key is ``fold_in(seed, step)``.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def _brief(error: Exception) -> str:
  """The cause of a failed write in a line: the OS error when tensorstore reports one (its messages
  embed whole JSON specs), else the start of the message."""
  text = " ".join(str(error).split())
  code = re.search(r"\[os_error_code='?\d+'?\]", text)
  if code:
    start = text.rfind("Failed", 0, code.start())
    return text[max(start, 0):code.end()]
  return f"{type(error).__name__}: {text[:300]}"


class CheckpointError(RuntimeError):
  """The last checkpoint write failed; ``latest_step`` is the newest one that is complete."""


class Checkpointer:
  """A thin wrapper over ``ocp.CheckpointManager`` with one pytree item and one JSON item."""

  def __init__(self, directory: str, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    # A write that failed (disk full, permissions, a kill) leaves only an orbax tmp directory: it
    # never counts as a checkpoint, and the next manager removes it.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True)
    self._mgr = ocp.CheckpointManager(self.directory, options=options)
    self._pending: int | None = None    # step of the write in flight
    self.failed: list[int] = []         # steps whose write failed
    self.last_error: str | None = None

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, tree, meta: dict) -> bool:
    """Start writing checkpoint ``step``. A failed write (found now or when the next save or
    ``wait`` checks the one in flight) is logged and recorded, never raised: the previous
    checkpoint stays the latest and training goes on. Returns False if this write failed at once."""
    self._settle()
    try:
      self._mgr.save(step, args=ocp.args.Composite(tree=ocp.args.StandardSave(tree),
                                                   meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # noqa: BLE001 - any I/O failure: keep training, say so
      self._failed(step, e)
      return False
    self._pending = step
    return True

  def _settle(self) -> None:
    """Wait for the write in flight; record it if it failed."""
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      self._failed(self._pending, e)
    self._pending = None

  def _failed(self, step, error: Exception) -> None:
    self.failed.append(step)
    self.last_error = _brief(error)
    self._mgr.reload()   # forget the failed step: latest_step() is again the last complete one
    pattern = os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*")
    for partial in glob.glob(pattern):   # never a checkpoint: free its space
      shutil.rmtree(partial, ignore_errors=True)
    latest = self._mgr.latest_step()
    log.error("checkpoint at step %s failed (%s); %s", step, self.last_error,
              f"the latest usable checkpoint is step {latest} in {self.directory}"
              if latest is not None else f"there is no usable checkpoint in {self.directory}")

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
    return self.restore_part(step, {"state": {"params": abstract_params}})["state"]["params"]

  def restore_part(self, step: int, target):
    """A sub-tree of checkpoint ``step`` (same keys, any subset), onto ``target``'s shardings."""
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype),
                                target)
    out = self._mgr.restore(step, args=ocp.args.Composite(tree=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True)))
    return out["tree"]

  def wait(self) -> None:
    """Block until the write in flight is on disk (or has failed: see ``failed``)."""
    self._settle()

  def close(self) -> None:
    self._settle()
    self._mgr.close()
