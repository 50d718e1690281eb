"""What the whole config implies: the run's config inside the annealing phase (Entropy Scheduling
§5), and the static configurations of the compiled programs (``LossConfig`` for the update,
``ForgetConfig`` for EEPO's forgetting step) — the one place that maps sections to them. The phases
themselves (when each starts, which config and mixture it runs) are ``jaxrl.run.phases``."""

from __future__ import annotations

import dataclasses

from jaxrl.config.schema import Config
from jaxrl.methods.sections import EEPOSection
from jaxrl.rl.program_configs import ForgetConfig, LossConfig, resolved_correction
from jaxrl.rl.sections import LossSection
from jaxrl.rollout.sections import anneal_response


def annealing(cfg: Config) -> Config:
  """The run's config inside the annealing phase: the phase's group size and response length, and
  every allocation bound scaled by G_anneal / G so the allocators keep their shape around the new G.
  """
  p = cfg.anneal_phase
  g = p.group_size or cfg.rollout.group_size
  ratio = g / cfg.rollout.group_size
  lo = lambda b: max(1, min(g, int(b * ratio)))  # scaled bounds still contain G
  hi = lambda b: max(g, -(-int(b * g) // cfg.rollout.group_size))
  a = cfg.allocation
  return dataclasses.replace(
    cfg,
    anneal_phase=dataclasses.replace(p, enabled=False),
    rollout=dataclasses.replace(
      cfg.rollout, group_size=g, max_new_tokens=anneal_response(cfg.rollout, p)
    ),
    allocation=dataclasses.replace(
      a,
      g_min=lo(a.g_min),
      g_max=hi(a.g_max),
      e3=dataclasses.replace(a.e3, g_min_floor=lo(a.e3.g_min_floor), g_max_cap=hi(a.e3.g_max_cap)),
    ),
  )


def loss_config(cfg: Config) -> LossConfig:
  """The update's static part for ``cfg``: a phase's config gives that phase's shapes."""
  loss = cfg.loss
  return LossConfig(
    aggregation=loss.aggregation,
    dual_clip=loss.dual_clip,
    kl_estimator=loss.kl_estimator,
    use_kl=loss.kl_coef > 0,
    informative_only=loss.informative_only,
    scale_by_std=loss.scale_by_std,
    behaviour_correction=resolved_correction(
      loss.behaviour_correction, cfg.rollout.engine, cfg.rollout.top_p
    ),
    modulation=cfg.modulation.enabled,
    mini_batches=loss.mini_batches,
    micro_batches=loss.micro_batches,
    logprob_chunk=loss.logprob_chunk,
    # Rows that belong to no question (an answer the verifier did not score, dynamic
    # sampling's padding) are in a group of their own, index B: no tokens, advantage 0.
    num_groups=cfg.batch_questions + 1,
    max_response_len=cfg.rollout.max_new_tokens,
  )


def forget_config(eepo: EEPOSection, loss: LossSection) -> ForgetConfig:
  """EEPO's forgetting step's static part: its step size and clip (``eepo``), the update's log-prob
  chunk and packing (``loss``)."""
  return ForgetConfig(
    logprob_chunk=loss.logprob_chunk,
    lr=eepo.lr,
    eps_l=eepo.eps_l,
    eps_r=eepo.eps_r,
    paper_clip=eepo.unlearn_clip == "paper",
    pack_buckets=loss.pack_buckets if loss.packing else 0,
  )
