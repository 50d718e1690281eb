"""The arithmetic task and its verifier, against Python-int oracles.

The held-out rule is re-derived here with a pure-Python splitmix64 (no numpy), answers are
recomputed from the parsed prompt with Python ints, and the split is checked both by that rule and
by direct set disjointness against large SFT corpora drawn with several seeds.
"""

import re
import warnings

import numpy as np
import pytest

from jaxrl.tasks.data.arithmetic import (
  DEFAULT_LEVELS,
  LevelSpec,
  TaskConfig,
  build_task,
  is_heldout,
  max_lengths,
  operand_range,
  parse_levels,
  sft_corpus,
)
from jaxrl.tasks.rewards import MAX_RESPONSE_CHARS, score, score_batch

M64 = (1 << 64) - 1
SALT = 0x6A6178726C2D6172
PROMPT_RE = re.compile(r"^(\d+)([+\-*])(\d+)=$")
MIXED_LEVELS = DEFAULT_LEVELS + (LevelSpec(2, 2, "-"), LevelSpec(3, 3, "-"), LevelSpec(2, 1, "*"))


def mix64(x):
  x ^= x >> 30
  x = (x * 0xBF58476D1CE4E5B9) & M64
  x ^= x >> 27
  x = (x * 0x94D049BB133111EB) & M64
  return x ^ (x >> 31)


def oracle_heldout(op, a, b, modulus=10):
  """The split rule in plain Python: bucket 0 of a hash of (op, unordered pair if commutative)."""
  if op in "+*":
    a, b = min(a, b), max(a, b)
  h = mix64(SALT ^ ("+-*".index(op) + 1))
  return mix64(mix64(h ^ a) ^ b) % modulus == 0


def parse(prompt):
  a, op, b = PROMPT_RE.match(prompt).groups()
  return int(a), op, int(b)


def oracle_answer(prompt, reverse):
  a, op, b = parse(prompt)
  value = {"+": a + b, "-": a - b, "*": a * b}[op]
  return str(value)[::-1] if reverse else str(value)


def prompt_is_heldout(prompt):
  a, op, b = parse(prompt)
  return oracle_heldout(op, a, b)


def key(prompt):
  a, op, b = parse(prompt)
  return (op, min(a, b), max(a, b)) if op in "+*" else (op, a, b)


def digits(x):
  return len(str(x))


@pytest.fixture(scope="module")
def mixed_cfg():
  return TaskConfig(levels=MIXED_LEVELS, num_train_per_level=300, num_heldout_per_level=60, seed=3)


@pytest.fixture(scope="module")
def mixed_task(mixed_cfg):
  return build_task(mixed_cfg)


def test_answers_levels_and_qids(mixed_cfg, mixed_task):
  for split in mixed_task:
    assert [p.qid for p in split] == list(range(len(split)))
    for p in split:
      spec = mixed_cfg.levels[p.level]
      a, op, b = parse(p.prompt)
      assert op == spec.op
      assert (digits(a), digits(b)) == (spec.digits_a, spec.digits_b)
      if op == "-":
        assert a >= b
      assert p.answer == oracle_answer(p.prompt, reverse=True)


def test_forward_answer_format():
  train, _ = build_task(TaskConfig(num_train_per_level=50))
  fwd_train, _ = build_task(TaskConfig(num_train_per_level=50, reverse_answer=False))
  assert [p.prompt for p in fwd_train] == [p.prompt for p in train]  # format only changes answers
  for p in fwd_train:
    assert p.answer == oracle_answer(p.prompt, reverse=False)
  assert any(p.answer != q.answer for p, q in zip(train, fwd_train))


