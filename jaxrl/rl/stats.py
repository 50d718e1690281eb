"""Per-question statistics (docs/algorithms.md §2): columns by question id, updated every step."""

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
  """Add one step's rollouts: row r answers question ``question_ids_B[group_ids_R[r]]``. Rows
  in no question's group (``group_ids_R[r] >= B``: an answer the verifier did not score, a
  padding row) are not counted."""
  question_ids_B = jnp.asarray(question_ids_B)
  group_ids_R = jnp.asarray(group_ids_R)
  num_q = stats.seen_Q.shape[0]
  in_group_R = group_ids_R < question_ids_B.shape[0]
  # Out of range (num_q) for the rows not counted: the scatters drop them.
  qid_R = jnp.where(in_group_R, question_ids_B[jnp.where(in_group_R, group_ids_R, 0)], num_q)
  rewards_R = jnp.asarray(rewards_R, jnp.float32)
  return QuestionStats(
    seen_Q=stats.seen_Q.at[qid_R].add(1, mode="drop"),
    correct_Q=stats.correct_Q.at[qid_R].add((rewards_R > 0).astype(jnp.int32), mode="drop"),
    reward_sum_Q=stats.reward_sum_Q.at[qid_R].add(rewards_R, mode="drop"),
    last_step_Q=stats.last_step_Q.at[qid_R].set(jnp.asarray(step, jnp.int32), mode="drop"),
  )
