"""How a run stops: on request (SIGINT / SIGTERM, after the step's checkpoint), on divergence (too
many non-finite steps), and never before its last checkpoint is on disk."""

from __future__ import annotations

import contextlib
import logging
import signal

from jaxrl.workdir.checkpoint import Checkpointer, CheckpointError

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
  """Training diverged: too many consecutive non-finite steps."""


class Stopped(Exception):
  """The run stopped on request (SIGINT / SIGTERM) after saving what it had done: the step's
  checkpoint, the SFT warm start's progress, or (during an evaluation) nothing to lose."""

  def __init__(self, step: int, message: str = ""):
    super().__init__(message or f"stopped after step {step}; its checkpoint is saved")
    self.step = step


class NonFiniteGuard:
  """Counts consecutive steps whose update was skipped as non-finite; too many stop the run."""

  def __init__(self, limit: int):
    self.limit = limit
    self.run = 0

  def check(self, row: dict, step_number: int) -> None:
    if not row["nonfinite_updates"]:
      self.run = 0
      return
    self.run += 1
    log.warning(
      "step %d: non-finite loss or gradients (loss %s, grad norm %s): update skipped (%d in a row)",
      step_number,
      row["loss"],
      row["grad_norm"],
      self.run,
    )
    if self.run >= self.limit:
      raise NonFiniteError(
        f"{self.run} consecutive steps had non-finite loss or gradients (limit "
        f"optim.max_nonfinite_steps={self.limit}); the last checkpoint holds the "
        f"last finite state"
      )


def check_saved(ckpt: Checkpointer, step_number: int) -> None:
  """The run's last checkpoint must be on disk before the run reports success (or a stop)."""
  if step_number in ckpt.failed:
    latest = ckpt.latest_step()
    usable = (
      f"the latest usable one is step {latest} in {ckpt.directory}"
      if latest is not None
      else f"no usable checkpoint in {ckpt.directory}"
    )
    raise CheckpointError(
      f"the checkpoint of step {step_number} could not be written ({ckpt.last_error}); {usable}"
    )


def stop_after_checkpoint(ckpt: Checkpointer, step_number: int, signal_name: str) -> None:
  """A requested stop is only reported once the step's checkpoint is on disk."""
  ckpt.wait()
  check_saved(ckpt, step_number)
  log.warning("%s: checkpoint saved at step %d; run again to resume", signal_name, step_number)
  raise Stopped(step_number)


@contextlib.contextmanager
def sigterm_as_interrupt():
  """SIGTERM raises ``KeyboardInterrupt`` while the block runs, as SIGINT does by default: a stop
  while a run is being built (the model loaded, a sidecar started, programs compiled) ends it as
  Ctrl-C does, with what was started stopped, before ``StopFlag`` takes over for the run."""

  def interrupt(signum, frame):
    raise KeyboardInterrupt

  try:
    previous = signal.signal(signal.SIGTERM, interrupt)
  except ValueError:  # not the main thread: the signal stays the process's default
    previous = None
  try:
    yield
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)


class StopFlag:
  """First SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption): finish the step, checkpoint,
  stop. A second one: stop at once."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self, on_stop=None):
    self.requested = False
    self._on_stop = on_stop  # called (once, in the handler) when a stop is requested
    self.signal_name = ""
    self._previous = {}
    try:
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    except ValueError:  # not the main thread (e.g. inside some test runners)
      self.restore()

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    self.signal_name = signal.Signals(signum).name
    if self._on_stop is not None:
      self._on_stop()
    log.warning("%s: finishing this step and saving what it did (again to abort)", self.signal_name)

  def check(self, message: str, step: int = 0) -> None:
    """Raise ``Stopped(step, message)`` if a stop was requested (a phase's own stopping point)."""
    if self.requested:
      log.warning("%s: %s", self.signal_name, message)
      raise Stopped(step, f"{self.signal_name}: {message}")

  def restore(self):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}
