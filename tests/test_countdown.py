"""The countdown task (tiny:countdown): problems made by chains whose value is the target, a split
by content that no seed can cross, an SFT corpus of train problems, an exact verifier that accepts
any right expression and nothing else, and its config checks."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from run_helpers import read_metrics, tiny_config

from jaxrl.config import ConfigError
from jaxrl.run import plan
from jaxrl.run.components import task_sections
from jaxrl.run.train import Trainer
from jaxrl.tasks import task as task_lib
from jaxrl.tasks.data import countdown
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.envs.calculator import evaluate
from jaxrl.tasks.rewards.countdown import CountdownScorer, score


@pytest.mark.parametrize(
  "numbers, ops, text, values",
  [
    ([7, 3, 2], "*+", "7*3+2", [21, 23]),
    ([7, 3, 2], "+*", "(7+3)*2", [10, 20]),
    ([2, 3, 4, 5], "+*-", "(2+3)*4-5", [5, 20, 15]),
    ([2, 3, 4, 5], "+**", "(2+3)*4*5", [5, 20, 100]),
    ([9, 3, 4, 5], "-+*", "(9-3+4)*5", [6, 10, 50]),
    ([9, 3, 4, 5], "*-*", "(9*3-4)*5", [27, 23, 115]),
    ([6, 2], "-", "6-2", [4]),
  ],
)
def test_a_chain_is_written_with_the_fewest_parentheses(numbers, ops, text, values):
  assert countdown.chain(numbers, list(ops)) == (text, values)
  assert evaluate(text) == values[-1]


def test_random_chains_evaluate_to_their_last_value():
  rng = np.random.default_rng(0)
  for _ in range(500):
    k = int(rng.integers(2, 7))
    numbers = rng.integers(1, 100, size=k).tolist()
    ops = [countdown.OPS[i] for i in rng.integers(0, 3, size=k - 1)]
    text, values = countdown.chain(numbers, ops)
    assert evaluate(text) == values[-1]


def _parse(prompt: str) -> tuple[list[int], int]:
  numbers, target = prompt.removesuffix("=").split(":")
  return [int(x) for x in numbers.split(",")], int(target)


def test_every_problem_is_solved_by_its_reference_and_the_splits_never_meet():
  cfg = countdown.CountdownConfig(num_train_per_level=60, num_heldout_per_level=12)
  train, heldout = countdown.build_task(cfg)
  keys = []
  for split, problems in enumerate((train, heldout)):
    for p in problems:
      numbers, target = _parse(p.prompt)
      level = cfg.levels[p.level]
      assert len(numbers) == level.count and 1 <= min(numbers) <= max(numbers) <= level.max_value
      assert 1 <= target <= countdown.MAX_VALUE
      assert score(p.answer, p.answer) == 1.0 and evaluate(p.answer) == target
      assert sorted(int(x) for x in p.answer.replace("(", " ").replace(")", " ").replace(
        "+", " ").replace("-", " ").replace("*", " ").split()) == sorted(numbers)  # fmt: skip
      assert countdown.is_heldout(numbers, target, cfg.heldout_modulus) == bool(split)
      keys.append((split, tuple(sorted(numbers)), target))
  per_split = [{k[1:] for k in keys if k[0] == s} for s in (0, 1)]
  assert not per_split[0] & per_split[1]
  assert len(per_split[0]) == len(train) and len(per_split[1]) == len(heldout)  # distinct
  # Two numbers up to 9 make few problems: the level gives what it has, the others are full.
  counts = np.bincount([p.level for p in heldout], minlength=len(cfg.levels))
  assert counts[1:].tolist() == [12] * 7 and 0 < counts[0] <= 12


def test_the_split_is_by_content_whatever_the_seed_and_order():
  assert countdown.is_heldout([3, 7, 2], 23, 10) == countdown.is_heldout([2, 3, 7], 23, 10)
  seeds = [
    countdown.build_task(countdown.CountdownConfig(seed=s, num_train_per_level=40)) for s in (0, 1)
  ]
  sides = {}
  for train, heldout in seeds:
    for split, problems in enumerate((train, heldout)):
      for p in problems:
        numbers, target = _parse(p.prompt)
        assert sides.setdefault((tuple(sorted(numbers)), target), split) == split
  assert countdown.build_task(countdown.CountdownConfig()) == countdown.build_task(
    countdown.CountdownConfig()
  )


def test_the_sft_corpus_draws_train_problems_of_its_levels():
  levels = countdown.parse_levels("2n9,3n19,5n19")
  cfg = countdown.CountdownConfig(levels=levels, sft_level_weights=(1.0, 1.0, 0.0))
  pairs = countdown.sft_corpus(cfg, 400, seed=3)
  assert pairs == countdown.sft_corpus(cfg, 400, seed=3)
  counts = set()
  for prompt, solution in pairs:
    numbers, target = _parse(prompt)
    counts.add(len(numbers))
    assert not countdown.is_heldout(numbers, target, cfg.heldout_modulus)
    assert score(solution, solution) == 1.0 and evaluate(solution) == target
  assert counts == {2, 3}
  prompt_chars, solution_chars = countdown.max_lengths(levels)
  assert max(len(p) for p, _ in pairs) <= prompt_chars
  assert max(len(s) for _, s in pairs) <= solution_chars


def test_levels_parse_and_refuse_what_the_task_cannot_make():
  assert countdown.parse_levels(" 2n9, 5n19") == (
    countdown.CountdownLevel(2, 9),
    countdown.CountdownLevel(5, 19),
  )
  assert [s.name for s in countdown.parse_levels("")] == [
    "2n9", "2n19", "3n9", "3n19", "4n9", "4n19", "5n9", "5n19",
  ]  # fmt: skip
  for bad in ("2x9+", "1n9", "7n9", "3n1", "3n100", "2n9,2n9"):
    with pytest.raises(ValueError):
      countdown.parse_levels(bad)


@pytest.mark.parametrize(
  "response, reward",
  [
    ("7*3+2", 1.0),  # the reference
    ("2+3*7", 1.0),  # another right expression
    (" 2 + 7*3 ", 1.0),  # spaces
    ("(2+7*3)", 1.0),
    ("7*(3+2)", 0.0),  # the numbers, another value
    ("7*3", 0.0),  # a number unused
    ("7*3+2+2", 0.0),  # a number used twice
    ("7*3+02", 0.0),  # a leading zero is not the number 2
    ("21+2", 0.0),  # not the given numbers
    ("7*3+4/2", 0.0),  # division is not an operator of the task
    ("7*3+2=23", 0.0),  # an expression, nothing else
    ("7*3--2", 0.0),  # negation is not an operator of the task
    ("2-(-7*3)", 0.0),
    ("-2+7*3+4", 0.0),
    ("7*3+(2", 0.0),  # syntax
    ("", 0.0),
    ("7" * 1_000_000, 0.0),  # a megabyte of digits: refused before it is read
    (None, 0.0),
  ],
)
def test_the_verifier_accepts_any_right_expression_and_nothing_else(response, reward):
  assert score(response, "7*3+2") == reward


def test_the_verifier_bounds_its_work():
  start = time.process_time()
  rewards = CountdownScorer()(["9" * 1_000_000, "(" * 10_000], ["7*3+2"] * 2).rewards_R
  assert rewards.tolist() == [0.0, 0.0] and time.process_time() - start < 1.0
  with pytest.raises(ValueError, match="2 responses but 1 solutions"):
    CountdownScorer()(["1", "2"], ["1+1"])


def test_its_vocabulary_extends_the_default_one(tmp_path):
  tok = vocab.build_tokenizer(tmp_path, "countdown")
  assert {t: i for t, i in vocab.COUNTDOWN_VOCAB.items() if i < len(vocab.VOCAB)} == vocab.VOCAB
  assert len(tok) == vocab.vocab_size("countdown") == len(vocab.VOCAB) + 4
  ids = tok("12,3:(4+5)*6=", add_special_tokens=False)["input_ids"]
  assert len(ids) == 13 and vocab.UNK_ID not in ids
  assert tok.decode(ids) == "12,3:(4+5)*6="


def test_the_task_loads_with_its_tokenizer_scorer_and_plan(tmp_path):
  cfg = tiny_config("test,countdown")
  data = task_lib.load_task(task_sections(cfg), str(tmp_path))
  assert data.level_names == tuple(s.name for s in countdown.DEFAULT_LEVELS)
  assert data.vocab_size == vocab.vocab_size("countdown")
  p = task_lib.prompt_len(cfg.task)
  assert (
    data.train_prompt_ids.shape[1] == p == countdown.max_lengths(countdown.DEFAULT_LEVELS)[0] + 1
  )
  assert data.score(list(data.heldout_answers[:3]), data.heldout_answers[:3]).tolist() == [1.0] * 3
  texts = data.tokenizer.batch_decode(data.sft_target_ids[:4], skip_special_tokens=True)
  assert all(score(t, t) == 1.0 for t in texts)
  # --plan sizes the model with the task's own vocabulary (every built-in variant).
  for arg in ("test,countdown", "test,tools", "test"):
    c = tiny_config(arg)
    assert plan.architecture(c)[0].vocab_size == len(
      task_lib.load_task(task_sections(c), str(tmp_path / arg)).tokenizer
    )


@pytest.mark.parametrize(
  "overrides, field",
  [
    ({"task.digit_width": 5}, "task.digit_width"),
    ({"task.environment": "calculator"}, "task.environment"),
  ],
)
def test_config_refuses_what_countdown_does_not_do(overrides, field):
  with pytest.raises(ConfigError, match=field):
    tiny_config("test,countdown", **overrides)


def test_a_response_too_short_for_the_levels_is_refused(tmp_path):
  """5 numbers up to 19 need 20 characters and EOS."""
  with pytest.raises(ConfigError, match="rollout.max_new_tokens.*need up to 21 tokens"):
    task_lib.load_task(
      task_sections(tiny_config("test,countdown", **{"rollout.max_new_tokens": 20})), str(tmp_path)
    )


def test_levels_of_one_count_never_share_a_problem():
  """A problem belongs to the level of its count with the smallest bound that holds it; a level's
  problems do not depend on the split sizes (a larger one extends them) or on later levels."""
  levels = countdown.parse_levels("2n9,2n19,3n19")
  assert countdown.owns(levels[0], [3, 9], levels) and not countdown.owns(levels[1], [3, 9], levels)
  assert countdown.owns(levels[1], [3, 10], levels) and countdown.owns(levels[2], [1, 2, 3], levels)
  train, _ = countdown.build_task(countdown.CountdownConfig(levels=levels, num_train_per_level=50))
  assert all(max(_parse(p.prompt)[0]) > 9 for p in train if p.level == 1)
  bigger, _ = countdown.build_task(countdown.CountdownConfig(levels=levels, num_train_per_level=80))
  fewer, _ = countdown.build_task(
    countdown.CountdownConfig(levels=levels[:2], num_train_per_level=50)
  )
  for level in range(3):
    prompts = [p.prompt for p in train if p.level == level]
    assert [p.prompt for p in bigger if p.level == level][: len(prompts)] == prompts
    if level < 2:
      assert [p.prompt for p in fewer if p.level == level] == prompts


def test_a_bad_level_names_the_field(tmp_path):
  with pytest.raises(ConfigError, match="task.levels"):
    task_lib.load_task(
      task_sections(tiny_config("test,countdown", **{"task.levels": "3x2+"})), str(tmp_path)
    )


def test_a_short_run_trains_and_evaluates_every_level(tmp_path):
  """tiny:countdown end to end at test size, with the annealing phase on its upper half: the
  steps run, the held-out evaluation reports pass@1/8/32 for each of the eight levels."""
  cfg = tiny_config("test,countdown,anneal", steps=4)
  assert cfg.anneal_phase.mixture == "4n9,4n19,5n9,5n19"
  Trainer.open(cfg, str(tmp_path)).run()
  rows = read_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) and 0 <= r["reward"] <= 1 for r in rows)
  with open(tmp_path / "eval_step4.json") as f:
    result = json.load(f)
  assert sorted(result["pass_at"]) == ["1", "32", "8"]
  assert [result["num_questions"][str(i)] for i in range(8)] == [2] * 8
