"""Answers the verifier did not score (it raised, timed out, or its batch deadline passed) are left
out of the update, the question statistics and the step's reward, and counted in the step's row;
the rest of their group trains as a smaller group."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from run_helpers import rollouts, step_context, tiny_config

from jaxrl.rl import advantages
from jaxrl.rollout import dynamic
from jaxrl.run.loop import initial_loop, rl_step
from jaxrl.tasks.rewards.pool import VerifierPool


class _PoolScorer:
  """The task's scorer: a real verifier pool whose function raises on odd-length responses."""

  def __init__(self):
    self.pool = VerifierPool("reward_fns:raise_on_odd_length", num_workers=1)

  def __call__(self, responses, answers):
    return self.pool.score(responses, answers)

  def close(self):
    self.pool.close()


def test_unscored_answers_are_set_aside_from_the_update_and_the_statistics(tmp_path):
  cfg = tiny_config("test", steps=1, **{"sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  ctx.task.scorer = _PoolScorer()
  trained = {}
  update = ctx.runtime(0).update

  def spy(state, batch, hp, ref, pack):  # the rollouts the update is given (and their layout)
    trained["batch"] = jax.tree.map(np.asarray, batch)
    return update(state, batch, hp, ref, pack)

  ctx.runtimes = (dataclasses.replace(ctx.runtime(0), update=spy),)
  try:
    loop = initial_loop(ctx, ctx.programs.init_state(params))
    loop, row = rl_step(ctx, loop, 0)
  finally:
    ctx.task.close()
  batch = trained["batch"]
  texts = ctx.task.decode(batch)
  b = cfg.batch_questions
  aside_R = batch.group_ids_R == b
  # Some rows were scored and some were not (the function raised on odd-length responses).
  assert 0 < aside_R.sum() < len(aside_R)
  assert all(len(t.strip()) % 2 == 0 for t, a in zip(texts, aside_R) if not a)
  # Set-aside rows carry nothing: no token, no reward, no behaviour log-prob.
  assert not batch.mask_RxN[aside_R].any() and not batch.rewards_R[aside_R].any()
  assert not batch.behaviour_logp_RxN[aside_R].any()
  assert row["verify_errors"] == aside_R.sum()
  # The step's reward is the mean over the scored rows only.
  kept_R = ~aside_R
  assert row["reward"] == float(np.mean(batch.rewards_R[kept_R]))
  # Statistics count the scored rows only.
  assert int(np.asarray(loop.stats.seen_Q).sum()) == int(kept_R.sum())
  assert int(np.asarray(loop.stats.correct_Q).sum()) == int((batch.rewards_R[kept_R] > 0).sum())
  # Advantages: those of the scored rows, each group normalised over its scored rows.
  adv = np.asarray(advantages.group_advantages(batch.rewards_R, batch.group_ids_R, b + 1))
  alone = np.asarray(
    advantages.group_advantages(batch.rewards_R[kept_R], batch.group_ids_R[kept_R], b)
  )
  np.testing.assert_array_equal(adv[kept_R], alone)
  assert not adv[aside_R].any()


def test_set_aside_moves_rows_to_the_group_of_no_question():
  r, n = 4, 3
  out = rollouts(
    prompt_ids_RxP=np.ones((r, 2), np.int32),
    prompt_mask_RxP=np.ones((r, 2), bool),
    tokens_RxN=np.full((r, n), 5, np.int32),
    mask_RxN=np.ones((r, n), bool),
    behaviour_logp_RxN=np.full((r, n), -1.0, np.float32),
    rewards_R=np.array([1, 0, 1, 1], np.float32),
    group_ids_R=np.array([0, 0, 1, 1], np.int32),
  )
  kept = np.array([True, False, True, True])
  aside = dynamic.set_aside(out, kept, 2)
  assert aside.group_ids_R.tolist() == [0, 2, 1, 1]
  assert aside.mask_RxN.tolist()[1] == [False] * n and aside.mask_RxN[kept].all()
  assert not aside.loss_mask_RxN[1].any() and aside.loss_mask_RxN[kept].all()
  assert aside.rewards_R.tolist() == [1, 0, 1, 1] and aside.lengths_R[1] == 0
  assert dynamic.set_aside(out, np.ones(r, bool), 2) is out
