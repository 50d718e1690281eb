"""Per-question statistics (ALGORITHMS.md §2): columns over question ids, updated every step."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl.types import Array, QuestionStats


def init_stats(num_questions: int) -> QuestionStats:
  return QuestionStats(
    seen_Q=jnp.zeros((num_questions,), jnp.int32),
    correct_Q=jnp.zeros((num_questions,), jnp.int32),
    reward_sum_Q=jnp.zeros((num_questions,), jnp.float32),
    last_step_Q=jnp.full((num_questions,), -1, jnp.int32),
  )


def update_stats(
  stats: QuestionStats, question_ids_B: Array, group_ids_R: Array, rewards_R: Array, step
) -> QuestionStats:
  """Add one step's rollouts: row r answers question ``question_ids_B[group_ids_R[r]]``."""
  qid_R = jnp.asarray(question_ids_B)[group_ids_R]
  rewards_R = jnp.asarray(rewards_R, jnp.float32)
  return QuestionStats(
    seen_Q=stats.seen_Q.at[qid_R].add(1),
    correct_Q=stats.correct_Q.at[qid_R].add((rewards_R > 0).astype(jnp.int32)),
    reward_sum_Q=stats.reward_sum_Q.at[qid_R].add(rewards_R),
    last_step_Q=stats.last_step_Q.at[qid_R].set(jnp.asarray(step, jnp.int32)),
  )
