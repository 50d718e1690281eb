"""Checkpoints: orbax, atomic (orbax writes to a temporary directory and renames), async,
keep-last-k. One checkpoint holds everything a resumed run needs: the train state, the question
statistics, controller states, and JSON metadata (data cursor, config, evaluation so far).
RNG needs no state: every key is ``fold_in(seed, step)``.

Every checkpoint records how its params are laid out (``model.PARAM_LAYOUT``) and a restore of
another layout fails by name (``StaleLayout``): restored as it is, a square kernel written [in, out]
would fit an [out, in] slot, and the run would go on with a transposed model.

A run's checkpoints also record its resolved config (``record``, ``recorded_config``: see
``run_config``), which a resume is checked against.

Readers of a run (``Checkpointer.reader``: evaluation, export, a resume's checks) open it
read-only: orbax's own read-only mode (it neither creates the directory nor removes temporary
directories or old steps) and no emptying of ``deleted/``. A trainer may be writing a checkpoint
into that directory at the same time: its temporary directory is left as it is, and the write
completes.

A write that fails or hangs counts as failed and never stops the run: each call into orbax that may
wait runs on one helper thread with a bounded wait, and a failed write's tmp directory becomes an
empty file of its name (``_bury``); both are ``checkpoint_failures``'s. ``orbax_noise`` quiets what
orbax prints that a user need not see.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl.nn import lora, model
from jaxrl.workdir.checkpoint_failures import (
  TMP,
  OrbaxThread,
  brief,
  remove_markers,
  replace_by_marker,
  root_cause,
  tmp_paths,
)
from jaxrl.workdir.orbax_noise import quiet_dropped_reads

log = logging.getLogger(__name__)

# Seconds any one wait on an orbax write may take (the train state of a 7B model writes in a few
# minutes on a slow disk); past it the write counts as failed.
SETTLE_TIMEOUT_S = 600.0

# Old checkpoints beyond ``keep`` leave by one atomic rename into this subdirectory, which is then
# emptied: orbax's own deletion removes a step directory file by file in place, so a kill during it
# left a half-deleted directory that still looked like a checkpoint (seen once in the kill/resume
# test with both cores loaded: step 1 present, its metadata gone).
TRASH = "deleted"
LAYOUT = "param_layout"  # the metadata key of ``model.PARAM_LAYOUT`` (the Checkpointer's own)
RECORD = "run_config"  # the metadata key of the run's recorded config (the Checkpointer's own)


class StaleLayout(ValueError):
  """A checkpoint whose params are laid out otherwise than this jaxrl lays them out."""


class CheckpointError(RuntimeError):
  """The last checkpoint write failed; ``latest_step`` is the newest one that is complete."""


class UnreadableCheckpoint(RuntimeError):
  """No checkpoint of a run reads (or not the one asked for): each step with its cause."""

  def __init__(self, directory: str, causes: list[tuple[int, str]]):
    self.directory, self.causes = directory, causes
    listed = "; ".join(f"step {step}: {cause}" for step, cause in causes)
    super().__init__(f"{directory}: no checkpoint reads ({listed})")


def log_unreadable(directory: str, step: int, cause: str) -> None:
  """The one line that says a checkpoint does not read and the one before is tried."""
  log.error("checkpoint %d in %s does not read (%s); trying the one before", step, directory, cause)


class Checkpointer:
  """A thin wrapper over ``ocp.CheckpointManager`` with one pytree item and one JSON item."""

  def __init__(
    self,
    directory: str,
    keep: int,
    async_save: bool = True,
    settle_timeout: float | None = None,
    record: dict | None = None,
    read_only: bool = False,
  ):
    """``record``: the run's resolved config, stored in every checkpoint written (``run_config``);
    ``read_only``: see ``reader``."""
    self.directory = os.path.abspath(directory)
    self.settle_timeout = SETTLE_TIMEOUT_S if settle_timeout is None else float(settle_timeout)
    self.read_only = read_only
    self._record_meta = record
    if read_only:
      # Nothing created, cleaned or deleted: orbax's read-only mode turns its cleanup of
      # temporary directories and its deletions off (checked against orbax-checkpoint 0.12).
      options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, enable_async_checkpointing=False
      )
    else:
      # A write that failed (disk full, permissions, a kill) leaves only an orbax tmp directory
      # (or ``_bury``'s marker): it never counts as a checkpoint, and the next writing manager
      # removes it. The markers go first: no write of their run is left to stop now, and orbax's
      # cleanup expects directories.
      if jax.process_index() == 0:
        remove_markers(self.directory)
      options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        todelete_subdir=TRASH,
      )
    if not read_only:
      # A failed or killed write's tmp directories (one a late tensorstore write recreated after
      # the last close included) are never checkpoints: removed here, before orbax starts, in this
      # thread (orbax's own cleanup runs in the background, so nothing could be said of it after).
      # The workdir lock keeps another trainer's writes out of this directory.
      self._remove_tmp_directories()
    self._mgr = ocp.CheckpointManager(self.directory, options=options)
    self._empty_trash()  # what a killed run moved there
    self._orbax = OrbaxThread()
    self._pending: int | None = None  # step of the write in flight
    self._stuck: tuple[int, Future] | None = None  # (step, wait) past the timeout
    self.failed: list[int] = []  # steps whose write failed
    self._buried: set[int] = set()  # failed steps whose tmp directory is ``_bury``'s marker
    self.last_error: str | None = None
    # The last complete checkpoint, kept here so that reporting a write that never settled needs
    # no directory listing (on a hung disk that blocks too).
    self._latest: int | None = self._mgr.latest_step()

  @classmethod
  def reader(cls, directory: str) -> "Checkpointer":
    """A checkpointer that only reads ``directory`` (which may not exist: then it has no steps)
    and writes nothing there, whatever a trainer is writing into it at the same time."""
    return cls(directory, keep=1, async_save=False, read_only=True)

  def latest_step(self) -> int | None:
    """The last checkpoint known complete (a write in flight counts once it has settled)."""
    return self._latest

  def all_steps(self) -> list[int]:
    """Every complete checkpoint in the directory."""
    return list(self._mgr.all_steps())

  def save(self, step: int, tree, meta: dict) -> bool:
    """Start writing checkpoint ``step``. A failed write (found now or when the next save or
    ``wait`` checks the one in flight) is logged and recorded, never raised: the previous
    checkpoint stays the latest and training goes on. While an earlier write has not settled,
    orbax cannot take another one: the step is recorded as failed without a wait. Returns False
    if this write failed at once."""
    if self.read_only:
      raise RuntimeError(f"{self.directory}: opened read-only, checkpoint {step} not written")
    self._settle()
    if self._blocked(step):
      return False
    if step in self._buried:  # written again: orbax needs the directory back
      self._buried.discard(step)
      remove_markers(self.directory, step)
    meta = {**meta, LAYOUT: model.PARAM_LAYOUT}
    if self._record_meta is not None:
      meta[RECORD] = self._record_meta
    args = ocp.args.Composite(tree=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta))
    # The synchronous part (device-to-host copies, directories; the whole write when not async)
    # may block on the disk too.
    stuck, error = self._orbax.call(lambda: self._mgr.save(step, args=args), self.settle_timeout)
    if stuck is not None:
      self._give_up(step, stuck)
      return False
    if error is not None:
      self._failed(step, error)
      return False
    self._pending = step
    return True

  def _settle(self) -> None:
    """Wait (at most ``settle_timeout``) for the write in flight; record it if it failed."""
    if self._pending is None:
      return
    step, self._pending = self._pending, None
    stuck, error = self._orbax.call(self._mgr.wait_until_finished, self.settle_timeout)
    if stuck is not None:
      self._give_up(step, stuck)
    elif error is not None:
      self._failed(step, error)
    else:
      self._latest = step
      self._empty_trash()  # the write (and orbax's renames of old steps) finished: the disk answers

  def _empty_trash(self) -> None:
    if jax.process_index() == 0 and not self.read_only:  # a reader leaves a writer's trash
      shutil.rmtree(os.path.join(self.directory, TRASH), ignore_errors=True)

  def _give_up(self, step: int, wait: Future) -> None:
    self._stuck = (step, wait)
    # Its tmp directory stays: orbax's threads may still write there (a resume removes it). The
    # disk may not answer: nothing here touches it.
    self._record(step, f"the write did not finish within {self.settle_timeout:g} s", reload=False)

  def _blocked(self, step: int) -> bool:
    """Whether a write given up on is still running (then ``step`` fails without a wait)."""
    if self._stuck is None:
      return False
    stuck_step, wait = self._stuck
    if wait.done():  # it ended late: orbax is usable again
      self._stuck = None
      self._mgr.reload()
      self._latest = self._mgr.latest_step()  # the disk answers again; the late write may count
      log.warning("the checkpoint write of step %d finished late; saving resumes", stuck_step)
      return False
    self._record(
      step,
      f"not started: the write of step {stuck_step} did not finish within "
      f"{self.settle_timeout:g} s",
      reload=False,
    )
    return True

  def _failed(self, step, error: BaseException) -> None:
    self._bury(step)
    self._record(step, brief(error))

  def _remove_tmp_directories(self) -> None:
    if jax.process_index() == 0:
      pattern = os.path.join(glob.escape(self.directory), "*.orbax-checkpoint-tmp*")
      for partial in glob.glob(pattern):
        shutil.rmtree(partial, ignore_errors=True)

  def _bury(self, step: int) -> None:
    """Free the space of a failed write and keep it free: its tmp directory (never a checkpoint)
    becomes an empty file. Orbax reports a write's first error while tensorstore goes on flushing
    the write's other files, one after another for as long as its queue lasts (after ``close``
    too), each creating the directories above it, and neither offers a way to wait for them:
    through a file they fail (ENOTDIR), whenever they come. The canonical name is claimed even
    when absent, as a flush may still create it."""
    trash = os.path.join(self.directory, TRASH)
    paths = {os.path.join(self.directory, f"{step}{TMP}"), *tmp_paths(self.directory, step)}
    for path in sorted(paths):
      try:
        replace_by_marker(path, trash)
      except OSError as e:
        log.warning("the failed checkpoint %d's %s stays: %s", step, path, e)
    self._buried.add(step)

  def _record(self, step: int, reason: str, reload: bool = True) -> None:
    self.failed.append(step)
    self.last_error = reason
    if reload:  # orbax forgets the failed step (its next save must not count it)
      self._mgr.reload()
    latest = self._latest
    log.error(
      "checkpoint at step %s failed (%s); %s",
      step,
      reason,
      f"the latest usable checkpoint is step {latest} in {self.directory}"
      if latest is not None
      else f"there is no usable checkpoint in {self.directory}",
    )

  def newest_readable(self, read: Callable[[int], Any], step: int = -1) -> tuple[int, Any]:
    """(the step, ``read(step)``) of the newest checkpoint that reads, newest first. One that
    does not (a truncated or missing file, broken JSON) is logged in one line naming the step and
    the cause; a writer moves it aside (``unreadable-N``, kept for a look, never a checkpoint
    again) so the run writes that step anew. ``step`` >= 0: that checkpoint alone, its failure
    an ``UnreadableCheckpoint``. A params layout of another jaxrl (``StaleLayout``) or adapters
    trained on another base (``lora.BaseMismatch``) are raised as they are: the step is whole,
    only another setup reads it, and it is never set aside."""
    steps = [step] if step >= 0 else sorted(self.all_steps(), reverse=True)
    causes = []
    quiet_dropped_reads()  # before the first read: a failing one reports from other threads
    for s in steps:
      try:
        return s, read(s)
      except (StaleLayout, lora.BaseMismatch):  # whole checkpoints another setup cannot read
        raise
      except Exception as e:  # noqa: BLE001 - anything a damaged checkpoint raises in orbax
        quiet_dropped_reads()
        causes.append((s, root_cause(e)))
        if step >= 0:
          break
        log_unreadable(self.directory, s, root_cause(e))
        self._set_aside(s)
    raise UnreadableCheckpoint(self.directory, causes)

  def _set_aside(self, step: int) -> None:
    """Move the unreadable checkpoint ``step`` out of orbax's sight (a writer only)."""
    if self.read_only or jax.process_index() != 0:
      return
    aside = os.path.join(self.directory, f"unreadable-{step}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(os.path.join(self.directory, str(step)), aside)
    self._mgr.reload()
    self._latest = self._mgr.latest_step()
    log.error("checkpoint %d moved to %s", step, aside)

  def restore(self, step: int, abstract_tree):
    """(tree, meta) restored into the structure, dtypes and shardings of ``abstract_tree``."""
    self._check_layout(step)
    target = jax.tree.map(
      lambda x: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "shape") else x, abstract_tree
    )
    out = self._mgr.restore(
      step,
      args=ocp.args.Composite(tree=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
    )
    return out["tree"], _callers_meta(out["meta"])

  def _raw_meta(self, step: int) -> dict:
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore_meta(self, step: int) -> dict:
    """Only the JSON metadata of checkpoint ``step`` (what the array tree's shapes depend on)."""
    return _callers_meta(self._raw_meta(step))

  def recorded_config(self, step: int) -> dict | None:
    """The run's config as checkpoint ``step`` records it (``run_config.record``); None for a
    checkpoint written before configs were recorded."""
    return self._raw_meta(step).get(RECORD)

  def _check_layout(self, step: int) -> None:
    """Raise ``StaleLayout`` unless checkpoint ``step``'s params have this jaxrl's layout (one
    written before layouts were recorded has ``model.LEGACY_PARAM_LAYOUT``)."""
    layout = self._raw_meta(step).get(LAYOUT, model.LEGACY_PARAM_LAYOUT)
    if layout != model.PARAM_LAYOUT:
      raise StaleLayout(
        f"{self.directory}: checkpoint {step} holds params laid out as {layout!r}, this jaxrl "
        f"lays them out as {model.PARAM_LAYOUT!r}: resume it with the jaxrl that wrote it (or "
        "export it to HF there: an HF checkpoint loads in both), or start in a new --workdir"
      )

  def restore_params(self, step: int, abstract_params):
    """Only the train state's params (e.g. for evaluation), restored onto ``abstract_params``'
    shapes, dtypes and shardings; the optimizer state and statistics are not read."""
    return self.restore_part(step, {"state": {"params": abstract_params}})["state"]["params"]

  def restore_part(self, step: int, target):
    """A sub-tree of checkpoint ``step`` (same keys, any subset), onto ``target``'s shardings."""
    self._check_layout(step)
    restore_args = jax.tree.map(
      lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype), target
    )
    out = self._mgr.restore(
      step,
      args=ocp.args.Composite(
        tree=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
      ),
    )
    return out["tree"]

  def wait(self) -> None:
    """Block until the write in flight is on disk, has failed or did not settle in time (see
    ``failed``)."""
    self._settle()

  def close(self) -> None:
    """Settle the write in flight, then release orbax; never blocks past ``settle_timeout``."""
    self._settle()
    if self._stuck is not None and not self._stuck[1].done():
      return  # orbax's close would join the blocked threads: leave them (see ``unsettled``)
    _, error = self._orbax.call(self._mgr.close, self.settle_timeout)
    self._orbax.stop()
    if error is not None:
      log.warning("closing the checkpoint manager: %s", brief(error))


def _callers_meta(meta: dict) -> dict:
  """The metadata a caller saved, without the Checkpointer's own keys."""
  return {k: v for k, v in meta.items() if k not in (LAYOUT, RECORD)}
