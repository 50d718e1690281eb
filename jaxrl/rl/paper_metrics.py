"""Each paper's own diagnostic of a step (docs/algorithms.md §12): host-side floats, never jitted.

A value the step cannot define (no H_init yet, no schedule, a gate that did not fire) is NaN:
metrics.jsonl writes it as "nan", and the plot and the summaries skip it, as for any metric a
step does not have.
"""

from __future__ import annotations

import math

NAN = float("nan")


def _ratio(num, den) -> float:
  """num/den, NaN when either is NaN or den is 0 (nothing to compare against)."""
  num, den = float(num), float(den)
  if math.isnan(num) or math.isnan(den) or den == 0.0:
    return NAN
  return num / den


def entropy_rel_init(h, h_init) -> float:
  """E3 Fig. 1 (§4.2): the step's rollout entropy relative to H_init = H_1, H/H_init."""
  return _ratio(h, h_init)


def entropy_tracking_error(h, h_target) -> float:
  """Entropy Scheduling: how far the entropy sits from the schedule, (H − S(t))/S(t)."""
  return _ratio(float(h) - float(h_target), h_target)


def eepo_entropy_ratio(h_stage1, h_stage2, fired) -> float:
  """EEPO: H_stage2/H_stage1 on a step whose gate fired (stage 2 sampled by the unlearned θ')."""
  return _ratio(h_stage2, h_stage1) if bool(fired) else NAN
