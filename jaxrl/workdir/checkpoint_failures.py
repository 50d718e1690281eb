"""A checkpoint write that fails or hangs, and a failure said in one line.

Every call into orbax that may wait for a write (save, wait, close) runs on one helper thread
(``OrbaxThread``) and is waited for at most the Checkpointer's ``settle_timeout`` seconds: on a
dead disk or a stalled log sink orbax's threads can block forever, and a trainer that hangs is
worse than one that says so. A write that does not settle in time counts as failed; its threads
are abandoned (``unsettled()``), and since they are not daemons the process must leave with
``os._exit`` (``jaxrl.main`` does).

A failed write's tmp directory is replaced by an empty file of the same name
(``replace_by_marker``): orbax reports a write's first error while tensorstore still flushes the
write's other files, each of which would recreate the directory it goes into; through the file
they fail instead. The file holds nothing and goes when the step is written again or a writer
next opens the directory (``remove_markers``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import queue
import re
import shutil
import threading
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

_abandoned: list[Future] = []  # calls into orbax given up on

TMP = ".orbax-checkpoint-tmp"  # what orbax appends to a step's name while writing it
# Times a failed write's tmp directory may come back between moving it aside and putting the
# marker in its place (each time, one of its late flushes created it again) before giving up.
_BURY_ATTEMPTS = 100


def unsettled() -> bool:
  """True while a checkpoint write given up on is still running: its (non-daemon) orbax threads
  would keep the interpreter from exiting."""
  return any(not f.done() for f in _abandoned)


class OrbaxThread:
  """The one thread that calls into orbax, so that the caller can stop waiting. One thread, not one
  per call: orbax keeps per-thread state (a failed write's error is raised once to each thread
  that waits for it), which must see the calls as the trainer's thread would have made them."""

  def __init__(self):
    self._calls: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._serve, name="jaxrl-checkpoint", daemon=True).start()

  def _serve(self):
    while (item := self._calls.get()) is not None:
      fn, result = item
      try:
        result.set_result(fn())
      except BaseException as e:  # noqa: BLE001 - handed to the caller
        result.set_exception(e)

  def stop(self) -> None:
    self._calls.put(None)

  def call(self, fn, timeout: float) -> tuple[Future | None, BaseException | None]:
    """Run ``fn()``, waiting at most ``timeout`` s: (its future if still running, else None; its
    error or None)."""
    result: Future = Future()
    self._calls.put((fn, result))
    try:
      error = result.exception(timeout)  # a Ctrl-C while waiting is raised here, as it should
    except FutureTimeout:
      _abandoned.append(result)
      return result, None
    return None, error


def brief(error: Exception) -> str:
  """The cause of a failed write in a line: the OS error when tensorstore reports one (its messages
  embed whole JSON specs), else the start of the message."""
  text = " ".join(str(error).split())
  code = re.search(r"\[os_error_code='?\d+'?\]", text)
  if code:
    start = text.rfind("Failed", 0, code.start())
    return text[max(start, 0) : code.end()]
  return f"{type(error).__name__}: {text[:300]}"


def root_cause(error: BaseException) -> str:
  """A read's failure in a line: its innermost cause (tensorstore's own error, e.g. a byte range
  past a truncated file's end), not orbax's wrapper and the JSON spec it embeds."""
  while error.__cause__ is not None:
    error = error.__cause__
  return brief(error)  # type: ignore[arg-type]


def tmp_paths(directory: str, step: int | None = None) -> list[str]:
  """Orbax's tmp directories (or ``_bury``'s markers) of ``step`` (None: of every step)."""
  name = "*" if step is None else str(step)
  return glob.glob(os.path.join(glob.escape(directory), f"{name}{TMP}*"))


def replace_by_marker(path: str, trash: str) -> None:
  """An empty file at ``path``; a directory there first leaves by one rename into ``trash`` (a
  flush inside it at that moment ends up there, not at ``path``) and is removed once the file
  stands, when nothing can enter it any more (or, the file refused, to free its space anyway)."""
  moved = []
  try:
    for _ in range(_BURY_ATTEMPTS):
      try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return
      except FileExistsError:
        if not os.path.isdir(path) or os.path.islink(path):
          return  # a marker already (another process of the run put it there)
      os.makedirs(trash, exist_ok=True)
      aside = os.path.join(trash, f"{os.path.basename(path)}.{uuid.uuid4().hex}")
      try:
        os.rename(path, aside)
        moved.append(aside)
      except FileNotFoundError:  # moved by another process, or the trash emptied meanwhile
        continue
    raise OSError(f"it came back {_BURY_ATTEMPTS} times")
  finally:
    for aside in moved:
      shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(OSError):  # the trash, unless something else is on its way out
      os.rmdir(trash)


def remove_markers(directory: str, step: int | None = None) -> None:
  """Remove ``_bury``'s markers (of ``step``; None: all), leaving orbax's tmp directories."""
  for path in tmp_paths(directory, step):
    if os.path.isfile(path) and not os.path.islink(path):
      try:
        os.unlink(path)
      except (FileNotFoundError, IsADirectoryError):  # another process of the run was first
        pass
