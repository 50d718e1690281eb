"""Progress display: a rich progress bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from rich.progress import (
  BarColumn,
  MofNCompleteColumn,
  TextColumn,
  TimeElapsedColumn,
  TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

log = logging.getLogger(__name__)


class Progress:
  def __init__(self, enabled: bool = True):
    self.enabled = enabled

  @contextlib.contextmanager
  def task(self, description: str, total: int, completed: int = 0):
    """Yields ``advance(done, total, note="")``."""
    if self.enabled and sys.stderr.isatty():
      bar = RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        transient=False,
      )
      with bar:
        tid = bar.add_task(description, total=total, completed=completed, note="")
        yield lambda done, tot, note="": bar.update(tid, completed=done, total=tot, note=note)
      return
    last = [0.0]

    def advance(done, tot, note=""):
      now = time.time()
      if self.enabled and (now - last[0] > 10 or done == tot):
        last[0] = now
        log.info("%s %d/%d %s", description, done, tot, note)

    yield advance
