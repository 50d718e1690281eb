"""The run's log file (``jaxrl.workdir.run_log.RunLog``): a file that cannot be written any more (a real
EFBIG, ``file_size_limit``) is said once and dropped; a bad record is not mistaken for that."""

from __future__ import annotations

import logging

import pytest

from jaxrl.workdir.run_log import RunLog


@pytest.fixture
def run_log(tmp_path):
  path = tmp_path / "log.txt"
  handler = RunLog(str(path))
  logger = logging.getLogger("jaxrl.test_run_log")
  logger.propagate = False
  logger.addHandler(handler)
  yield logger, path, handler
  logger.removeHandler(handler)
  handler.close()


def test_a_log_file_that_cannot_be_written_is_said_once(run_log, file_size_limit, capsys):
  logger, path, _ = run_log
  logger.error("first")
  file_size_limit(path.stat().st_size + 10)
  for i in range(5):
    logger.error("record %d %s", i, "x" * 100)
  file_size_limit(None)
  err = capsys.readouterr().err
  assert err.count("jaxrl: cannot write the log file") == 1 and "File too large" in err, err
  assert "Traceback" not in err and "Logging error" not in err
  logger.error("after")  # dropped for good: no second line, nothing written
  assert "after" not in path.read_text() and capsys.readouterr().err == ""


def test_a_bad_record_does_not_turn_the_log_file_off(run_log, capsys):
  logger, path, handler = run_log
  # A library's formatting bug, straight to the handler (pytest's own capture handler re-raises).
  handler.handle(
    logging.makeLogRecord(
      {"msg": "bad %d", "args": ("not a number",), "levelno": logging.ERROR, "levelname": "ERROR"}
    )
  )
  logger.error("good")
  err = capsys.readouterr().err
  assert "cannot write the log file" not in err and "Logging error" in err
  assert "good" in path.read_text()
