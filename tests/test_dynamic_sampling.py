"""Dynamic sampling (docs/algorithms.md §10): the choice of groups, the fixed row layout, and whole
steps through ``rl_step`` (every trained group informative when the fill is 1, nothing recompiled
across rounds, every drawn question counted)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from run_helpers import TIMING, rollouts, step_context, tiny_config

from jaxrl import losses
from jaxrl.rl.scoring import logp_responses_chunked
from jaxrl.rollout import dynamic
from jaxrl.run.context import compile_counter
from jaxrl.run.loop import initial_loop, rl_step


def test_select_groups_takes_the_first_informative_then_fills_in_draw_order():
  # Two rounds of B = 4 groups: informative groups 1, 4, 6 in draw order.
  informative = np.array([0, 1, 0, 0, 1, 0, 1, 0], bool)
  np.testing.assert_array_equal(dynamic.select_groups(informative, 2), [1, 4])
  np.testing.assert_array_equal(dynamic.select_groups(informative, 4), [1, 4, 6, 0])
  np.testing.assert_array_equal(dynamic.select_groups(informative, 5), [1, 4, 6, 0, 2])
  np.testing.assert_array_equal(dynamic.select_groups(np.zeros(4, bool), 4), [0, 1, 2, 3])


def test_informative_groups_agrees_with_the_loss():
  rng = np.random.default_rng(0)
  rewards = rng.integers(0, 2, 40).astype(np.float32)
  rewards[:6] = 1.0  # group 0 all correct
  groups = np.repeat(np.arange(8), 5).astype(np.int32)
  flags = dynamic.informative_groups(rewards, groups, 9)  # group 8 has no rows
  rows = np.asarray(losses.informative_rollouts(rewards, groups, 9))
  np.testing.assert_array_equal(flags[groups], rows)
  assert not flags[0] and not flags[8]


def _round(rng, counts, n=3, p=2):
  r = int(sum(counts))
  mask = np.arange(n)[None, :] < rng.integers(1, n + 1, (r, 1))
  out = rollouts(
    prompt_ids_RxP=rng.integers(1, 9, (r, p)),
    prompt_mask_RxP=np.ones((r, p), bool),
    tokens_RxN=rng.integers(1, 9, (r, n)),
    mask_RxN=mask,
    behaviour_logp_RxN=np.where(mask, -rng.random((r, n)), 0.0),
    rewards_R=rng.integers(0, 2, r),
    group_ids_R=np.repeat(np.arange(len(counts)), counts),
  )
  return out


def test_gather_and_pad_keep_each_group_whole_and_pad_rows_carry_nothing():
  rng = np.random.default_rng(1)
  rounds = [_round(rng, [2, 5, 1]), _round(rng, [3, 3, 2])]
  picks = [(1, 2), (0, 1), (0, 0)]
  chosen = dynamic.gather_groups(rounds, picks)
  np.testing.assert_array_equal(chosen.group_ids_R, [0, 0, 1, 1, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(chosen.tokens_RxN[:2], rounds[1].tokens_RxN[6:8])
  np.testing.assert_array_equal(chosen.rewards_R[2:7], rounds[0].rewards_R[2:7])
  padded = dynamic.pad_rows(chosen, 12, group=3)
  assert len(padded.group_ids_R) == 12 and np.all(padded.group_ids_R[9:] == 3)
  assert not padded.mask_RxN[9:].any() and not padded.rewards_R[9:].any()
  assert not padded.loss_mask_RxN[9:].any()
  assert not padded.behaviour_logp_RxN[9:].any() and np.all(padded.prompt_mask_RxP[9:])
  # The padding group has advantage 0 and no informative row: it adds nothing to the loss.
  adv = np.asarray(losses.group_advantages(padded.rewards_R, padded.group_ids_R, 4))
  assert np.all(adv[9:] == 0)


def test_groups_whose_answers_were_all_set_aside_come_last_and_pad_from_a_round():
  """A group with no scored answer (every row set aside) is chosen only after every group with
  rows; a step whose chosen groups have no rows at all still gets its fixed row count."""
  informative = np.array([False, False, True, False])
  present = np.array([False, True, True, True])
  np.testing.assert_array_equal(dynamic.select_groups(informative, 3, present), [2, 1, 3])
  np.testing.assert_array_equal(dynamic.select_groups(informative, 4, present), [2, 1, 3, 0])
  rng = np.random.default_rng(2)
  first = _round(rng, [2, 2])
  aside = dynamic.set_aside(first, np.zeros(4, bool), 2)  # the verifier scored nothing
  assert not dynamic.groups_present(aside.group_ids_R, 2).any()
  chosen = dynamic.gather_groups([aside], [(0, 0), (0, 1)])
  assert len(chosen.group_ids_R) == 0
  padded = dynamic.pad_rows(chosen, 4, 2, template=aside)
  assert padded.group_ids_R.tolist() == [2] * 4 and not padded.mask_RxN.any()


def test_trained_rows_bound_the_chosen_groups():
  # B = 4 questions, G_i <= 12, R = 32 per round, 3 rounds, rows split in multiples of 8.
  assert dynamic.trained_rows(4, 12, 32, 3, 8) == 48
  assert dynamic.trained_rows(4, 8, 32, 3, 8) == 32  # uniform G = 8: exactly R
  assert dynamic.trained_rows(4, None, 32, 2, 8) == 64  # unknown bound: every drawn row
  assert dynamic.trained_rows(4, 13, 32, 3, 8) == 56  # rounded up to the split


def test_overlong_rows_are_kept_dropped_or_rewarded():
  """docs/algorithms.md §10's worked example of ``rollout.overlong``."""
  rewards, finished = np.array([1.0, 0.0, 1.0]), np.array([True, False, False])
  r, kept = dynamic.overlong(rewards, finished, "keep", -1.0)
  assert r.tolist() == [1, 0, 1] and kept.tolist() == [True] * 3
  r, kept = dynamic.overlong(rewards, finished, "drop", -1.0)
  assert r.tolist() == [1, 0, 1] and kept.tolist() == [True, False, False]
  r, kept = dynamic.overlong(rewards, finished, "reward", -1.0)
  assert r.tolist() == [1, -1, -1] and kept.tolist() == [True] * 3


