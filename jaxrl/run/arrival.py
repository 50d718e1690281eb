"""The arrive stage of an RL step, after the take: a generated batch's rewards (verifier, reward
terms, the environment's), the answers nobody scored set aside, dynamic sampling's further rounds
until B groups carry a signal (docs/algorithms.md §10), and the questions' statistics counted — an
``Arrival``, the rows the update trains on."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.parallel import distributed
from jaxrl.rl.stats import update_stats
from jaxrl.rollout import dynamic
from jaxrl.run import batches, records
from jaxrl.run.loop_state import LoopState
from jaxrl.tasks.rewards.pool import VerifyResult
from jaxrl.types import QuestionStats, Rollouts


@dataclasses.dataclass(frozen=True)
class Arrival:
  """A taken batch, verified: the rows to train on and what the step learned about its data."""

  # Trained rows, rewards set (dynamic sampling: padded to a fixed count); rows in group B (no
  # question: padding, unscored answers) carry no tokens.
  rollouts: Rollouts
  stats: QuestionStats  # every sampled group counted
  verified: dict  # the verifier's counters, summed over rounds
  epochs_ended: tuple[int, ...]
  metrics: dict  # the model tokens its sampling generated (every round), dynamic sampling's
  qids_B: np.ndarray  # the trained groups' questions ...
  counts_B: np.ndarray  # ... and their allocated G


def verify(ctx, qids_B, rollouts: Rollouts) -> tuple[Rollouts, dict]:
  """The rollouts with their rewards, and the verifier's counters. Answers it did not score
  (timed out, skipped at its deadline, crashed) are set aside: a reward of 0 there would train on
  a verdict nobody gave. Their rows join the group of no question (index B), out of the update,
  the statistics and the group's advantage; the rest of their group trains as a smaller group.
  Responses the budget cut follow ``rollout.overlong`` (``dynamic.overlong``)."""
  group_ids_R = np.asarray(rollouts.group_ids_R)
  responses = ctx.task.decode(rollouts)
  qids_R = qids_B[group_ids_R]
  answers = ctx.task.train_answers[qids_R]
  terms = ctx.reward_terms
  if terms is None or terms.uses_verifier:
    verified = ctx.task.verify(responses, answers)
  else:
    verified = VerifyResult(np.zeros(len(responses), np.float32), 0, 0, 0, 0)
  rewards_R, scored_R, term_counters = verified.rewards_R, verified.scored, {}
  if terms is not None:  # reward.terms: the verifier's, a callable's, a reward model's (§13)
    prompts = ctx.task.prompt_texts(qids_R)
    got = terms.score(prompts, responses, list(answers), verified, group_ids_R, len(qids_B))
    rewards_R, scored_R, term_counters = got.rewards_R, got.kept_R, got.metrics
  # Each process verifies every row, under its own clock: process 0's verdicts are everyone's.
  rewards_R = np.asarray(rewards_R, np.float32)
  if rollouts.rewards_R is not None:  # the environment's trajectory reward (Collector.sample)
    rewards_R = rewards_R + np.asarray(rollouts.rewards_R, np.float32)
  rewards_R, scored_R = distributed.from_main((rewards_R, scored_R.astype(np.int32)))
  r = ctx.cfg.rollout
  finished_R = np.asarray(rollouts.finished_R, bool)
  rewards_R, kept_R = dynamic.overlong(rewards_R, finished_R, r.overlong, r.overlong_reward)
  scored = dataclasses.replace(rollouts, rewards_R=rewards_R)
  counters = {**verified.metrics(), "overlong_rows": float((~finished_R).sum()), **term_counters}
  return dynamic.set_aside(scored, scored_R.astype(bool) & kept_R, len(qids_B)), counters


def arrive(ctx, loop: LoopState, batch: batches.Batch, i: int) -> tuple[LoopState, Arrival]:
  """Rewards and statistics of step ``i``'s batch (dynamic sampling: its further rounds, which
  advance the cursor); returns the loop with that cursor and the ``Arrival``."""
  issue = batch.issue
  generated = records.generated_tokens(batch.rollouts)
  first, verified = verify(ctx, issue.qids_B, batch.rollouts)
  rounds = [(issue, first)]
  ended = (issue.epoch_ended,) if issue.epoch_ended >= 0 else ()
  if ctx.cfg.rollout.dynamic_sampling:
    loop, rounds, more, ended, extra_tokens = _more_rounds(ctx, loop, batch, i, rounds, ended)
    verified = {k: verified[k] + more.get(k, 0.0) for k in verified}
    generated += extra_tokens
  stats = loop.stats
  for r_issue, r_out in rounds:
    stats = update_stats(stats, r_issue.qids_B, np.asarray(r_out.group_ids_R), r_out.rewards_R, i)
  if not ctx.cfg.rollout.dynamic_sampling:
    rollouts = rounds[0][1]
    metrics = {"generated_tokens": generated}
    got = Arrival(
      rollouts, stats, verified, ended, metrics, np.asarray(issue.qids_B), issue.counts_B
    )
    return loop, got
  got = _dynamic_arrival(ctx, batch, rounds, stats, verified, ended)
  return loop, dataclasses.replace(got, metrics={**got.metrics, "generated_tokens": generated})


def _more_rounds(ctx, loop: LoopState, batch, i: int, rounds, ended):
  """Dynamic sampling (docs/algorithms.md §10): rounds of B questions from the rollout source
  until B informative groups or ``rollout.max_rounds`` rounds; also the model tokens the extra
  rounds generated."""
  b, verified, tokens = ctx.cfg.batch_questions, {}, 0.0
  found = int(dynamic.informative_groups(rounds[0][1].rewards_R, rounds[0][1].group_ids_R, b).sum())
  while found < b and len(rounds) < ctx.cfg.rollout.max_rounds:
    loop, issue, out, epoch_ended = ctx.source.extra_round(loop, batch, i, len(rounds))
    if epoch_ended >= 0:
      ended += (epoch_ended,)
    tokens += records.generated_tokens(out)
    out, v = verify(ctx, issue.qids_B, out)
    verified = {k: verified.get(k, 0.0) + v[k] for k in v}
    rounds.append((issue, out))
    found += int(dynamic.informative_groups(out.rewards_R, out.group_ids_R, b).sum())
  return loop, rounds, verified, ended, tokens


def _dynamic_arrival(ctx, batch, rounds, stats, verified, ended) -> Arrival:
  """The B groups a dynamic-sampling step trains on, padded to its fixed row count."""
  c = ctx.cfg
  pc, methods = ctx.runtime(batch.issue.phase).phase.cfg, ctx.runtime(batch.issue.phase).methods
  b = c.batch_questions
  flags = [dynamic.informative_groups(out.rewards_R, out.group_ids_R, b) for _, out in rounds]
  present = [dynamic.groups_present(out.group_ids_R, b) for _, out in rounds]
  picks = dynamic.select_groups(np.concatenate(flags), b, np.concatenate(present))
  outs = [out for _, out in rounds]
  if not batch.issue.fresh:  # the whole batch is rescored under θ_i, extra rounds included
    outs = [dataclasses.replace(o, prox_logp_RxN=None) for o in outs]
  chosen = dynamic.gather_groups(outs, [(int(p) // b, int(p) % b) for p in picks])
  rows = dynamic.trained_rows(
    b,
    methods.allocator.max_count,
    pc.num_rollouts,
    c.rollout.max_rounds,
    pc.loss.mini_batches * pc.loss.micro_batches * c.mesh.data * c.mesh.fsdp,
  )
  informative = int(np.concatenate(flags).sum())
  metrics = dict(
    dynamic_rounds=float(len(rounds)),
    dynamic_groups_drawn=float(len(rounds) * b),
    dynamic_informative=float(informative),
    dynamic_fill=min(informative, b) / b,
  )
  padded = jax.tree.map(jnp.asarray, dynamic.pad_rows(chosen, rows, b, template=outs[0]))
  qids_B = np.concatenate([np.asarray(r.qids_B) for r, _ in rounds])[picks]
  counts_B = np.concatenate([np.asarray(r.counts_B) for r, _ in rounds])[picks]
  return Arrival(padded, stats, verified, ended, metrics, qids_B, counts_B)
