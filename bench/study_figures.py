"""The methods study's figures (bench/methods_study.py): one PNG per paper per task, each showing
the paper's own per-step diagnostic (docs/algorithms.md §12) from the cells' ``series``.

A curve is the mean over a method's seeds with a min–max band; steps where a metric is NaN
(``None`` in a record) are left out of the mean, so a metric measured on some steps only (DynaMO's
ratio, EEPO's ratio when its gate fired) is drawn through the steps that have it. A figure whose
metric no record carries (older records have no ``series``) is not written.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only: the study runs without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.study_report import scores  # noqa: E402

# The per-step metrics a cell's record keeps (jaxrl/run/records.py, jaxrl/rollout/eepo.py,
# jaxrl/run/loop.py write them to metrics.jsonl).
SERIES_KEYS = (
  "frac_all_wrong",  # E3: groups with every rollout wrong
  "entropy_rel_init",  # E3: H/H_init
  # DynaMO: on the steps diagnostics.grad_variance_every measured (0, never, unless a run sets it)
  "dynamo_grad_var_ratio",
  "eepo_entropy_ratio",  # EEPO: H_stage2/H_stage1 on the steps its gate fired
  "entropy_rollout",  # H_t, the entropy the clip controller steers
  "clip_target",  # ES: the entropy schedule S(t)
  "entropy_tracking_error",  # ES: (H − S(t))/S(t)
  "clip_saturated",  # ES: 1 where ε_high sits at c_min or c_max
  "eps_high",
)
KS = (1, 8, 32)


def _has(rec: dict, key: str) -> bool:
  return key in rec.get("series", {})


def _methods_with(records: list[dict], key: str, first=()) -> list[str]:
  """The methods some record of which logged ``key``, ``first`` ones leading (the paper's own)."""
  logged = list(dict.fromkeys(r["method"] for r in records if _has(r, key)))
  return [m for m in first if m in logged] + [m for m in logged if m not in first]


def _color(records: list[dict], method: str) -> str:
  """The method's color in every panel and figure of a task: its place among the records'."""
  return f"C{list(dict.fromkeys(r['method'] for r in records)).index(method) % 10}"


def seed_stats(records: list[dict], method: str, key: str):
  """(steps, mean, min, max) over ``method``'s seeds of ``key`` per step, on the steps some seed
  has a value; None when no seed logged it."""
  runs = [r["series"][key] for r in records if r["method"] == method and _has(r, key)]
  if not runs:
    return None
  length = max(len(v) for v in runs)
  vals_SxT = np.full((len(runs), length), np.nan)
  for s, v in enumerate(runs):
    vals_SxT[s, : len(v)] = [np.nan if x is None else x for x in v]
  steps = np.flatnonzero(~np.isnan(vals_SxT).all(0))
  v = vals_SxT[:, steps]
  return steps + 1, np.nanmean(v, 0), np.nanmin(v, 0), np.nanmax(v, 0)


def _curve(ax, records, method, key, label=None, **style) -> None:
  """The seeds' mean of ``key`` with its min–max band (nothing when the method did not log it)."""
  stats = seed_stats(records, method, key)
  if stats is None:
    return
  steps, mean, lo, hi = stats
  style.setdefault("color", _color(records, method))
  ax.plot(steps, mean, label=label or method, **style)
  ax.fill_between(steps, lo, hi, color=style["color"], alpha=0.15, linewidth=0)


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # only once a figure has data
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def e3_figure(records: list[dict], path: str) -> str | None:
  """E3: the share of all-wrong groups and H/H_init over steps, e3 against the other methods."""
  if not _methods_with(records, "entropy_rel_init"):
    return None
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, key in zip(axes, ("frac_all_wrong", "entropy_rel_init")):
    for m in _methods_with(records, key, first=("e3", "grpo")):
      _curve(ax, records, m, key)
    ax.set(xlabel="step", ylabel=key, title=f"E3: {key}")
  axes[0].legend(fontsize="small")
  return _save(fig, path)


def dynamo_figure(records: list[dict], path: str) -> str | None:
  """DynaMO: the gradient-variance ratio on the steps it was measured; below 1 the method's
  allocation lowered the variance."""
  methods = _methods_with(records, "dynamo_grad_var_ratio", first=("dynamo",))
  if not methods:
    return None
  fig, ax = plt.subplots(figsize=(6, 4))
  for m in methods:
    _curve(ax, records, m, "dynamo_grad_var_ratio", marker="o")
  ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
  ax.set(xlabel="step", ylabel="dynamo_grad_var_ratio", title="DynaMO: gradient-variance ratio")
  ax.legend(fontsize="small")
  return _save(fig, path)


def final_pass_at_k(records: list[dict], method: str, k: int):
  """(mean, min, max) over ``method``'s seeds of the last evaluation's pass@k."""
  vals = [scores(r["evals"][-1], k).mean() for r in records if r["method"] == method]
  return float(np.mean(vals)), float(np.min(vals)), float(np.max(vals))


def _pass_at_k_bars(ax, records, methods) -> None:
  """Final held-out pass@k per method, for the k every cell's samples allow (error bars: seeds'
  min–max)."""
  ks = [k for k in KS if all(r["evals"][-1]["num_samples"] >= k for r in records)]
  width = 0.8 / len(methods)
  for i, m in enumerate(methods):
    mean, lo, hi = np.array([final_pass_at_k(records, m, k) for k in ks]).T
    x = np.arange(len(ks)) + i * width
    yerr = np.maximum([mean - lo, hi - mean], 0)  # a rounding below 0 where the seeds agree
    ax.bar(x, mean, width, yerr=yerr, label=m, capsize=3, color=_color(records, m))
  ax.set_xticks(np.arange(len(ks)) + 0.4 - width / 2, [f"pass@{k}" for k in ks])
  ax.set(ylabel="held-out, after the last step", title="EEPO: final pass@k")
  ax.legend(fontsize="small")


def eepo_figure(records: list[dict], path: str) -> str | None:
  """EEPO: H_stage2/H_stage1 on the steps the gate fired (every seed's points), and final pass@k,
  where exploration shows at large k."""
  logged = _methods_with(records, "eepo_entropy_ratio", first=("eepo",))
  if not logged:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for m in logged:
    pts = [
      (t + 1, v)
      for r in records
      if r["method"] == m and _has(r, "eepo_entropy_ratio")
      for t, v in enumerate(r["series"]["eepo_entropy_ratio"])
      if v is not None
    ]
    axes[0].scatter(*zip(*pts), s=12, label=m, color=_color(records, m))
  axes[0].axhline(1.0, color="gray", linestyle="--", linewidth=1)
  axes[0].set(xlabel="step", ylabel="eepo_entropy_ratio", title="EEPO: stage-2 / stage-1 entropy")
  axes[0].legend(fontsize="small")
  bars = [
    m for m in ("grpo", "informative_only", *logged) if any(r["method"] == m for r in records)
  ]
  _pass_at_k_bars(axes[1], records, bars)
  return _save(fig, path)


def _shade_runs(ax, steps, mask) -> None:
  """One span per run of consecutive masked steps (a span per step would draw hundreds)."""
  edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
  for start, stop in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
    ax.axvspan(steps[start] - 0.5, steps[stop - 1] + 0.5, color="red", alpha=0.1, linewidth=0)


def _feasible_band(ax, records) -> None:
  """The entropies the fixed clip bounds reach (es_floor, es_ceiling): the range ES's target must
  lie in for the controller to track it."""
  floor = seed_stats(records, "es_floor", "entropy_rollout")
  ceiling = seed_stats(records, "es_ceiling", "entropy_rollout")
  if floor is None or ceiling is None:
    return
  steps = np.intersect1d(floor[0], ceiling[0])
  lo, hi = (np.interp(steps, s[0], s[1]) for s in (floor, ceiling))
  ax.fill_between(
    steps, np.minimum(lo, hi), np.maximum(lo, hi), color="green", alpha=0.15, linewidth=0,
    label="feasible (ε_high at c_min … c_max)",
  )  # fmt: skip


def es_figure(records: list[dict], path: str) -> str | None:
  """Entropy Scheduling: the entropy against its target (steps with ε_high at a bound in at least
  half the seeds shaded), and ε_high, beside the fixed bounds' runs when the study has them."""
  if seed_stats(records, "es", "clip_target") is None:
    return None
  fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  _feasible_band(axes[0], records)
  _curve(axes[0], records, "es", "entropy_rollout", label="es: entropy")
  _curve(axes[0], records, "es", "clip_target", label="es: target", linestyle="--", color="k")
  saturated = seed_stats(records, "es", "clip_saturated")
  if saturated is not None:
    _shade_runs(axes[0], saturated[0], saturated[1] >= 0.5)
  title = "Entropy Scheduling: entropy vs its target (shaded: ε_high at a bound)"
  axes[0].set(ylabel="rollout entropy", title=title)
  axes[0].legend(fontsize="small")
  for m in ("es", "es_floor", "es_ceiling"):
    _curve(axes[1], records, m, "eps_high")
  axes[1].set(xlabel="step", ylabel="eps_high")
  axes[1].legend(fontsize="small")
  return _save(fig, path)


PAPERS = {"e3": e3_figure, "dynamo": dynamo_figure, "eepo": eepo_figure, "es": es_figure}


def figures(records: list[dict], out_dir: str) -> list[str]:
  """Every paper's figure for every task under ``out_dir`` (``TASK_PAPER.png``): the paths
  written, without the figures no record has the data for."""
  written = []
  for task in dict.fromkeys(r["task"] for r in records):
    recs = [r for r in records if r["task"] == task]
    for paper, draw in PAPERS.items():
      path = draw(recs, os.path.join(out_dir, f"{task}_{paper}.png"))
      written += [path] if path else []
  return written