def test_a_step_counts_its_overlong_rows_and_a_stated_reward_makes_them_a_signal(tmp_path):
  """Fresh random params answer nothing right and rarely write EOS within 4 tokens: every reward
  is 0 and no group carries a signal (no token trains), until "reward" scores the rows the budget
  cut -1 and the groups holding a finished row train. Each step counts those rows."""
  rows = {}
  for mode in ("keep", "drop", "reward"):
    cfg = tiny_config("test", steps=1, **{"rollout.overlong": mode, "rollout.overlong_reward": -1})
    rows[mode] = _run_steps(cfg, tmp_path / mode, 1)[2][0]
  assert rows["keep"]["overlong_rows"] == rows["drop"]["overlong_rows"] >= 1
  assert rows["keep"]["token_count"] == 0 < rows["reward"]["token_count"]


def _run_steps(cfg, tmp_path, steps):
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop = initial_loop(ctx, ctx.programs.init_state(params))
  rows = []
  for i in range(steps):
    loop, row = rl_step(ctx, loop, i)
    rows.append(row)
  return ctx, loop, rows


def test_dynamic_steps_train_only_informative_groups_when_full(tmp_path):
  """Uniform allocation (no padding): whenever B informative groups were found, every trained
  row belongs to one; the rounds never recompile the update or the sampler; every drawn question
  is counted in the statistics and advances the cursor."""
  cfg = tiny_config(
    "test",
    steps=6,
    **{"rollout.dynamic_sampling": True, "rollout.max_rounds": 3, "sft.steps": 0},
  )
  ctx, loop, rows = _run_steps(cfg, tmp_path, cfg.steps)
  b, g = cfg.batch_questions, cfg.rollout.group_size
  drawn = sum(r["dynamic_groups_drawn"] for r in rows)
  assert loop.cursor.drawn == drawn
  assert int(np.sum(loop.stats.seen_Q)) == drawn * g
  assert any(r["dynamic_rounds"] > 1 for r in rows)
  for r in rows:
    assert 1 <= r["dynamic_rounds"] <= 3
    assert r["dynamic_fill"] == min(r["dynamic_informative"], b) / b
    if r["dynamic_fill"] == 1.0:
      assert r["informative_frac"] == 1.0
    # Every round's rows count, dropped or trained: 1 to N tokens each (EOS included); one round's
    # are the trained rows themselves.
    drawn_rows = r["dynamic_rounds"] * b * g
    assert drawn_rows <= r["generated_tokens"] <= drawn_rows * cfg.rollout.max_new_tokens
    if r["dynamic_rounds"] == 1:
      assert r["generated_tokens"] == r["response_len"] * b * g


def test_dynamic_sampling_with_variable_groups_is_one_compiled_update(tmp_path):
  """E3 allocation (G_i up to its cap) + EEPO: trained groups padded to one static row count; the
  compiled update and sampler are reused by every step and round (jax.monitoring trace counts)."""
  cfg = tiny_config(
    "e3,test",
    steps=5,
    **{
      "rollout.dynamic_sampling": True,
      "rollout.max_rounds": 2,
      "eepo.enabled": True,
      "sft.steps": 0,
    },
  )
  counter = compile_counter(compiles_logp=logp_responses_chunked).start()
  try:
    ctx, params = step_context(cfg, tmp_path / "tokenizer")
    ctx.compiles = counter
    loop = initial_loop(ctx, ctx.programs.init_state(params))
    counts = []
    for i in range(cfg.steps):
      loop, row = rl_step(ctx, loop, i)
      counts.append(counter.counts())
  finally:
    counter.stop()
  # One update; the sampler for EEPO's two stages (R/2 rows each); the stage-1 entropy needs no
  # rescoring with the JAX sampler, so nothing else compiles.
  assert counts[0]["compiles_update"] == 1 and all(c == counts[0] for c in counts), counts


def test_dynamic_rl_step_is_a_pure_function_of_the_loop_state(tmp_path):
  cfg = tiny_config("dynamo,test", steps=2, **{"rollout.dynamic_sampling": True, "sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop = initial_loop(ctx, ctx.programs.init_state(params))
  copy = lambda x: jax.tree.map(jnp.copy, x)  # noqa: E731 (rl_step donates the train state)
  first, row = rl_step(ctx, copy(loop), 0)
  again, row_again = rl_step(ctx, copy(loop), 0)
  np.testing.assert_equal(
    {k: v for k, v in row.items() if k not in TIMING},
    {k: v for k, v in row_again.items() if k not in TIMING},
  )
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert first.cursor.drawn == again.cursor.drawn == row["dynamic_groups_drawn"]
