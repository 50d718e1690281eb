"""The update's config sections, beside the update (``step``, ``losses``, ``optim``): ``optim`` (AdamW,
clipping, the non-finite guard), ``loss`` (the GRPO-family objective: aggregation, clip, KL,
corrections, packing) and ``modulation`` (DynaMO's token-level advantage modulation, a term of the
loss).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxrl.fields import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range, check_ranges, need
from jaxrl.nn.sections import Dtype

# Allowed values, declared once beside their section (as in every ``sections`` module): the
# converter enforces them and the code that branches on them reads them there (``typing.get_args``).
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


KLEstimator = Literal["k1", "k2", "k3"]


# docs/algorithms.md §9: the update's corrections, and auto (tis for rollout.engine=vllm, none for
# the JAX sampler; ``resolved_correction``)
Correction = Literal["none", "tis", "mis", "seq-mis"]


BehaviourCorrection = Literal["auto", Correction]


@dataclasses.dataclass(frozen=True)
class OptimSection:
  """AdamW for the RL updates."""

  # RL learning rate. On the tiny task 1e-3 collapsed the policy within 200 steps (reward 0.40 →
  # 0.01); 3e-4 and 5e-4 both rose steadily (0.54 → 0.87 in 150 steps), 3e-4 with smaller
  # gradient norms.
  learning_rate: float = 3e-4
  warmup_steps: int = 10
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  b1: float = 0.9
  b2: float = 0.99
  state_dtype: Dtype = "float32"  # AdamW moments (float32 even for bfloat16 params)
  max_nonfinite_steps: int = 5  # consecutive steps with a skipped non-finite update → stop

  def check(self) -> None:
    need(self.max_nonfinite_steps >= 1, "optim.max_nonfinite_steps", "must be >= 1")
    check_ranges(
      "optim",
      self,
      dict(warmup_steps=AT_LEAST_0, grad_clip=Range(0, note=" (0 = no clipping)")),
    )
    need(
      0 < self.learning_rate < math.inf,
      "optim.learning_rate",
      f"must be > 0 and finite, got {self.learning_rate}",
    )
    for name in ("b1", "b2"):  # Adam's moment decay rates
      value = getattr(self, name)
      need(0 <= value < 1, f"optim.{name}", f"must be in [0, 1), got {value}")
    need(
      0 <= self.weight_decay < math.inf,
      "optim.weight_decay",
      f"must be >= 0 and finite, got {self.weight_decay}",
    )


@dataclasses.dataclass(frozen=True)
class LossSection:
  """The GRPO-family objective: aggregation, clipping, KL, entropy bonus, behaviour correction."""

  aggregation: Aggregation = "token-mean"
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 0.0  # 0 = off; else c > 1
  kl_coef: float = 0.0  # > 0 turns on KL to the frozen reference (the SFT policy)
  kl_estimator: KLEstimator = "k3"
  entropy_coef: float = 0.0
  informative_only: bool = True
  scale_by_std: bool = True
  mini_batches: int = 1  # optimizer updates per step; > 1 makes later updates off-policy
  micro_batches: int = 1  # gradient accumulation within each mini-batch
  logprob_chunk: int = 128  # tokens per chunk of the fused log-prob (bench/fused_logprob.py)
  # Packed update (jaxrl.rl.packing): the forward reads each sequence's real tokens only, packed
  # side by side into buffers of P + N; the objective is the padded update's (docs/algorithms.md
  # §1.6). Buffer rows per micro-batch come from pack_buckets values: that many programs at most.
  packing: bool = True
  pack_buckets: int = 4
  # Per-token objective weights for rollouts sampled by another policy μ (docs/algorithms.md §9)
  behaviour_correction: BehaviourCorrection = "auto"
  tis_cap: float = 2.0  # tis: weights truncated at this
  mis_low: float = 0.5  # mis, seq-mis: weights outside [mis_low, mis_high] mask the token
  mis_high: float = 2.0

  def check(self) -> None:
    """The values that become ``rl.losses.LossHparams`` (traced, so checked here only); what
    becomes the static ``LossConfig`` is checked where it is built (its ``__post_init__``)."""
    need(self.eps_low >= 0 and self.eps_high >= 0, "loss.eps_low", "clip ranges must be >= 0")
    need(
      self.eps_low < 1,
      "loss.eps_low",
      f"must be < 1 (the ratio is clipped below at 1 - eps_low, and no ratio is <= 0: the clip "
      f"would be off), got {self.eps_low}",
    )
    check_ranges(
      "loss",
      self,
      dict(logprob_chunk=AT_LEAST_1, mini_batches=AT_LEAST_1, pack_buckets=AT_LEAST_1),
    )
    check_ranges("loss", self, dict(dual_clip=Range(0, note=" (0 = off)"), mis_high=POSITIVE))
    need(self.tis_cap > 0, "loss.tis_cap", "must be > 0")
    need(
      0 < self.mis_low <= 1 <= self.mis_high,
      "loss.mis_low",
      f"need 0 < mis_low <= 1 <= mis_high, got {self.mis_low}, {self.mis_high}",
    )
    # The loss is pg + kl_coef * KL - entropy_coef * H (rl/losses.py): a KL penalty and an
    # entropy bonus, so both coefficients are >= 0 (0 = off).
    need(
      0 <= self.kl_coef < math.inf,
      "loss.kl_coef",
      f"must be >= 0 (the loss adds kl_coef * KL; 0 = off), got {self.kl_coef}",
    )
    need(
      0 <= self.entropy_coef < math.inf,
      "loss.entropy_coef",
      f"must be >= 0 (the loss subtracts entropy_coef * entropy; 0 = off), got {self.entropy_coef}",
    )


@dataclasses.dataclass(frozen=True)
class ModulationSection:
  """DynaMO's token-level advantage modulation."""

  enabled: bool = False  # DynaMO token-level advantage modulation
  alpha: float = 0.4
  gamma: float = 50.0
  tau: float = 0.9

  def check(self) -> None:
    # A token's factor is 1 - alpha + alpha * sigmoid(-gamma * (x - tau)) with x in [0, 1]:
    # alpha above 1 flips the advantage's sign, a negative gamma inverts which tokens are damped,
    # and a tau outside [0, 1] damps all or none (docs/algorithms.md §4.3).
    check_ranges("modulation", self, dict(alpha=FRACTION, gamma=AT_LEAST_0, tau=FRACTION))
