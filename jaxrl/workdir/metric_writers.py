"""The metric writers of a run (JSONL, TensorBoard, optional W&B) and the run's plot.

pass@k itself, the reference function of docs/algorithms.md §8, is ``jaxrl.metrics.pass_at_k``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import socket
import struct
import time
from typing import Mapping

import numpy as np

log = logging.getLogger(__name__)


def _scalar(value) -> float | None:
  try:
    out = float(np.asarray(value))
  except (TypeError, ValueError):
    return None
  return out


class _EventFile:
  """A TensorBoard event file of scalars, one event per step, written and flushed in the caller's
  thread, so a failed write raises here. (tensorboardX's SummaryWriter writes from a thread that
  dies on its first failed write; its queue of 10 events then fills and the next add_scalar blocks
  forever: a full disk hung the run. Its RecordWriter also fsyncs at every flush.)

  Records are TFRecord-framed ``Event`` protos: length, its masked CRC-32C, data, its masked
  CRC-32C, as TensorBoard reads them.
  """

  def __init__(self, logdir: str, purge_step: int | None):
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import masked_crc32c

    self._event, self._summary, self._crc = Event, Summary, masked_crc32c
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self._file = open(os.path.join(logdir, name), "ab")  # a run resumed in the same second appends
    self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
    if purge_step is not None:
      # A resumed run: TensorBoard hides the earlier files' events from this step on.
      self._write(
        Event(
          wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)
        )
      )
    self._file.flush()

  def _write(self, event) -> None:
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    self._file.write(
      header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data))
    )

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
    self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
    self._file.flush()

  def write_text(self, step: int, tag: str, text: str) -> None:
    """A text summary (TensorBoard's Text tab renders it as markdown)."""
    from tensorboardX.summary import text as text_summary

    self._write(self._event(wall_time=time.time(), step=step, summary=text_summary(tag, text)))
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def truncate_jsonl(path: str, step: int) -> None:
  """Drop the lines of steps after ``step`` (and lines a kill or a full disk cut short)."""
  if not os.path.exists(path):
    return
  keep = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      try:
        row = json.loads(line) if line.strip() else None
      except json.JSONDecodeError:  # torn by a kill or a full disk mid-line
        log.warning("%s:%d is not a JSON line (a write cut short); dropped", path, number)
        continue
      if row is not None and row.get("step", -1) <= step:
        keep.append(line if line.endswith("\n") else line + "\n")
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(keep)
  os.replace(tmp, path)


class MetricsError(RuntimeError):
  """metrics.jsonl could not be written (a full disk, a file-size limit, permissions)."""


class MetricsWriter:
  """Appends one JSON line per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard/W&B;
  a step's sample responses go to ``samples.jsonl`` (one line each) and TensorBoard's text tab.

  On resume, lines from steps after the restored step are dropped first (from both files), so
  each step appears once even when a run was interrupted after logging but before checkpointing.
  The W&B run id is kept in ``wandb_run_id``: a resumed run continues the same W&B run.

  Failures: a line that cannot be appended to metrics.jsonl raises ``MetricsError`` (the run
  stops before that step's checkpoint, so a resume redoes the step and loses nothing). TensorBoard
  is a mirror: when its events cannot be written it is dropped with one warning and training
  goes on.
  """

  def __init__(
    self,
    workdir: str,
    *,
    tensorboard: bool = True,
    wandb_project: str | None = None,
    config: dict | None = None,
    resume_step: int = 0,
  ):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.samples_path = os.path.join(workdir, "samples.jsonl")
    for path in (self.path, self.samples_path):
      truncate_jsonl(path, resume_step)
    self._file = open(self.path, "a", encoding="utf-8")
    self._samples = open(self.samples_path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      try:
        self._tb = _EventFile(
          os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None
        )
      except OSError as e:
        self._drop_tensorboard(e)
    self._wandb = _wandb_run(workdir, wandb_project, config) if wandb_project else None

  def write(self, step: int, metrics: Mapping[str, object], samples=()) -> dict:
    """The step's metrics row (as written) and its ``samples`` (dicts of text and numbers)."""
    row = {"step": int(step)}
    for key, value in metrics.items():
      if isinstance(value, (str, list)):
        row[key] = value
        continue
      scalar = _scalar(value)
      if scalar is not None:
        row[key] = scalar if math.isfinite(scalar) else str(scalar)
    try:
      self._file.write(json.dumps(row) + "\n")
      self._file.flush()
    except OSError as e:
      raise MetricsError(f"cannot append step {step} to {self.path}: {e}") from e
    self._write_samples(step, samples)
    numeric = {k: v for k, v in row.items() if isinstance(v, float) and k != "step"}
    if self._tb is not None:
      try:
        self._tb.write(step, numeric)
      except OSError as e:
        self._drop_tensorboard(e)
    if self._wandb is not None:
      self._wandb.log(numeric, step=step)
    return row

  def _write_samples(self, step: int, samples) -> None:
    if not samples:
      return
    try:
      self._samples.writelines(json.dumps({"step": int(step), **s}) + "\n" for s in samples)
      self._samples.flush()
    except OSError as e:
      raise MetricsError(f"cannot append step {step} to {self.samples_path}: {e}") from e
    if self._tb is not None:
      try:
        self._tb.write_text(step, "samples", _samples_markdown(samples))
      except OSError as e:
        self._drop_tensorboard(e)

  def _drop_tensorboard(self, error: OSError) -> None:
    log.warning(
      "cannot write TensorBoard events (%s); TensorBoard logging is off for the rest of "
      "this run, metrics.jsonl goes on",
      error,
    )
    if self._tb is not None:
      with contextlib.suppress(OSError):  # what is still buffered fails the same way
        self._tb.close()
    self._tb = None

  def close(self) -> None:
    for f in (self._file, self._samples):
      try:
        f.close()
      except OSError as e:  # the line that failed is still buffered: MetricsError said so
        log.warning("closing %s: %s", f.name, e)
    if self._tb is not None:
      try:
        self._tb.close()
      except OSError as e:
        self._drop_tensorboard(e)
    if self._wandb is not None:
      self._wandb.finish()


def _samples_markdown(samples) -> str:
  """A markdown table of a step's samples (cells escaped: a response may hold any text)."""
  cell = lambda x: str(x).replace("|", "\\|").replace("\n", " ")[:500]
  lines = ["| question | G | τ | reward | prompt | response |", "|---|---|---|---|---|---|"]
  for s in samples:
    lines.append(
      f"| {s['question']} | {s['group_size']} | {s['tau']:.2f} | {s['reward']:.2f} | "
      f"{cell(s['prompt'])} | {cell(s['response'])} |"
    )
  return "\n".join(lines)


def _wandb_run(workdir: str, project: str, config: dict | None):
  """A W&B run whose id lives in ``workdir/wandb_run_id``: a resumed run continues it."""
  import wandb  # the config check made sure it is installed

  id_path = os.path.join(workdir, "wandb_run_id")
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip()
  else:
    run_id = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
    with open(id_path + ".tmp", "w") as f:
      f.write(run_id)
    os.replace(id_path + ".tmp", id_path)
  return wandb.init(project=project, config=config, dir=workdir, id=run_id, resume="allow")


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_run(
  metrics_path: str,
  out_png: str,
  keys=(
    "reward",
    "entropy_rollout",
    "informative_frac",
    "frac_all_correct",
    "frac_all_wrong",
    "response_len",
    "kl",
    "clip_frac",
    "grad_norm",
    # each paper's own diagnostic (docs/algorithms.md §12)
    "entropy_rel_init",
    "entropy_tracking_error",
    "clip_saturated",
    "eepo_entropy_ratio",
    "dynamo_grad_var_ratio",
  ),
) -> str:
  """A grid of per-step curves (raw and smoothed) from metrics.jsonl, saved as a PNG.

  Curves that are zero throughout (KL without a reference, clipping in on-policy steps) are left
  out, and so are steps where a metric is absent or NaN (written "nan"): a curve that exists only
  on some steps (EEPO's ratio when its gate fires) is drawn through those.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = read_jsonl(metrics_path)
  keys = [k for k in keys if any(isinstance(r.get(k), float) and r[k] != 0 for r in rows)]
  cols = 3
  fig, axes = plt.subplots(
    max(1, math.ceil(len(keys) / cols)),
    cols,
    figsize=(4 * cols, 2.8 * max(1, math.ceil(len(keys) / cols))),
    squeeze=False,
  )
  for ax, key in zip(axes.flat, keys):
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float)]
    steps, values = np.array(pts).T
    ax.plot(steps, values, alpha=0.35, lw=0.8)
    if len(values) >= 10:
      w = max(len(values) // 20, 3)
      smooth = np.convolve(values, np.ones(w) / w, mode="valid")
      ax.plot(steps[w - 1 :], smooth, lw=1.6)
    ax.set_title(key, fontsize=9)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(keys) :]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(out_png, dpi=90)
  plt.close(fig)
  return out_png
