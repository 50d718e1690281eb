"""What orbax reports that a jaxrl user need not see: every read-only reader's notice that it
is read-only (what a reader asks for), and the tracebacks of the reads orbax drops once one read
of a damaged checkpoint fails (``Checkpointer.newest_readable`` reports that checkpoint once, in
a line). The read-only filter is installed on import; the rest by ``quiet_dropped_reads``.
"""

from __future__ import annotations

import gc
import logging
import sys
import warnings


class _ReadOnlyNotices(logging.Filter):
  """Drops orbax's warnings that a manager is read-only (and which of its options that turned
  off): every reader says so, and it is what a reader asks for."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not message.startswith(
      ("Given directory is read only", "CheckpointManagerOptions.read_only=True")
    )


logging.getLogger("absl").addFilter(_ReadOnlyNotices())

# Orbax reads a checkpoint's arrays in coroutines; when one read fails, the others are dropped
# unfinished and each prints its own traceback as it is collected, or as tensorstore's callback
# finds the read's event loop closed (hundreds of lines, more under load). A damaged checkpoint is
# reported once, by ``newest_readable``: those are silenced (only once a read has failed).
_READ_COROUTINE = "_read_array_index_and_device_put"


def _dropped_read(unraisable) -> bool:
  """A dropped read's own report: its coroutine collected, or its tensorstore callback finding
  the read's event loop already closed."""
  if getattr(unraisable.object, "__name__", None) == _READ_COROUTINE:
    return True
  return _dropped_read_error(unraisable.exc_value)


def _dropped_read_error(error) -> bool:
  """An error raised in a dropped read (its coroutine in the traceback) or by its callback."""
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True
  tb = getattr(error, "__traceback__", None)
  while tb is not None:
    if tb.tb_frame.f_code.co_name == _READ_COROUTINE:
      return True
    tb = tb.tb_next
  cause = getattr(error, "__cause__", None)
  return cause is not None and _dropped_read_error(cause)


class _DroppedReadFilter(logging.Filter):
  """asyncio logs a dropped read's task as "exception was never retrieved" when it is collected."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    context = getattr(record, "msg", "")
    return not (error is not None and _dropped_read_error(error)) and _READ_COROUTINE not in str(
      context
    )


def _quiet_excepthook(previous):
  """tensorstore's threads print what its Python callbacks raise through ``sys.excepthook``."""

  def hook(kind, error, tb):
    if not _dropped_read_error(error):
      previous(kind, error, tb)

  hook.quiets_orbax_reads = True
  return hook


def _quiet_unraisable(previous):
  def hook(unraisable):
    if not _dropped_read(unraisable):
      previous(unraisable)

  hook.quiets_orbax_reads = True
  return hook


def quiet_dropped_reads() -> None:
  """Install the filters (before a read: a failing read's callbacks report at once, from
  tensorstore's threads) and collect what a failed read dropped."""
  if not getattr(sys.unraisablehook, "quiets_orbax_reads", False):
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
  if not getattr(sys.excepthook, "quiets_orbax_reads", False):
    sys.excepthook = _quiet_excepthook(sys.excepthook)
  # ... and Python's "coroutine ... was never awaited" for the reads never started
  warnings.filterwarnings("ignore", message=f"coroutine '{_READ_COROUTINE}' was never awaited")
  asyncio_log = logging.getLogger("asyncio")  # "Task exception was never retrieved"
  if not any(isinstance(f, _DroppedReadFilter) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DroppedReadFilter())
  gc.collect()  # collect the dropped reads now, under the hook