def test_split_rule_and_disjointness(mixed_cfg, mixed_task):
  train, heldout = mixed_task
  assert all(prompt_is_heldout(p.prompt) for p in heldout)
  assert not any(prompt_is_heldout(p.prompt) for p in train)
  heldout_keys = {key(p.prompt) for p in heldout}
  assert not heldout_keys & {key(p.prompt) for p in train}
  for seed in range(3):
    corpus = sft_corpus(mixed_cfg, 20_000, seed)
    assert not heldout_keys & {key(prompt) for prompt, _ in corpus}
    # Held-out of any other seed is excluded too: the rule does not depend on the seed.
    assert not any(prompt_is_heldout(prompt) for prompt, _ in corpus)
  other_train, _ = build_task(TaskConfig(levels=MIXED_LEVELS, seed=99))
  assert not heldout_keys & {key(p.prompt) for p in other_train}


def test_no_duplicates_within_split(mixed_task):
  for split in mixed_task:
    pairs = [(p.level, p.prompt) for p in split]
    assert len(set(pairs)) == len(pairs)


def test_heldout_fraction_by_enumeration():
  # Every 2+2 and 2-2 problem classified by the oracle: about 1 in 10 is held-out.
  for op in "+-":
    lo, hi = operand_range(2)
    flags = [oracle_heldout(op, a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    assert 0.08 < np.mean(flags) < 0.12


def test_is_heldout_scalar_and_array_match_oracle():
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 10**9, size=200), rng.integers(0, 10**9, size=200)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no overflow warnings from uint64 scalars
    for op in "+-*":
      expected = [oracle_heldout(op, int(x), int(y), 7) for x, y in zip(a, b)]
      assert is_heldout(op, a, b, 7).tolist() == expected
      assert [bool(is_heldout(op, int(x), int(y), 7)) for x, y in zip(a, b)] == expected


def test_small_level_is_exhausted_exactly():
  cfg = TaskConfig(levels=(LevelSpec(1, 1),), num_train_per_level=1000, num_heldout_per_level=1000)
  train, heldout = build_task(cfg)
  everything = {f"{a}+{b}=" for a in range(10) for b in range(10)}
  assert {p.prompt for p in train} | {p.prompt for p in heldout} == everything
  assert {p.prompt for p in heldout} == {
    f"{a}+{b}=" for a in range(10) for b in range(10) if oracle_heldout("+", a, b)
  }


def test_determinism_and_seed_dependence():
  cfg = TaskConfig(num_train_per_level=40, num_heldout_per_level=8, seed=7)
  assert build_task(cfg) == build_task(cfg)
  assert sft_corpus(cfg, 500, 1) == sft_corpus(cfg, 500, 1)
  assert sft_corpus(cfg, 500, 1) != sft_corpus(cfg, 500, 2)
  other = TaskConfig(num_train_per_level=40, num_heldout_per_level=8, seed=8)
  assert [p.prompt for p in build_task(cfg)[0]] != [p.prompt for p in build_task(other)[0]]


def test_sft_level_weights():
  cfg = TaskConfig(levels=(LevelSpec(1, 1), LevelSpec(3, 3), LevelSpec(5, 5)))
  only_first = sft_corpus(cfg, 300, 0, level_weights=(1.0, 0.0, 0.0))
  assert all(digits(parse(p)[0]) == 1 for p, _ in only_first)
  mix = sft_corpus(cfg, 20_000, 0, level_weights=(1.0, 1.0, 2.0))
  counts = np.bincount([digits(parse(p)[0]) for p, _ in mix], minlength=6)[[1, 3, 5]]
  # A sampling bound, not a rounding one: a frequency of 20,000 draws has std ≤ √(¼·¾/20,000) =
  # 0.0031, so 0.02 is 6.5 of them. The draws (numpy's seeded generator, float64 sequential
  # cumulative weights) are the same on every CPU.
  np.testing.assert_allclose(counts / counts.sum(), [0.25, 0.25, 0.5], atol=0.02)
  for prompt, completion in mix:
    assert completion == oracle_answer(prompt, reverse=True)
  with pytest.raises(ValueError):
    sft_corpus(cfg, 10, 0, level_weights=(1.0, 1.0))


def test_max_lengths_bound_the_task(mixed_cfg, mixed_task):
  max_prompt, max_answer = max_lengths(mixed_cfg.levels)
  problems = mixed_task[0] + mixed_task[1]
  assert max(len(p.prompt) for p in problems) <= max_prompt
  assert max(len(p.answer) for p in problems) <= max_answer
  assert max_lengths(DEFAULT_LEVELS) == (12, 6)


def test_parse_levels():
  assert parse_levels("") == DEFAULT_LEVELS
  assert parse_levels("1x1+, 3x2-,2x1*") == (
    LevelSpec(1, 1),
    LevelSpec(3, 2, "-"),
    LevelSpec(2, 1, "*"),
  )
  for bad in ("1x1", "2x3-", "ax1+", "1x0+", "1x1/"):
    with pytest.raises(ValueError):
      parse_levels(bad)


def test_config_validation():
  with pytest.raises(ValueError):
    TaskConfig(levels=(LevelSpec(1, 1), LevelSpec(1, 1)))
  with pytest.raises(ValueError):
    TaskConfig(heldout_modulus=1)
  with pytest.raises(ValueError):
    LevelSpec(1, 1, "/")


# ---- verifier ----


@pytest.mark.parametrize(
  "response,answer,expected",
  [
    ("125", "125", 1.0),
    ("  125\n", "125", 1.0),
    ("125", " 125 ", 1.0),
    ("-7", "-7", 1.0),
    ("126", "125", 0.0),
    ("12", "125", 0.0),
    ("1250", "125", 0.0),
    ("01", "01", 1.0),  # reversed "10"
    ("1", "01", 0.0),  # reversed "1" is one, not ten: leading zeros are significant
    ("0125", "125", 0.0),
    ("+125", "125", 0.0),
    ("12 5", "125", 0.0),
    ("1e2", "100", 0.0),
    ("١٢٥", "125", 0.0),  # non-ASCII digits
    ("", "", 0.0),
    ("-", "-", 0.0),
    ("<pad>", "125", 0.0),
    ("125<unk>", "125", 0.0),
    (None, "125", 0.0),
    (b"125", "125", 0.0),
    (125, "125", 0.0),
    ("125", None, 0.0),
  ],
)
def test_score_cases(response, answer, expected):
  assert score(response, answer) == expected


def test_score_huge_input_is_bounded():
  huge = "1" * (1 << 20)
  assert score(huge, huge) == 0.0
  assert score("1" * MAX_RESPONSE_CHARS, "1" * MAX_RESPONSE_CHARS) == 1.0
  assert score("1" * (MAX_RESPONSE_CHARS + 1), "1" * (MAX_RESPONSE_CHARS + 1)) == 0.0
  # O(1) per over-long response: nothing but its length is looked at (no strip, no digit scan).
  out = score_batch([_LengthOnly(huge)] * 1000, ["1"] * 1000)
  assert not out.any()


class _LengthOnly(str):
  """A response whose content must not be read: any parsing of it fails the test."""

  def _touched(self, *args, **kwargs):
    raise AssertionError("an over-long response was parsed")

  strip = startswith = __iter__ = __getitem__ = __eq__ = _touched
  __hash__ = str.__hash__


def test_score_batch_matches_score():
  responses = ["9", "81", " 18 ", "x", None, "81"]
  answers = ["9", "18", "18", "x", "1", "81"]
  out = score_batch(responses, answers)
  assert out.dtype == np.float32 and out.shape == (6,)
  np.testing.assert_array_equal(out, [1, 0, 1, 0, 0, 1])
  assert score_batch([], []).shape == (0,)
  with pytest.raises(ValueError):
    score_batch(["1"], [])


def test_task_answers_score_one(mixed_task):
  train, heldout = mixed_task
  problems = train + heldout
  assert score_batch([p.answer for p in problems], [p.answer for p in problems]).all()
