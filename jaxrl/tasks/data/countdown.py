"""Built-in verifiable task where exploration matters: countdown, "reach the target with these numbers".

A problem is a prompt such as ``"7,3,2:23="``: write an expression that uses each of the numbers
exactly once, with ``+``, ``-``, ``*`` and parentheses, and equals the target (``7*3+2``). Many
expressions are right, few of the ones a model tries are: with more numbers the search space grows
factorially while the model's prior stays broad, so after a warm start the pass rate is low and what
a method samples decides what it learns. The verifier is exact (``jaxrl.tasks.rewards.countdown``).

A level is how many numbers are given and how large they are (``"4n19"``: four numbers in 1..19).
Levels of one count never share a problem: a problem belongs to the level with the smallest bound
that holds its numbers (with 2n9 a level too, 2n19's problems have a number above 9). Every problem
is made by a chain over all its numbers in a random order, ((n1 op n2) op n3) ..., whose
intermediates stay in [0, ``MAX_VALUE``] and whose value, the target, in [1, ``MAX_VALUE``]; that
chain, written with the fewest parentheses, is the reference solution the SFT corpus shows and the
evaluation logs. The numbers are shown in another random order.

The train / held-out split holds by construction, independently of the seed: a problem is held-out
iff a fixed hash of (its numbers sorted, its target) falls in bucket 0 of ``heldout_modulus``, so the
same numbers and target never appear on both sides, in whatever order or with whatever solution.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence

import numpy as np

from jaxrl.tasks.data.arithmetic import Problem, check_splits

OPS = ("+", "-", "*")
MAX_VALUE = 999  # targets and every intermediate of a reference chain
# Fixed forever: changing it would move problems between train and held-out.
_SPLIT_SALT = b"jaxrl-countdown-v1"
_LEVEL = re.compile(r"(\d+)n(\d+)")


@dataclasses.dataclass(frozen=True)
class CountdownLevel:
  """``count`` numbers, each in [1, ``max_value``]."""

  count: int
  max_value: int

  def __post_init__(self):
    if not 2 <= self.count <= 6:
      raise ValueError(f"a countdown level gives 2 to 6 numbers, got {self.count}")
    if not 2 <= self.max_value <= 99:
      raise ValueError(f"a countdown level's numbers go up to 2..99, got {self.max_value}")

  @property
  def name(self) -> str:
    """Its label and config spec, e.g. '4n19'."""
    return f"{self.count}n{self.max_value}"


# Two to five numbers, small and larger: the lower half is learnable by a tiny model's warm start,
# the upper half needs search (four and five numbers have thousands of orderings and operators).
DEFAULT_LEVELS: tuple[CountdownLevel, ...] = tuple(
  CountdownLevel(count, max_value) for count in (2, 3, 4, 5) for max_value in (9, 19)
)


def parse_levels(text: str) -> tuple[CountdownLevel, ...]:
  """Levels from a config string such as ``"2n9, 3n19"`` ('' gives DEFAULT_LEVELS)."""
  if not text.strip():
    return DEFAULT_LEVELS
  levels = []
  for item in text.split(","):
    item = item.replace(" ", "")
    match = _LEVEL.fullmatch(item)
    if match is None:
      raise ValueError(f"bad countdown level {item!r} in {text!r}, expected e.g. '4n19'")
    levels.append(CountdownLevel(int(match[1]), int(match[2])))
  if len(set(levels)) != len(levels):
    raise ValueError(f"duplicate countdown levels in {text!r}")
  return tuple(levels)


def chain(numbers: Sequence[int], ops: Sequence[str]) -> tuple[str, list[int]]:
  """The expression ((n1 op1 n2) op2 n3) ... with the fewest parentheses, and its running values
  (one per op). ``*`` after a top-level ``+``/``-`` needs the parentheses; nothing else does, since
  ``+``, ``-`` and ``*`` are left-associative."""
  if len(ops) != len(numbers) - 1:
    raise ValueError(f"{len(numbers)} numbers need {len(numbers) - 1} operators, got {len(ops)}")
  text, value, top = str(numbers[0]), numbers[0], ""
  values = []
  for op, n in zip(ops, numbers[1:]):
    if op == "*" and top in ("+", "-"):
      text = f"({text})"
    text += f"{op}{n}"
    value = value + n if op == "+" else value - n if op == "-" else value * n
    values.append(value)
    top = op
  return text, values


def format_prompt(numbers: Sequence[int], target: int) -> str:
  return ",".join(map(str, numbers)) + f":{target}="


def is_heldout(numbers: Sequence[int], target: int, heldout_modulus: int) -> bool:
  key = ",".join(map(str, sorted(numbers))) + f":{target}"
  digest = hashlib.blake2b(key.encode(), digest_size=8, key=_SPLIT_SALT).digest()
  return int.from_bytes(digest, "little") % heldout_modulus == 0


def _draw(level: CountdownLevel, rng: np.random.Generator) -> tuple[list[int], int, str] | None:
  """One candidate (numbers as shown, target, reference solution); None when its chain leaves
  [0, MAX_VALUE] or ends at 0."""
  numbers = rng.integers(1, level.max_value + 1, size=level.count).tolist()
  ops = [OPS[i] for i in rng.integers(0, len(OPS), size=level.count - 1)]
  solution, values = chain(numbers, ops)
  if min(values) < 0 or max(values) > MAX_VALUE or values[-1] == 0:
    return None
  shown = [numbers[i] for i in rng.permutation(level.count)]
  return shown, values[-1], solution


def owns(level: CountdownLevel, numbers: Sequence[int], levels: Sequence[CountdownLevel]) -> bool:
  """Whether a problem with ``numbers`` belongs to ``level`` among ``levels``: to the level of its
  count with the smallest bound that holds it (2n19's problems are those with a number above 9
  when 2n9 is a level too), so levels never share a problem, whatever their order or sizes."""
  top = max(numbers)
  return level.max_value == min(
    s.max_value for s in levels if s.count == level.count and s.max_value >= top
  )


def _problems(
  level: CountdownLevel,
  levels: Sequence[CountdownLevel],
  n: int,
  heldout: bool,
  modulus: int,
  rng: np.random.Generator,
) -> list[tuple[str, str]]:
  """Up to ``n`` distinct (prompt, solution) pairs of one split of one level (distinct by numbers
  sorted and target); fewer when the level has fewer (two numbers up to 9 make a few hundred)."""
  chosen: dict[tuple, tuple[str, str]] = {}
  # A candidate lands in the held-out split one time in `modulus`.
  for _ in range((50 * n + 1000) * (modulus if heldout else 1)):
    if len(chosen) == n:
      break
    drawn = _draw(level, rng)
    if drawn is None:
      continue
    numbers, target, solution = drawn
    key = (tuple(sorted(numbers)), target)
    if (
      key not in chosen
      and owns(level, numbers, levels)
      and is_heldout(numbers, target, modulus) == heldout
    ):
      chosen[key] = (format_prompt(numbers, target), solution)
  return list(chosen.values())


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
  """Which problems exist and how many of each split are drawn (upper bounds per level: a small
  level contributes what it has). ``sft_level_weights``: relative SFT mixing weights (None:
  uniform)."""

  levels: tuple[CountdownLevel, ...] = DEFAULT_LEVELS
  num_train_per_level: int = 400
  num_heldout_per_level: int = 48
  seed: int = 0
  heldout_modulus: int = 10
  sft_level_weights: tuple[float, ...] | None = None

  def __post_init__(self):
    check_splits(self)
    weights = self.sft_level_weights
    if weights is not None and (
      len(weights) != len(self.levels) or min(weights) < 0 or not any(weights)
    ):
      raise ValueError(f"need {len(self.levels)} non-negative SFT level weights, got {weights}")


def build_task(cfg: CountdownConfig) -> tuple[list[Problem], list[Problem]]:
  """(train, held-out) problems, deterministic in ``cfg``; qids are 0..N-1 per split; a problem's
  answer is its reference solution (the verifier reads the numbers and target from it)."""
  splits: tuple[list[Problem], list[Problem]] = ([], [])
  for split, (heldout, n) in enumerate(
    ((False, cfg.num_train_per_level), (True, cfg.num_heldout_per_level))
  ):
    for level, spec in enumerate(cfg.levels):
      # One stream per (seed, split, level): resizing one level leaves the others as they were.
      rng = np.random.default_rng([cfg.seed, split, level, 7])
      for prompt, solution in _problems(spec, cfg.levels, n, heldout, cfg.heldout_modulus, rng):
        splits[split].append(Problem(len(splits[split]), level, prompt, solution))
  return splits


def sft_corpus(cfg: CountdownConfig, num_examples: int, seed: int) -> list[tuple[str, str]]:
  """(prompt, reference solution) pairs of train problems, drawn afresh (with replacement across
  draws) from the levels weighted by ``cfg.sft_level_weights``."""
  w_L = (
    np.ones(len(cfg.levels))
    if cfg.sft_level_weights is None
    else np.asarray(cfg.sft_level_weights, np.float64)
  )
  rng = np.random.default_rng([seed, 2, 7])
  level_N = rng.choice(len(cfg.levels), size=num_examples, p=w_L / w_L.sum())
  out: list[tuple[str, str] | None] = [None] * num_examples
  for level, spec in enumerate(cfg.levels):
    slots = np.flatnonzero(level_N == level).tolist()
    drawn: list[tuple[str, str]] = []
    for _ in range(50 * len(slots) + 1000):
      if len(drawn) == len(slots):
        break
      candidate = _draw(spec, rng)
      if (
        candidate is not None
        and owns(spec, candidate[0], cfg.levels)
        and not is_heldout(*candidate[:2], cfg.heldout_modulus)
      ):
        drawn.append((format_prompt(*candidate[:2]), candidate[2]))
    if len(drawn) < len(slots):
      raise ValueError(f"level {spec.name} has no train problems to draw")
    for slot, pair in zip(slots, drawn):
      out[slot] = pair
  return out  # type: ignore[return-value]


def max_lengths(levels: Sequence[CountdownLevel]) -> tuple[int, int]:
  """(longest prompt, longest reference solution) in characters; add BOS / EOS for tokens."""
  target = len(str(MAX_VALUE))
  prompt = max(s.count * (len(str(s.max_value)) + 1) + target + 1 for s in levels)
  # Numbers, operators, and a pair of parentheses for every '*' but the first operator.
  solution = max(
    s.count * len(str(s.max_value)) + (s.count - 1) + 2 * (s.count - 2) for s in levels
  )
  return prompt, solution
