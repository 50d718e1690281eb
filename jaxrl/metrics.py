"""Run metrics: pass@k, and the writers (JSONL, TensorBoard, optional W&B) plus the run plot.

``pass_at_k`` is the public reference function of ALGORITHMS.md §8 (it lives in ``jaxrl.passk``).
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Mapping

import numpy as np

from jaxrl.passk import pass_at_k, pass_at_k_array  # noqa: F401  (public re-export)

log = logging.getLogger(__name__)


def _scalar(value) -> float | None:
  try:
    out = float(np.asarray(value))
  except (TypeError, ValueError):
    return None
  return out


class MetricsWriter:
  """Appends one JSON line per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard/W&B.

  On resume, lines from steps after the restored step are dropped first, so the file holds
  each step once even when a run was interrupted after logging but before checkpointing.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, wandb_project: str | None = None,
               config: dict | None = None, resume_step: int = 0):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._truncate_from(resume_step)
    self._file = open(self.path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
    self._wandb = None
    if wandb_project:
      try:
        import wandb
      except ImportError:
        log.warning("log.wandb is on but wandb is not installed; logging to JSONL/TensorBoard only")
      else:
        self._wandb = wandb.init(project=wandb_project, config=config, dir=workdir, resume="allow")

  def _truncate_from(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    with open(self.path, encoding="utf-8") as f:
      keep = [line for line in f if line.strip() and json.loads(line).get("step", -1) <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(keep)
    os.replace(tmp, self.path)

  def write(self, step: int, metrics: Mapping[str, object]) -> dict:
    row = {"step": int(step)}
    for key, value in metrics.items():
      if isinstance(value, (str, list)):
        row[key] = value
        continue
      scalar = _scalar(value)
      if scalar is not None:
        row[key] = scalar if math.isfinite(scalar) else str(scalar)
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    numeric = {k: v for k, v in row.items() if isinstance(v, float) and k != "step"}
    if self._tb is not None:
      for key, value in numeric.items():
        self._tb.add_scalar(key, value, step)
    if self._wandb is not None:
      self._wandb.log(numeric, step=step)
    return row

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_run(metrics_path: str, out_png: str,
             keys=("reward", "entropy_rollout", "informative_frac", "frac_all_correct",
                   "frac_all_wrong", "response_len", "kl", "clip_frac", "grad_norm")) -> str:
  """A grid of per-step curves (raw and smoothed) from metrics.jsonl, saved as a PNG.

  Curves that are zero throughout (KL without a reference, clipping in on-policy steps) are left out.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = read_jsonl(metrics_path)
  keys = [k for k in keys if any(isinstance(r.get(k), float) and r[k] != 0 for r in rows)]
  cols = 3
  fig, axes = plt.subplots(max(1, math.ceil(len(keys) / cols)), cols,
                           figsize=(4 * cols, 2.8 * max(1, math.ceil(len(keys) / cols))),
                           squeeze=False)
  for ax, key in zip(axes.flat, keys):
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float)]
    steps, values = np.array(pts).T
    ax.plot(steps, values, alpha=0.35, lw=0.8)
    if len(values) >= 10:
      w = max(len(values) // 20, 3)
      smooth = np.convolve(values, np.ones(w) / w, mode="valid")
      ax.plot(steps[w - 1:], smooth, lw=1.6)
    ax.set_title(key, fontsize=9)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(out_png, dpi=90)
  plt.close(fig)
  return out_png
