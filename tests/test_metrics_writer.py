"""The metrics writer: scalars reach TensorBoard (read back from the event files), and under real
write failures (a file-size limit, ``file_size_limit``) TensorBoard is dropped with one warning
instead of hanging the run; a line that cannot be appended to metrics.jsonl is a clear error; a
line torn by a kill is dropped on resume."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import struct
import threading

import pytest

from jaxrl.workdir.metric_writers import MetricsError, MetricsWriter, read_jsonl

# 60 scalars: a 0.7 KB JSON line.
ROW = {f"k{i}": 0.5 for i in range(60)}


def read_events(logdir) -> list:
  """The events of every event file under ``logdir`` (TFRecord framing: length, its CRC, data,
  its CRC), in file-name order; a record cut short by a failed write ends its file."""
  from tensorboardX.proto.event_pb2 import Event

  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.*"))):
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8].ljust(8, b"\0"))
      if at + 12 + length + 4 > len(data):
        break
      events.append(Event.FromString(data[at + 12 : at + 12 + length]))
      at += 12 + length + 4
  return events


def scalars(events) -> dict:
  """{step: {tag: value}} of the summary events."""
  return {
    e.step: {v.tag: v.simple_value for v in e.summary.value}
    for e in events
    if e.HasField("summary")
  }


def _in_thread(fn, timeout: float = 60.0):
  """Run fn in a daemon thread: a hang fails the test instead of blocking the suite."""
  done, errors = threading.Event(), []

  def run():
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - re-raised below
      errors.append(e)
    done.set()

  threading.Thread(target=run, daemon=True).start()
  assert done.wait(timeout), f"{fn.__name__} did not return within {timeout} s (blocked)"
  if errors:
    raise errors[0]


def test_scalars_reach_tensorboard_and_a_resume_purges_the_steps_it_redoes(tmp_path):
  writer = MetricsWriter(str(tmp_path), tensorboard=True)
  for step in (1, 2, 3):
    writer.write(step, {"reward": step / 4, "note": "text is JSON only"})
  writer.close()
  resumed = MetricsWriter(str(tmp_path), tensorboard=True, resume_step=2)
  resumed.write(3, {"reward": 0.0})
  resumed.close()
  events = read_events(tmp_path / "tensorboard")
  assert scalars(events) == {1: {"reward": 0.25}, 2: {"reward": 0.5}, 3: {"reward": 0.0}}
  (purge,) = [e for e in events if e.HasField("session_log")]
  assert purge.step == 3 and purge.session_log.status == purge.session_log.START


def test_samples_go_to_their_jsonl_and_tensorboard_text_once_per_step(tmp_path):
  sample = lambda step: {"question": step, "prompt": "1+2=", "response": "3|x", "reward": 1.0}
  table = lambda step: {**sample(step), "group": 0, "group_size": 8, "tau": 1.0}
  writer = MetricsWriter(str(tmp_path), tensorboard=True)
  for step in (1, 2, 3):
    writer.write(step, {"reward": 0.5}, [table(step)])
  writer.close()
  resumed = MetricsWriter(str(tmp_path), tensorboard=True, resume_step=2)  # step 3 is redone
  resumed.write(3, {"reward": 0.5}, [table(30)])
  resumed.close()
  with open(tmp_path / "samples.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [(r["step"], r["question"]) for r in rows] == [(1, 1), (2, 2), (3, 30)]
  texts = [
    (e.step, v.tensor.string_val[0].decode())
    for e in read_events(tmp_path / "tensorboard")
    for v in e.summary.value
    if v.tag.startswith("samples")
  ]
  assert [step for step, _ in texts] == [1, 2, 3, 3]  # TensorBoard hides the purged step-3 event
  assert "| 30 | 8 | 1.00 | 1.00 | 1+2= | 3\\|x |" in texts[-1][1]  # a cell's | escaped


def test_tensorboard_that_cannot_be_written_is_dropped_and_the_run_goes_on(
  tmp_path, file_size_limit, caplog
):
  writer = MetricsWriter(str(tmp_path), tensorboard=True)
  small = {"reward": 0.5}
  for step in range(1, 51):
    writer.write(step, small)
  (events_path,) = glob.glob(str(tmp_path / "tensorboard" / "events.*"))
  # An event (wall time, step, framing) is larger than its JSON line, so after 50 steps a limit
  # just past the event file fails the next event and leaves room for more JSON lines.
  limit = os.path.getsize(events_path) + 10
  assert os.path.getsize(tmp_path / "metrics.jsonl") + 3 * (len(json.dumps(small)) + 14) < limit
  file_size_limit(limit)

  def two_steps():
    for step in (51, 52):
      writer.write(step, small)

  with caplog.at_level(logging.WARNING, logger="jaxrl.metrics"):
    _in_thread(two_steps)  # tensorboardX's SummaryWriter blocked forever here
    file_size_limit(None)
    writer.write(53, small)
    writer.close()
  warnings = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
  assert len(warnings) == 1 and "File too large" in warnings[0], warnings
  assert "TensorBoard logging is off for the rest of this run" in warnings[0]
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert rows == [{"step": s, **small} for s in range(1, 54)]
  assert list(scalars(read_events(tmp_path / "tensorboard"))) == list(range(1, 51))  # kept


def test_a_line_that_cannot_be_appended_is_an_error_naming_the_file(tmp_path, file_size_limit):
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(1, ROW)
  file_size_limit(1_000)
  with pytest.raises(
    MetricsError,
    match=r"cannot append step 2 to .*metrics\.jsonl: .*File too "
    r"large",
  ):
    writer.write(2, ROW)
  writer.close()  # the unwritten line is dropped with a warning, not raised again
  file_size_limit(None)
  # The resumed run (from a checkpoint at step 1) drops the torn line and appends after step 1.
  resumed = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=1)
  resumed.write(2, ROW)
  resumed.close()
  assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_resume_drops_a_torn_line_and_later_steps(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s, "reward": s / 10}) for s in (1, 2, 3)]
  path.write_text("\n".join(lines) + "\n" + '{"step": 4, "rew')  # killed mid-line
  with caplog.at_level(logging.WARNING, logger="jaxrl.metrics"):
    writer = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=2)
  writer.write(3, {"reward": 0.5})
  writer.close()
  assert read_jsonl(str(path)) == [
    {"step": 1, "reward": 0.1},
    {"step": 2, "reward": 0.2},
    {"step": 3, "reward": 0.5},
  ]
  assert any("metrics.jsonl:4 is not a JSON line" in r.getMessage() for r in caplog.records)


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")  # no network here: the run is written locally
  monkeypatch.setenv("WANDB_SILENT", "true")
  first = MetricsWriter(str(tmp_path), tensorboard=False, wandb_project="jaxrl", config={"seed": 0})
  first.write(1, {"reward": 0.25})
  run_id = first._wandb.id
  first.close()
  with open(tmp_path / "wandb_run_id") as f:
    assert f.read() == run_id
  resumed = MetricsWriter(str(tmp_path), tensorboard=False, wandb_project="jaxrl", resume_step=1)
  assert resumed._wandb.id == run_id
  resumed.write(2, {"reward": 0.5})
  resumed.close()
  runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
  # offline-run-DATE_TIME-ID; wandb appends "-1" to the second when both start in the same second
  same_run = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
  assert len(runs) == 2 and all(same_run.fullmatch(os.path.basename(r)) for r in runs), runs
