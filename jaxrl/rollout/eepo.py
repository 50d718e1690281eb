"""EEPO's two-stage rollouts (docs/algorithms.md §5): sample → gate → forget → sample.

Stage 1 samples half of each question's rollouts (``eepo_stage1_counts``: exactly R/2 rows); the
gate reads their entropy; when it fires, one ascent step on the unlearning objective gives θ', the
engine samples stage 2 from θ' (version ``engine.forget_version(v)`` of step version v: negative,
so a vLLM engine with ``sync_every`` always pushes it and the step after it), and the two stages
are concatenated. Behaviour log-probs (ℓ_μ) are θ's for stage 1 and θ''s for stage 2. For an
on-policy batch (``score``), ℓ_prox of stage 2 is θ''s (``eepo.old_logp_from = "rollout"``, the
paper) or recomputed under θ (``"policy"``); a stale batch gets no ℓ_prox here: the loop rescores
both stages under the params its update starts from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.methods.controllers import eepo_stage1_counts
from jaxrl.rl.paper_metrics import eepo_entropy_ratio
from jaxrl.rl.programs import ForgetConfig
from jaxrl.rollout.collect import Collector, token_mean_entropy
from jaxrl.rollout.engine import forget_version
from jaxrl.types import Rollouts


@dataclasses.dataclass(frozen=True)
class TwoStage:
  """What EEPO adds to a step: the rollouts, the gate's new state and the step's EEPO metrics."""

  rollouts: Rollouts
  gate_state: object
  metrics: dict


def two_stage_rollouts(
  collector: Collector,
  gate,
  gate_state,
  params,
  ids_BxP,
  mask_BxP,
  counts_B,
  tau,
  key,
  *,
  version: int,
  max_new_tokens: int,
  forget: ForgetConfig,
  old_logp_from: str,
  score: bool = True,
  qids_B=None,
) -> TwoStage:
  """``gate(gate_state, H_stage1) → (fire, gate_state)`` is the jitted EEPO gate controller;
  ``version``: the weight version of ``params`` (a training step's)."""

  def stage(theta, theta_version: int, stage_counts_B, index: int, scored: bool) -> Rollouts:
    return collector.sample(
      theta,
      theta_version,
      ids_BxP,
      mask_BxP,
      stage_counts_B,
      tau,
      jax.random.fold_in(key, index),
      max_new_tokens,
      score=scored,
      qids_B=qids_B,
    )

  counts1_B = eepo_stage1_counts(counts_B)
  # Stage 1 is always scored: the gate reads its entropy under the sampling params.
  out1 = stage(params, version, counts1_B, 1, True)
  h1 = token_mean_entropy(out1)
  fire, gate_state = gate(gate_state, h1)
  unlearn, params2, version2 = float("nan"), params, version
  if bool(fire):
    params2, unlearn = collector.forget(params, out1, tau, forget)
    version2 = forget_version(version)
  out2 = stage(params2, version2, counts_B - counts1_B, 2, score)
  policy_prox = score and bool(fire) and old_logp_from == "policy"
  out = _joined(collector, params, out1, out2, tau, score=score, policy_prox=policy_prox)
  # (a stale batch from a server that gives no entropies has none to read until it is rescored)
  h2 = token_mean_entropy(out2) if score or collector.engine.provides_entropy else float("nan")
  return TwoStage(out, gate_state, _metrics(out1, h1, h2, fire, unlearn))


def _metrics(out1: Rollouts, h1: float, h2: float, fire, unlearn) -> dict:
  """The step's EEPO metrics: the gate, the forgetting step and the two stages' entropies."""
  return {
    "eepo_gate": float(bool(fire)),
    "eepo_unlearn_loss": float(unlearn),
    # the forgetting step's compute: each stage-1 model token forwarded and differentiated once
    "eepo_unlearn_tokens": float(jnp.sum(out1.loss_mask_RxN)) if bool(fire) else 0.0,
    "entropy_stage1": h1,
    "entropy_stage2": h2,
    "eepo_entropy_ratio": eepo_entropy_ratio(h1, h2, fire),
  }


def _joined(collector: Collector, params, out1, out2, tau, *, score: bool, policy_prox: bool):
  """The two stages' rows in one batch: a stale one (not ``score``) without ℓ_prox, and with
  ``policy_prox`` ℓ_prox under θ for both stages (``eepo.old_logp_from = "policy"``)."""
  if not score:
    out1 = dataclasses.replace(out1, prox_logp_RxN=None)
  out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out1, out2)
  if policy_prox:
    prox, _ = collector.logp(params, out, tau)
    out = dataclasses.replace(out, prox_logp_RxN=prox)
  return out
