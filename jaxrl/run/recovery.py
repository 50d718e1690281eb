"""What a failed RL step keeps: the steps trained before it checkpointed when the train state is
intact, and a stop that arrived during it ended as a stop (exit 130), not as the failure."""

from __future__ import annotations

import logging

import jax

from jaxrl.run.loop_state import LoopState, save_loop
from jaxrl.run.stops import Stopped, stop_after_checkpoint
from jaxrl.workdir.checkpoint import Checkpointer

log = logging.getLogger(__name__)


def after_failed_step(ckpt: Checkpointer, start: int, i: int, loop: LoopState, stop, mesh) -> None:
  """Step ``i + 1`` failed: checkpoint the steps trained before it. When a stop was requested
  (a job-wide signal that took the step's sidecar along) and they are safe, end as stopped;
  otherwise the caller re-raises the error (in a multi-process run: every process ends)."""
  saved = i == start or save_trained(ckpt, i, loop, mesh)
  if not (stop.requested and saved and jax.process_count() == 1):
    return
  log.warning("step %d abandoned: %s arrived during it", i + 1, stop.signal_name, exc_info=True)
  if i == start:  # nothing trained since the last checkpoint (or the start)
    raise Stopped(i)
  stop_after_checkpoint(ckpt, i, stop.signal_name)


def save_trained(ckpt: Checkpointer, step: int, loop: LoopState, mesh) -> bool:
  """After a failure past step ``step``: checkpoint the ``step`` steps trained since the last
  save, when the train state is intact (no update under way donated it): a failed rollout,
  verifier, rescoring or evaluation loses no trained step. One process only: a multi-process
  save is a collective the other processes are not in. Whether step ``step`` is checkpointed."""
  ckpt.wait()  # a save of this step may still be settling
  if ckpt.latest_step() == step and step not in ckpt.failed:
    return True
  if step == 0 or jax.process_count() > 1:
    return False
  if any(x.is_deleted() for x in jax.tree.leaves(loop.train) if isinstance(x, jax.Array)):
    log.error(
      "the train state after step %d was consumed: the steps since the last checkpoint are lost",
      step,
    )
    return False
  log.warning("checkpointing the %d steps trained before the failure", step)
  return save_loop(ckpt, step, loop, mesh, wait=False)
