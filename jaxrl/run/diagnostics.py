"""Measurements the loop takes at fixed params, off the training path (docs/algorithms.md §12.1).

``grad_variance_ratio``: DynaMO's variance argument on the run's own model. At step i, before its
update, the step's questions are sampled again ``diagnostics.grad_variance_draws`` times under the
step's allocation and as many under uniform allocation of the same budget, by θ_i at the step's τ,
each batch verified and differentiated (``Programs.policy_grad``: the whole batch as one
mini-batch, the step's loss hyperparameters); the ratio of the two trace variances is
``dynamo_grad_var_ratio``. Keys come from ``rng.GRAD_VARIANCE``; the statistics, controllers, data
cursor and params are not touched, so the run trains exactly as without the measurement. The
resampled batches are single-stage (EEPO's second stage is not redrawn): the measurement is of the
allocation.
"""

from __future__ import annotations

from typing import Callable

from jaxrl.config import loss_config
from jaxrl.parallel import sharding
from jaxrl.rl.grad_variance import allocation_grad_variance_ratio, variance_key


def grad_variance_due(cfg, i: int) -> bool:
  """Whether step ``i`` (0-based) measures: every ``diagnostics.grad_variance_every`` steps."""
  every = cfg.diagnostics.grad_variance_every
  return every > 0 and (i + 1) % every == 0


def grad_variance_ratio(ctx, issue, params, hp, i: int, verify: Callable) -> float:
  """tr Var̂(the step's allocation) / tr Var̂(uniform) at ``params`` = θ_i; ``issue``: the step's
  batch decisions (questions, counts, τ); ``verify(qids_B, rollouts)`` → (rollouts with rewards,
  counters), the loop's own verification."""
  pc = ctx.runtime(issue.phase).phase.cfg
  ids, mask = ctx.task.train_prompt_ids[issue.qids_B], ctx.task.train_prompt_mask[issue.qids_B]
  grad = ctx.programs.policy_grad(loss_config(pc))

  def sample(counts_B, key):
    out = ctx.collector.sample(
      params,
      i,
      ids,
      mask,
      counts_B,
      issue.tau,
      key,
      pc.rollout.max_new_tokens,
      qids_B=issue.qids_B,
    )
    return verify(issue.qids_B, out)[0]

  def grad_fn(batch):
    return grad(params, sharding.shard_batch(batch, ctx.programs.mesh), hp, ctx.ref_params)

  key = variance_key(ctx.cfg.seed, i)
  draws = ctx.cfg.diagnostics.grad_variance_draws
  return allocation_grad_variance_ratio(grad_fn, sample, issue.counts_B, key, draws)
