"""Built-in verifiable task: integer arithmetic with graded difficulty levels.

A problem is a prompt such as ``"57+68="`` and its canonical answer ``"125"`` (or ``"521"`` when
answers are written least-significant digit first). Difficulty is set by the operand digit counts of
each level, so a tiny model can be warm-started until it is partly capable and then improved by RL.

The train / held-out split holds by construction, independently of the seed: an operand pair is
held-out iff a fixed 64-bit hash of (op, a, b) falls in bucket 0 of ``heldout_modulus``. Train
problems and the SFT corpus are only drawn from the other buckets, so no held-out problem can ever
be trained on, whatever the seed, the sizes or the level mixture. For commutative ops the hash is
taken on the unordered pair, so ``12+34`` and ``34+12`` always land on the same side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

_OPS = ("+", "-", "*")
# Pools up to this many ordered pairs are enumerated (exact sampling without replacement); larger
# pools are rejection-sampled, which is cheap because requests are tiny compared to the pool.
_ENUMERATE_MAX_PAIRS = 2_000_000
# Fixed forever: changing it would move problems between train and held-out.
_SPLIT_SALT = np.uint64(0x6A6178726C2D6172)  # "jaxrl-ar"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One question: ``qid`` indexes its split, ``level`` indexes ``TaskConfig.levels``."""

  qid: int
  level: int
  prompt: str
  answer: str


@dataclasses.dataclass(frozen=True)
class LevelSpec:
  """Operands with exactly ``digits_a`` / ``digits_b`` digits (1 digit includes 0).

  ``-`` keeps results non-negative (a >= b); ``*`` is meant for small operands.
  """

  digits_a: int
  digits_b: int
  op: str = "+"

  def __post_init__(self):
    if self.op not in _OPS:
      raise ValueError(f"op must be one of {_OPS}, got {self.op!r}")
    if not (1 <= self.digits_a <= 9 and 1 <= self.digits_b <= 9):
      raise ValueError(f"digit counts must be in [1, 9], got {self}")
    if self.op == "-" and self.digits_a < self.digits_b:
      raise ValueError(f"'-' needs digits_a >= digits_b for a >= b, got {self}")

  @property
  def name(self) -> str:
    """Short label for logs, e.g. '3+2'."""
    return f"{self.digits_a}{self.op}{self.digits_b}"


# Addition only, each level adding one digit to one operand (one more column to add and carry).
# A prototype with square levels n+n (n = 1..4) jumped from ~80% to ~1-16% after SFT; the
# asymmetric levels (2+1, 3+2, 4+3) sit between them so most levels start mid-range, and 5+5 leaves
# headroom for answers written least-significant first, which tiny models learn much more easily.
DEFAULT_LEVELS: tuple[LevelSpec, ...] = (
  LevelSpec(1, 1),
  LevelSpec(2, 1),
  LevelSpec(2, 2),
  LevelSpec(3, 2),
  LevelSpec(3, 3),
  LevelSpec(4, 3),
  LevelSpec(4, 4),
  LevelSpec(5, 5),
)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Which problems exist and how many of each split are drawn.

  ``num_*_per_level`` are upper bounds: a level whose pool is smaller (1+1 has 100 ordered pairs,
  about 10 of them held-out) contributes all of its problems. ``reverse_answer`` writes answer
  digits least-significant first (default on: the carry is then known when each digit is emitted,
  so a tiny transformer can compute the answer left to right). ``heldout_modulus`` = 10 holds out
  about 10% of every level. ``sft_level_weights`` are relative SFT mixing weights (None: uniform).
  ``digit_width`` > 0 selects the aligned layout (see ``format_problem``).
  """

  levels: tuple[LevelSpec, ...] = DEFAULT_LEVELS
  num_train_per_level: int = 256
  num_heldout_per_level: int = 64
  seed: int = 0
  heldout_modulus: int = 10
  reverse_answer: bool = True
  digit_width: int = 0
  sft_level_weights: tuple[float, ...] | None = None

  def __post_init__(self):
    check_splits(self)


def check_splits(problems) -> None:
  """The levels and split sizes of a built-in task's problems config (``problems``: this task's
  ``TaskConfig``, countdown's ``CountdownConfig``)."""
  if not problems.levels:
    raise ValueError("levels must not be empty")
  if len(set(problems.levels)) != len(problems.levels):
    raise ValueError(f"duplicate levels: {', '.join(s.name for s in problems.levels)}")
  if problems.heldout_modulus < 2:
    raise ValueError("heldout_modulus must be >= 2 (bucket 0 is held-out, the rest is train)")
  if min(problems.num_train_per_level, problems.num_heldout_per_level) < 0:
    raise ValueError("split sizes must be non-negative")


