"""The second edition's numbers (bench/study_protocol.md) from its cells' records: phase A's
calibration, each arm's metrics, the paired seed-level t-intervals against the baseline, Holm's
adjustment over the four primary comparisons, and the decision rule's verdicts.

Pure functions of the records (``bench/methods_study2.py`` reads and writes the files).
"""

from __future__ import annotations

import numpy as np

from bench.study_report import scores
from bench.study_stats import holm, paired_t

BASELINE = "baseline"
PRIMARY_TASK = "countdown"
ES_WINDOW = (201, 400)  # steps of the ES tracking error, inclusive
ALPHA = 0.05
NARROW = 0.01  # a feasible ES range narrower than this (nats): ε_high cannot steer entropy


def _nanmean(x) -> float:
  """The mean of the values that are not NaN; NaN (without a warning) when none is."""
  x = np.asarray(x, np.float64)
  x = x[~np.isnan(x)]
  return float(x.mean()) if len(x) else float("nan")


def _series(rec: dict, key: str) -> np.ndarray:
  """A per-step metric of the record, NaN where absent."""
  values = rec.get("series", {}).get(key)
  if values is None:
    return np.full(rec["steps"], np.nan)
  return np.array([np.nan if v is None else v for v in values], np.float64)


# -- phase A -----------------------------------------------------------------------------------


def calibrate(recs_by_arm: dict) -> dict:
  """ES's target (the midpoint of the feasible range, each end the mean over seeds of the last
  100 steps' entropy with ε_high fixed at c_min / c_max) and EEPO's gate α (0.9 × the median of
  the baseline's per-step entropies over steps 1–50, all seeds pooled), each rounded to 3
  decimals, with what they came from."""

  def tail(rec):
    return _nanmean(_series(rec, "entropy_rollout")[-100:])

  ends = {arm: {r["seed"]: tail(r) for r in recs_by_arm[arm]} for arm in ("es_floor", "es_ceiling")}
  h_floor, h_ceiling = (float(np.mean(list(ends[a].values()))) for a in ("es_floor", "es_ceiling"))
  low, high = sorted((h_floor, h_ceiling))
  early = np.concatenate([_series(r, "entropy_rollout")[:50] for r in recs_by_arm[BASELINE]])
  median = float(np.nanmedian(early))
  return dict(
    seeds=sorted(ends["es_floor"]),
    h_floor_by_seed=ends["es_floor"],
    h_ceiling_by_seed=ends["es_ceiling"],
    h_floor=h_floor,
    h_ceiling=h_ceiling,
    es_testable=high - low >= NARROW,
    es_target=round((low + high) / 2, 3),
    baseline_early_median=median,
    eepo_alpha=round(0.9 * median, 3),
  )


