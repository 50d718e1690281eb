"""The compiled programs' static configurations: the update's (``LossConfig``) and EEPO's forgetting
step's (``ForgetConfig``). Hashable, static arguments of the jitted programs: a change builds a new
program. ``jaxrl.config.derived`` builds both from a (phase's) config, the one place that maps
sections to them."""

from __future__ import annotations

import dataclasses
import typing

from jaxrl.fields import check_type, need
from jaxrl.rl.sections import (
  Aggregation,
  BehaviourCorrection,
  Correction,
  KLEstimator,
  LossSection,
  ModulationSection,
)


def resolved_correction(mode: BehaviourCorrection, engine: str, top_p: float = 1.0) -> Correction:
  """``loss.behaviour_correction`` with ``auto`` resolved: tis where the rollouts' behaviour
  policy differs from the trainer's — a vLLM sidecar (other kernels and dtypes), or nucleus
  sampling (top_p < 1: tokens drawn from the truncated distribution, docs/algorithms.md §9);
  none for the JAX sampler at top_p = 1 (the trainer's own policy)."""
  if mode == "auto":
    return "tis" if engine == "vllm" or top_p < 1.0 else "none"
  return mode


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """What shapes the compiled GRPO update (docs/algorithms.md §1.5): hashable, a static argument
  of the jitted update, so a change builds a new program. What a step may change without one is
  ``rl.losses.LossHparams`` (traced).

  ``jaxrl.config.derived.loss_config`` builds it from a (phase's) ``Config``, the only place that
  maps sections to it; the defaults are the ``loss`` and ``modulation`` sections' own, with the JAX
  sampler (``rollout.engine``'s default) as the behaviour policy. Each check of these
  fields is here, in ``__post_init__``, which the config's validation runs too. ``num_groups`` and
  ``max_response_len`` are shapes: 0 where only ``grpo_loss`` reads the config."""

  aggregation: Aggregation = LossSection.aggregation
  dual_clip: float = LossSection.dual_clip  # 0 = off; c > 1 floors the objective at c·A for A < 0
  kl_estimator: KLEstimator = LossSection.kl_estimator
  use_kl: bool = LossSection.kl_coef > 0  # the reference pass; its weight β is traced
  informative_only: bool = LossSection.informative_only
  scale_by_std: bool = LossSection.scale_by_std
  behaviour_correction: Correction = resolved_correction(LossSection.behaviour_correction, "jax")
  modulation: bool = ModulationSection.enabled  # DynaMO's token-level advantage modulation (§4.3)
  mini_batches: int = LossSection.mini_batches
  micro_batches: int = LossSection.micro_batches
  logprob_chunk: int = LossSection.logprob_chunk
  num_groups: int = 0  # groups of a step's rows: the questions, and one for rows of none
  max_response_len: int = 0  # N, the T_max of seq-mean-token-sum-norm

  def __post_init__(self):
    hints = typing.get_type_hints(LossConfig)
    for f in dataclasses.fields(self):  # allowed values (Literal) and types
      check_type(f"loss.{f.name}", getattr(self, f.name), hints[f.name])
    need(self.dual_clip == 0 or self.dual_clip > 1, "loss.dual_clip", "must be 0 (off) or > 1")
    need(self.mini_batches >= 1, "loss.mini_batches", "must be >= 1")
    need(self.micro_batches >= 1, "loss.micro_batches", "must be >= 1")
    need(
      self.aggregation != "seq-mean-token-sum-norm" or self.max_response_len > 0,
      "loss.aggregation",
      "seq-mean-token-sum-norm divides by the longest response: needs max_response_len > 0",
    )


@dataclasses.dataclass(frozen=True)
class ForgetConfig:
  """Static arguments of EEPO's forgetting step (docs/algorithms.md §5)."""

  logprob_chunk: int
  lr: float
  eps_l: float
  eps_r: float
  paper_clip: bool = False  # eepo.unlearn_clip = "paper"
  pack_buckets: int = 0  # loss.pack_buckets with loss.packing on: a packed forward; 0: padded
