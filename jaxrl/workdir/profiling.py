"""A ``jax.profiler`` trace of chosen RL steps (``log.profile_from``, ``log.profile_steps``).

The trace holds every XLA program the steps run (the update, the sampler, rescoring) op by op,
on the host and on the devices, with the Python around them: where a step's time goes. It is
written to ``WORKDIR/profile`` (``WORKDIR/profile/processN`` with several processes, so hosts
sharing a file system do not write the same file): ``tensorboard --logdir WORKDIR/profile`` shows
it (the Profile tab, with the tensorboard-plugin-profile package), and the ``*.trace.json.gz``
beside it opens in Perfetto (ui.perfetto.dev) or chrome://tracing.

Steps count from 1, as the log prints them. A run resumed inside the window traces the rest of
it; a run that stops or fails inside it still closes the trace (``close``).
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)


def profile_dir(workdir: str) -> str:
  """Where this process writes its trace."""
  root = os.path.join(workdir, "profile")
  if jax.process_count() > 1:
    return os.path.join(root, f"process{jax.process_index()}")
  return root


class StepProfiler:
  """Starts a trace before step ``first`` and stops it after step ``first + count - 1``
  (``first`` = 0: never)."""

  def __init__(self, workdir: str, first: int, count: int):
    self.directory = profile_dir(workdir)
    self.first, self.last = first, first + count - 1
    self.active = False
    self.traced: list[int] = []  # the steps of the running (or last) trace

  def before_step(self, step: int) -> None:
    """Called before step ``step`` (1-based) runs."""
    if self.first and not self.active and self.first <= step <= self.last:
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after_step(self, step: int) -> None:
    """Called once step ``step`` is done (its update's metrics are on the host, so its device
    work has finished)."""
    if self.active:
      self.traced.append(step)
      if step >= self.last:
        self.close()

  def close(self) -> None:
    """Stop the trace if one is running (the run ended or failed inside the window)."""
    if not self.active:
      return
    jax.profiler.stop_trace()
    self.active = False
    steps = f"{self.traced[0]}-{self.traced[-1]}" if self.traced else "none completed"
    log.info(
      "profile of RL steps %s in %s (tensorboard --logdir, or its *.trace.json.gz in Perfetto)",
      steps,
      self.directory,
    )
