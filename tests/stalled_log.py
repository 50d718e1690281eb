"""A log sink that stalls for real: error records of the ``absl`` logger (orbax logs through it)
go to a pipe that is full and that nobody reads, so the thread that logs blocks in ``write()``.
Used in-process and, imported by ``python -c``, in a ``jaxrl.main`` subprocess."""

from __future__ import annotations

import contextlib
import logging
import os


def stall_absl_errors() -> tuple[int, logging.Handler]:
  """Install the stalled sink; returns (the pipe's read end, the handler) to undo it."""
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  with contextlib.suppress(BlockingIOError):
    while True:
      os.write(write_fd, b"x" * 65536)
  os.set_blocking(write_fd, True)
  sink = logging.StreamHandler(os.fdopen(write_fd, "w"))
  sink.setLevel(logging.ERROR)
  logging.getLogger("absl").addHandler(sink)
  return read_fd, sink