def calibration_text(cal_by_task: dict) -> str:
  lines = [
    "# Methods study, second edition: phase A calibration",
    "",
    "Computed by `bench/methods_study2.py calibrate` from phase A's records",
    "(`methods_study2_cells.jsonl`, arms `baseline`, `es_floor`, `es_ceiling`) by the rule of",
    "`bench/study_protocol.md`, before any phase-B cell ran. Entropy: the rollout's token-mean",
    "entropy at τ (`entropy_rollout`), nats.",
    "",
    "| task | seeds | H at ε_high = 0.2 (floor) | H at ε_high = 0.4 (ceiling) | ES target | "
    "ES testable | baseline median H, steps 1–50 | EEPO α |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for task, c in cal_by_task.items():
    lines.append(
      f"| {task} | {', '.join(map(str, c['seeds']))} | {c['h_floor']:.4f} | {c['h_ceiling']:.4f} "
      f"| {c['es_target']:.3f} | {'yes' if c['es_testable'] else 'no (range < 0.01)'} "
      f"| {c['baseline_early_median']:.4f} | {c['eepo_alpha']:.3f} |"
    )
  return "\n".join(lines) + "\n"


# -- per-cell metrics ----------------------------------------------------------------------------


def final_pass(rec: dict, k: int) -> float:
  """Mean held-out pass@k over questions at the record's last evaluation."""
  last = max(rec["evals"], key=lambda e: e["step"])
  return float(np.mean(scores(last, k)))


def allocation_acted(rec: dict) -> tuple[float, float]:
  """The share of steps after the first pass over the questions (epoch ≥ 1) whose counts were
  not uniform, and their mean ``alloc_std`` (NaN when none were)."""
  epoch_T, std_T = _series(rec, "epoch"), _series(rec, "alloc_std")
  later = epoch_T >= 1
  if not later.any():
    return 0.0, float("nan")
  uneven = later & (std_T > 0)
  return float(uneven.sum() / later.sum()), float(std_T[uneven].mean()) if uneven.any() else np.nan


def tracking_error(rec: dict, target: float) -> float:
  """Mean |H_t − target| over ``ES_WINDOW``."""
  h = _series(rec, "entropy_rollout")[ES_WINDOW[0] - 1 : ES_WINDOW[1]]
  return _nanmean(np.abs(h - target))


def clip_binds(rec: dict) -> float:
  """The share of steps on which the clip bound at least one token."""
  return float(np.mean(_series(rec, "clip_frac") > 0))


def gate_fired(rec: dict) -> float:
  return _nanmean(_series(rec, "eepo_gate"))


def grad_var_ratios(rec: dict) -> np.ndarray:
  """DynaMO's gradient-variance ratios on the measured steps whose counts were not uniform."""
  ratio_T, std_T = _series(rec, "dynamo_grad_var_ratio"), _series(rec, "alloc_std")
  return ratio_T[np.isfinite(ratio_T) & (ratio_T > 0) & (std_T > 0)]


def mini_batches(rec: dict) -> int:
  """Optimizer updates per step: the ``es`` preset's 2, or the record's override."""
  for o in rec.get("overrides", []):
    if o.startswith("loss.mini_batches="):
      return int(o.split("=", 1)[1])
  return 2 if rec.get("config", "").startswith("configs/tiny.py:es") else 1


def compute(rec: dict) -> dict:
  """The protocol's compute in tokens: generated; the forgetting step's (each stage-1 token
  forwarded and differentiated once); and those of every optimizer update beyond a step's first
  (with m mini-batches, (m − 1)/m of the step's tokens)."""
  generated = float(np.nansum(_series(rec, "generated_tokens")))
  m = mini_batches(rec)
  return dict(
    generated=generated,
    unlearn=float(np.nansum(_series(rec, "eepo_unlearn_tokens"))),
    extra_updates=generated * (m - 1) / m,
  )


# -- comparisons ---------------------------------------------------------------------------------


def paired(recs: list[dict], arm: str, metric) -> dict:
  """``metric(arm) − metric(baseline)`` seed by seed over the seeds both ran, and its t-interval."""
  by = {(r["method"], r["seed"]): r for r in recs}
  seeds = sorted(s for (m, s) in by if m == arm and (BASELINE, s) in by)
  d_S = [metric(by[(arm, s)]) - metric(by[(BASELINE, s)]) for s in seeds]
  mean, lo, hi, p = paired_t(d_S)
  return dict(seeds=seeds, mean=mean, lower=lo, upper=hi, p=p)


def primaries(recs: list[dict], cal: dict) -> dict:
  """P1–P4 of the protocol on the primary task, with Holm-adjusted p-values. ``direction``: the
  sign of the paper's claim (+1: the arm's metric above the baseline's)."""
  target = cal["es_target"]
  comps = {
    "P1": ("e3", "pass@1", lambda r: final_pass(r, 1), +1),
    "P2": ("dynamo", "pass@1", lambda r: final_pass(r, 1), +1),
    "P3": ("eepo_paper", "pass@32", lambda r: final_pass(r, 32), +1),
    "P4": ("es", "ES tracking error", lambda r: tracking_error(r, target), -1),
  }
  out = {
    name: dict(arm=arm, metric=label, direction=sign, **paired(recs, arm, fn))
    for name, (arm, label, fn, sign) in comps.items()
  }
  adjusted = holm([c["p"] for c in out.values()])
  for c, adj in zip(out.values(), adjusted):
    c["p_holm"] = float(adj)
    c["rejects"] = bool(adj < ALPHA and np.sign(c["mean"]) == c["direction"])
  return out


def _arm_recs(recs: list[dict], arm: str) -> list[dict]:
  return [r for r in recs if r["method"] == arm]


def _range(cal: dict, sep: str = "–") -> str:
  """ES's reachable entropies, low to high (ε_high's floor need not give the lower one)."""
  low, high = sorted((cal["h_floor"], cal["h_ceiling"]))
  return f"{low:.3f}{sep}{high:.3f}"


def mechanisms(recs: list[dict], cal: dict) -> dict:
  """Whether each mechanism acted (the decision rule's preconditions), with the figure."""

  def mean_of(arm, fn):
    values = [fn(r) for r in _arm_recs(recs, arm)]
    return float(np.mean(values)) if values else float("nan")

  def at_least(value, threshold):  # None: no cell of the arm yet
    return None if np.isnan(value) else bool(value >= threshold)

  e3_alloc = mean_of("e3_allocation", lambda r: allocation_acted(r)[0])
  dyn_alloc = mean_of("dynamo_allocation", lambda r: allocation_acted(r)[0])
  fired = mean_of("eepo_paper", gate_fired)
  binds = mean_of("es", clip_binds)
  return {
    "e3_allocation": (
      at_least(e3_alloc, 0.5),
      f"counts not uniform on {100 * e3_alloc:.0f}% of later steps",
    ),
    "dynamo_allocation": (
      at_least(dyn_alloc, 0.5),
      f"counts not uniform on {100 * dyn_alloc:.0f}% of later steps",
    ),
    "eepo": (at_least(fired, 0.1), f"gate fired on {100 * fired:.1f}% of steps"),
    "es": (
      at_least(binds, 0.5) if cal["es_testable"] else False,
      f"target {cal['es_target']:.3f} in [{_range(cal, ', ')}]"
      f"{'' if cal['es_testable'] else ' (range < 0.01)'}; clip binds on {100 * binds:.0f}% of steps",
    ),
  }


# -- the report ----------------------------------------------------------------------------------


def _interval(c: dict, scale: float = 100.0, digits: int = 1) -> str:
  if not c["seeds"]:
    return "—"
  f = f"{{:+.{digits}f}}"
  if np.isnan(c["lower"]):
    return f"{f.format(scale * c['mean'])} (n={len(c['seeds'])})"
  return (
    f"{f.format(scale * c['mean'])} [{f.format(scale * c['lower'])}, "
    f"{f.format(scale * c['upper'])}] (n={len(c['seeds'])})"
  )


def arm_table(recs: list[dict], arms: dict) -> list[str]:
  lines = [
    "| arm | seeds | pass@1 | Δ pass@1 [95% t] | pass@32 | Δ pass@32 [95% t] | "
    "uneven counts (later steps) | gate fired | clip binds | tokens (M) |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for arm in arms:
    mine = _arm_recs(recs, arm)
    if not mine:
      lines.append(f"| `{arm}` | 0 | | | | | | | | |")
      continue
    p1 = np.mean([final_pass(r, 1) for r in mine])
    p32 = np.mean([final_pass(r, 32) for r in mine])
    d1 = paired(recs, arm, lambda r: final_pass(r, 1))
    d32 = paired(recs, arm, lambda r: final_pass(r, 32))
    uneven = np.mean([allocation_acted(r)[0] for r in mine])
    fired = np.mean([gate_fired(r) for r in mine])
    binds = np.mean([clip_binds(r) for r in mine])
    tokens = np.mean([sum(compute(r).values()) for r in mine]) / 1e6
    base = arm == BASELINE
    lines.append(
      f"| `{arm}` | {len(mine)} | {100 * p1:.1f} | {'' if base else _interval(d1)} | "
      f"{100 * p32:.1f} | {'' if base else _interval(d32)} | {100 * uneven:.0f}% | "
      f"{'' if np.isnan(fired) else f'{100 * fired:.1f}%'} | {100 * binds:.0f}% | {tokens:.2f} |"
    )
  return lines


PRIMARY_SEEDS = 8  # bench/study_protocol.md: the decision rule reads seeds 0-7 of the primary task


def _verdict(c: dict, ok: bool, why: str) -> str:
  """The decision rule's verdict on a primary comparison, drawn only once all its seeds ran."""
  n = len(c["seeds"])
  if n < 2:
    return f"{n} seed(s) so far: no interval yet"
  if n < PRIMARY_SEEDS:
    return f"{n} of {PRIMARY_SEEDS} seeds so far: no verdict yet"
  if not ok:
    return f"not testable here ({why})"
  return "reproduced" if c["rejects"] else "not reproduced"


def verdicts(recs: list[dict], cal: dict) -> list[str]:
  prim = primaries(recs, cal)
  acted = mechanisms(recs, cal)
  lines = [
    "| comparison | arm | metric (paper's direction) | Δ [95% t] | p | p (Holm) | verdict |",
    "|---|---|---|---|---|---|---|",
  ]
  testable = {
    "P1": (True, "E3's τ acts every step"),
    "P2": (True, "DynaMO's modulation acts every step"),
    "P3": acted["eepo"],
    "P4": acted["es"],
  }
  for name, c in prim.items():
    verdict = _verdict(c, *testable[name])
    scale, digits = (1.0, 4) if name == "P4" else (100.0, 1)
    sign = ">" if c["direction"] > 0 else "<"
    lines.append(
      f"| {name} | `{c['arm']}` | {c['metric']} Δ {sign} 0 | {_interval(c, scale, digits)} | "
      f"{c['p']:.3g} | {c['p_holm']:.3g} | {verdict} |"
    )
  lines += ["", "Whether each mechanism acted (the rule's precondition):", ""]
  said = {True: "acted", False: "did not act"}
  lines += [
    f"- `{m}`: {said[ok]}: {why}" if ok is not None else f"- `{m}`: no cell yet"
    for m, (ok, why) in acted.items()
  ]
  return lines


def report(records: list[dict], cal_by_task: dict, arms_by_task: dict) -> str:
  lines = [
    "# Methods study, second edition",
    "",
    "Run as `bench/study_protocol.md` fixes it, by `bench/methods_study2.py`; every number here is",
    "computed from `methods_study2_cells.jsonl` by `bench/study2_report.py`. Δ: the arm minus",
    "`baseline`, seed by seed, with the two-sided 95% Student t-interval over seeds (n seeds",
    "beside it); pass@k in % over the held-out questions at step 400.",
    "",
  ]
  for task, arms in arms_by_task.items():
    recs = [r for r in records if r["task"] == task]
    machines = sorted({r["machine"] for r in recs})
    kind = "primary" if task == PRIMARY_TASK else "secondary, exploratory"
    questions = sorted({len(max(r["evals"], key=lambda e: e["step"])["correct"]) for r in recs})
    lines += [
      f"## {task} ({kind})",
      "",
      f"Machines: {'; '.join(machines) or 'none yet'}. Held-out questions per seed: "
      f"{', '.join(map(str, questions)) or '—'}.",
      "",
    ]
    if task not in cal_by_task:
      lines += ["Phase A (calibration) under way: its arms so far.", ""]
    lines += arm_table(recs, arms) + [""]
    if task == PRIMARY_TASK and task in cal_by_task:
      lines += verdicts(recs, cal_by_task[task]) + [""]
  return "\n".join(lines)


# -- what README.md and docs/methods.md quote --------------------------------------------------------

BEGIN, END = "<!-- methods study: rendered by bench/methods_study2.py report -->", "<!-- end -->"
PAPERS = {"P1": "E3", "P2": "DynaMO", "P3": "EEPO (the paper's clip)", "P4": "Entropy Scheduling"}


def quoted(records: list[dict], cal_by_task: dict) -> str:
  """The study's state and verdicts as README.md and docs/methods.md quote them (between
  ``BEGIN`` and ``END``), every number computed from the records."""
  recs = [r for r in records if r["task"] == PRIMARY_TASK]
  if PRIMARY_TASK not in cal_by_task:
    return (
      f"Phase A (calibration) is under way on {PRIMARY_TASK}: {len(recs)} of its "
      f"{3 * 3} cells finished; no verdict yet."
    )
  cal = cal_by_task[PRIMARY_TASK]
  prim, acted = primaries(recs, cal), mechanisms(recs, cal)
  seeds = sorted({r["seed"] for r in recs if r["method"] == BASELINE})
  lines = [
    f"On {PRIMARY_TASK}, {len(recs)} cells so far ({len(seeds)} baseline seeds); ES's target "
    f"{cal['es_target']:.3f} (reachable: {_range(cal)}), EEPO's "
    f"α {cal['eepo_alpha']:.3f}. Δ: the arm minus the baseline, paired by seed, 95% t-interval:"
  ]
  testable = {"P3": acted["eepo"], "P4": acted["es"]}
  for name, c in prim.items():
    scale, digits = (1.0, 4) if name == "P4" else (100.0, 1)
    head = f"- **{PAPERS[name]}** (`{c['arm']}`, {c['metric']})"
    if len(c["seeds"]) < 2:
      lines.append(f"{head}: {len(c['seeds'])} seed(s) so far.")
      continue
    verdict = _verdict(c, *testable.get(name, (True, "")))
    lines.append(f"{head}: Δ {_interval(c, scale, digits)}, Holm p {c['p_holm']:.3g}: {verdict}.")
  return "\n".join(lines)


def replace_quoted(text: str, block: str) -> str:
  """``text`` with what lies between ``BEGIN`` and ``END`` replaced by ``block``."""
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{block}\n{END}{tail}"