def operand_range(digits: int) -> tuple[int, int]:
  """Inclusive [lo, hi] of integers with exactly ``digits`` digits (1 digit: 0..9)."""
  return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def _mix64(x_N: np.ndarray) -> np.ndarray:
  """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
  x_N = x_N ^ (x_N >> np.uint64(30))
  x_N = x_N * np.uint64(0xBF58476D1CE4E5B9)
  x_N = x_N ^ (x_N >> np.uint64(27))
  x_N = x_N * np.uint64(0x94D049BB133111EB)
  return x_N ^ (x_N >> np.uint64(31))


def split_hash(op: str, a_N: np.ndarray, b_N: np.ndarray) -> np.ndarray:
  """Fixed uint64 hash of each problem (unordered pair for commutative ops)."""
  a_N, b_N = np.broadcast_arrays(np.asarray(a_N, np.uint64), np.asarray(b_N, np.uint64))
  shape = a_N.shape
  # 1-D throughout: numpy wraps uint64 overflow silently for arrays but warns for scalars.
  a_N, b_N = a_N.ravel(), b_N.ravel()
  if op in ("+", "*"):
    a_N, b_N = np.minimum(a_N, b_N), np.maximum(a_N, b_N)
  h_N = _mix64(np.full(a_N.shape, _SPLIT_SALT ^ np.uint64(_OPS.index(op) + 1), dtype=np.uint64))
  h_N = _mix64(h_N ^ a_N)
  return _mix64(h_N ^ b_N).reshape(shape)


def is_heldout(op: str, a_N, b_N, heldout_modulus: int) -> np.ndarray:
  """Bool mask: which (op, a, b) belong to the held-out split."""
  return split_hash(op, a_N, b_N) % np.uint64(heldout_modulus) == 0


def answer_width(op: str, digit_width: int) -> int:
  """Digits of the zero-padded answer in the aligned layout."""
  return digit_width + 1 if op == "+" else digit_width if op == "-" else 2 * digit_width


def format_problem(
  spec: LevelSpec, a: int, b: int, reverse_answer: bool, digit_width: int = 0
) -> tuple[str, str]:
  """(prompt, canonical answer) of one problem.

  ``digit_width`` = 0: numbers as usual ("12+345=", answer "357", or "753" reversed).
  ``digit_width`` = W: the aligned layout: every number is zero-padded (operands to W digits, the
  answer to ``answer_width``) and written least-significant digit first ("21000+54300=" → "753000").
  Digit i of both operands and of the answer then sits at the same offset in every problem, so a
  tiny model learns one digit-wise rule instead of a length-dependent alignment per level; a level's
  difficulty is then how many digit positions (and carries) it really uses.
  """
  value = a + b if spec.op == "+" else a - b if spec.op == "-" else a * b
  if digit_width:
    if max(spec.digits_a, spec.digits_b) > digit_width:
      raise ValueError(f"level {spec.name} does not fit digit_width={digit_width}")
    a_text, b_text = str(a).zfill(digit_width)[::-1], str(b).zfill(digit_width)[::-1]
    return f"{a_text}{spec.op}{b_text}=", str(value).zfill(answer_width(spec.op, digit_width))[::-1]
  answer = str(value)
  return f"{a}{spec.op}{b}=", answer[::-1] if reverse_answer else answer


def max_lengths(levels: Sequence[LevelSpec], digit_width: int = 0) -> tuple[int, int]:
  """(longest prompt, longest answer) in characters over ``levels``; add BOS / EOS for tokens."""
  if digit_width:
    return 2 * digit_width + 2, max(answer_width(s.op, digit_width) for s in levels)
  prompt = max(s.digits_a + s.digits_b + 2 for s in levels)
  answer = max(
    max(s.digits_a, s.digits_b) + 1
    if s.op == "+"
    else s.digits_a
    if s.op == "-"
    else s.digits_a + s.digits_b
    for s in levels
  )
  return prompt, answer


def _candidates(spec: LevelSpec, rng: np.random.Generator, k: int):
  """k uniform ordered pairs of the level (may violate a >= b for '-')."""
  lo_a, hi_a = operand_range(spec.digits_a)
  lo_b, hi_b = operand_range(spec.digits_b)
  return rng.integers(lo_a, hi_a + 1, size=k), rng.integers(lo_b, hi_b + 1, size=k)


def _valid(spec: LevelSpec, a_N, b_N, heldout: bool, modulus: int) -> np.ndarray:
  """Pairs allowed in the requested split (and a >= b for '-')."""
  ok_N = is_heldout(spec.op, a_N, b_N, modulus) == heldout
  return ok_N & (a_N >= b_N) if spec.op == "-" else ok_N


def _sample_unique(spec, n, heldout, modulus, rng) -> list[tuple[int, int]]:
  """Up to n distinct pairs of one split of one level, uniformly without replacement."""
  lo_a, hi_a = operand_range(spec.digits_a)
  lo_b, hi_b = operand_range(spec.digits_b)
  if (hi_a - lo_a + 1) * (hi_b - lo_b + 1) <= _ENUMERATE_MAX_PAIRS:
    a_N, b_N = np.meshgrid(np.arange(lo_a, hi_a + 1), np.arange(lo_b, hi_b + 1), indexing="ij")
    a_N, b_N = a_N.ravel(), b_N.ravel()
    keep_N = np.flatnonzero(_valid(spec, a_N, b_N, heldout, modulus))
    pick_N = rng.permutation(keep_N)[:n]
    return list(zip(a_N[pick_N].tolist(), b_N[pick_N].tolist()))
  chosen: dict[tuple[int, int], None] = {}  # insertion-ordered set keeps the draw order
  for _ in range(1000):
    a_N, b_N = _candidates(spec, rng, 2 * n + 64)
    ok_N = _valid(spec, a_N, b_N, heldout, modulus)
    for pair in zip(a_N[ok_N].tolist(), b_N[ok_N].tolist()):
      chosen.setdefault(pair)
      if len(chosen) == n:
        return list(chosen)
  raise ValueError(f"could not draw {n} distinct problems for level {spec.name}")


def build_task(cfg: TaskConfig) -> tuple[list[Problem], list[Problem]]:
  """(train, held-out) problem lists, deterministic in ``cfg``; qids are 0..N-1 per split."""
  splits: tuple[list[Problem], list[Problem]] = ([], [])
  for split, (heldout, n) in enumerate(
    ((False, cfg.num_train_per_level), (True, cfg.num_heldout_per_level))
  ):
    for level, spec in enumerate(cfg.levels):
      # One independent stream per (seed, split, level): resizing one level leaves others intact.
      rng = np.random.default_rng([cfg.seed, split, level])
      for a, b in _sample_unique(spec, n, heldout, cfg.heldout_modulus, rng):
        prompt, answer = format_problem(spec, a, b, cfg.reverse_answer, cfg.digit_width)
        splits[split].append(Problem(len(splits[split]), level, prompt, answer))
  return splits


def sft_corpus(
  cfg: TaskConfig, num_examples: int, seed: int, level_weights: Sequence[float] | None = None
) -> list[tuple[str, str]]:
  """(prompt, completion) pairs drawn with replacement from the train buckets of every level.

  ``level_weights`` (default ``cfg.sft_level_weights``, else uniform) set the level mixture. The
  completion is the canonical answer without EOS; the encoder appends the tokenizer's EOS.
  """
  weights = level_weights if level_weights is not None else cfg.sft_level_weights
  w_L = np.ones(len(cfg.levels)) if weights is None else np.asarray(weights, dtype=np.float64)
  if w_L.shape != (len(cfg.levels),) or (w_L < 0).any() or w_L.sum() <= 0:
    raise ValueError(f"need {len(cfg.levels)} non-negative level weights, got {weights}")
  # A 2-word seed never equals build_task's 3-word (seed, split, level) streams.
  rng = np.random.default_rng([seed, 2])
  level_N = rng.choice(len(cfg.levels), size=num_examples, p=w_L / w_L.sum())
  out: list[tuple[str, str] | None] = [None] * num_examples
  for level, spec in enumerate(cfg.levels):
    slots = np.flatnonzero(level_N == level).tolist()
    pairs: list[tuple[int, int]] = []
    for _ in range(1000):
      if len(pairs) >= len(slots):
        break
      a_N, b_N = _candidates(spec, rng, 2 * (len(slots) - len(pairs)) + 64)
      ok_N = _valid(spec, a_N, b_N, False, cfg.heldout_modulus)
      pairs.extend(zip(a_N[ok_N].tolist(), b_N[ok_N].tolist()))
    if len(pairs) < len(slots):
      raise ValueError(f"level {spec.name} has no train problems to draw")
    for slot, (a, b) in zip(slots, pairs):
      out[slot] = format_problem(spec, a, b, cfg.reverse_answer, cfg.digit_width)
  return out  # type: ignore[return-value]


def parse_levels(text: str) -> tuple[LevelSpec, ...]:
  """Levels from a config string such as ``"1x1+, 2x2+, 3x2-"`` ('' gives DEFAULT_LEVELS)."""
  if not text.strip():
    return DEFAULT_LEVELS
  levels = []
  for item in text.split(","):
    item = item.replace(" ", "")
    try:
      if not item or item[-1] not in _OPS:
        raise ValueError
      da, db = item[:-1].split("x")
      levels.append(LevelSpec(int(da), int(db), item[-1]))
    except ValueError as e:
      detail = f": {e}" if str(e) else ""
      raise ValueError(f"bad level {item!r} in {text!r}, expected e.g. '3x2+'{detail}") from None
  return tuple(levels)
