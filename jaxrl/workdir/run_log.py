"""Where the commands log: stderr, and for a training run its ``log.txt`` (one per process)."""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RunLog(logging.FileHandler):
  """The run's log file. When it cannot be written (EFBIG, a full disk) that is said once on
  stderr and the file is dropped: logging's default prints two tracebacks for every record after
  that, from every thread, for the rest of the run."""

  _dead = False

  def emit(self, record):
    if not self._dead:
      super().emit(record)

  def handleError(self, record):
    if self._dead:
      return
    if not isinstance(sys.exc_info()[1], OSError):  # a bad record (format args), not the file
      super().handleError(record)
      return
    self._dead = True
    try:
      print(
        f"jaxrl: cannot write the log file {self.baseFilename} ({sys.exc_info()[1]}); "
        "logging to stderr only",
        file=sys.stderr,
        flush=True,
      )
    except OSError:
      pass


def quiet_libraries() -> None:
  """orbax and absl log every checkpoint phase at INFO: keep the run's own log readable."""
  for name in ("absl", "jax", "orbax"):
    logging.getLogger(name).setLevel(logging.WARNING)


def setup(workdir: str | None = None) -> None:
  """INFO to stderr and, with a ``workdir``, to its ``log.txt`` (``log.processN.txt`` on the other
  processes of a multi-host run)."""
  handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
  if workdir is not None:
    import jax

    index = jax.process_index()
    name = "log.txt" if index == 0 else f"log.process{index}.txt"
    handlers.append(RunLog(os.path.join(workdir, name)))
  logging.basicConfig(level=logging.INFO, force=True, format=FORMAT, handlers=handlers)
  quiet_libraries()
