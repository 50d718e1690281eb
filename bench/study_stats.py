"""The statistics of the methods study (bench/methods_study.py): a bootstrap confidence interval
over seeds and questions, and a held-out score read at a token budget between evaluations.

Pure functions of arrays; the runs' files are read by the harness.
"""

from __future__ import annotations

import numpy as np


def bootstrap_ci(
  values_S: list, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
  """Mean and percentile interval of the mean score, resampling seeds and then questions.

  ``values_S[s]`` holds seed s's per-question scores (e.g. pass@k per held-out question; seeds may
  hold different numbers of questions). The statistic is the mean over seeds of each seed's mean
  over questions. One bootstrap replicate draws S seeds with replacement, then, for each of the S
  draws on its own (a seed drawn twice is resampled twice), its questions with replacement: the
  interval covers both the seed-to-seed spread of training and the finite question set. Returns
  (the statistic on the data, lower, upper)."""
  values_S = [np.asarray(v, np.float64) for v in values_S]
  num_seeds = len(values_S)
  point = float(np.mean([v.mean() for v in values_S]))
  rng = np.random.default_rng(seed)
  # slot_SxBxS[s, b, j]: the mean of a fresh question resample of seed s, were slot j of
  # replicate b to draw it; only the drawn seed's entry is read.
  slot_SxBxS = np.stack(
    [v[rng.integers(len(v), size=(resamples, num_seeds, len(v)))].mean(-1) for v in values_S]
  )
  drawn_BxS = rng.integers(num_seeds, size=(resamples, num_seeds))
  b_B, j_S = np.arange(resamples)[:, None], np.arange(num_seeds)[None, :]
  stat_B = slot_SxBxS[drawn_BxS, b_B, j_S].mean(-1)
  tail = 100 * (1 - level) / 2
  lower, upper = np.percentile(stat_B, [tail, 100 - tail])
  return point, float(lower), float(upper)


def cumulative_tokens(tokens_T, steps) -> np.ndarray:
  """Tokens generated before each of ``steps`` (step 0: the warm start, none), from the per-step
  counts ``tokens_T`` of RL steps 1..T."""
  total_T1 = np.concatenate([[0.0], np.cumsum(np.asarray(tokens_T, np.float64))])
  return total_T1[np.asarray(steps, np.int64)]


def at_budget(tokens_E, values_ExQ, budget: float) -> np.ndarray:
  """Per-question scores at ``budget`` tokens, interpolated linearly between the evaluations made
  after ``tokens_E`` tokens (increasing; per question, so the mean over questions interpolates
  alike). A budget outside the evaluated range is an error: nothing is extrapolated."""
  tokens_E = np.asarray(tokens_E, np.float64)
  values_ExQ = np.asarray(values_ExQ, np.float64)
  if not tokens_E[0] <= budget <= tokens_E[-1]:
    raise ValueError(f"budget {budget} outside the evaluated tokens {tokens_E[0]}..{tokens_E[-1]}")
  hi = min(int(np.searchsorted(tokens_E, budget, side="left")), len(tokens_E) - 1)
  lo = max(hi - 1, 0)
  if tokens_E[hi] == budget or hi == lo:
    return values_ExQ[hi]
  w = (budget - tokens_E[lo]) / (tokens_E[hi] - tokens_E[lo])
  return (1 - w) * values_ExQ[lo] + w * values_ExQ[hi]


def paired_t(d_S, level: float = 0.95) -> tuple[float, float, float, float]:
  """Mean of the per-seed differences ``d_S``, its two-sided Student t-interval (n − 1 degrees
  of freedom) and the two-sided p-value of mean 0: (mean, lower, upper, p). NaN interval and p
  with fewer than 2 seeds; a zero spread gives a zero-width interval (p 0, or 1 at mean 0)."""
  from scipy import stats

  d_S = np.asarray(d_S, np.float64)
  n, mean = len(d_S), float(np.mean(d_S)) if len(d_S) else float("nan")
  if n < 2:
    return mean, float("nan"), float("nan"), float("nan")
  if np.all(d_S == d_S[0]):  # no spread (exactly: the mean's rounding is no spread)
    return float(d_S[0]), float(d_S[0]), float(d_S[0]), 1.0 if d_S[0] == 0.0 else 0.0
  se = float(np.std(d_S, ddof=1) / np.sqrt(n))
  half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se
  p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
  return mean, mean - half, mean + half, p


def holm(p_M) -> np.ndarray:
  """Holm–Bonferroni adjusted p-values of the family ``p_M`` (reject where adjusted < α: the
  family-wise error rate is at most α). NaN p-values stay NaN and do not count in the family."""
  p_M = np.asarray(p_M, np.float64)
  out = np.full_like(p_M, np.nan)
  ok = np.flatnonzero(~np.isnan(p_M))
  m = len(ok)
  order = ok[np.argsort(p_M[ok], kind="stable")]
  running = 0.0
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (m - rank) * p_M[i]))
    out[i] = running
  return out
