"""The arithmetic task with the calculator: the examples its SFT corpus shows.

The corpus shows the format on easy levels only (answers of at most ``SFT_MAX_ANSWER_DIGITS``
digits, which a tiny model can also compute in its head): a ``SFT_TOOL_FRACTION`` of its examples
call the calculator with the question's expression and copy the result, the others answer
directly. RL then has both behaviours to choose from on the hard levels (5-digit by 3-digit
products, sums of 6 to 8 digit numbers), where only a call and a faithful copy score: it learns
when to call and to copy. Draws come from ``arithmetic.sft_corpus`` (train buckets only).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.tasks.data import arithmetic

SFT_MAX_ANSWER_DIGITS = 4
SFT_TOOL_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class ToolExample:
  """One SFT example: the model calls ``call`` (None: answers directly), then writes ``answer``."""

  prompt: str
  call: str | None
  answer: str


def answer_digits(spec: arithmetic.LevelSpec) -> int:
  """The most digits an answer of the level has (natural layout)."""
  return arithmetic.max_lengths((spec,))[1]


def sft_level_weights(levels) -> tuple[float, ...]:
  """1 for each easy level (answers of at most ``SFT_MAX_ANSWER_DIGITS`` digits), 0 otherwise."""
  weights = tuple(float(answer_digits(s) <= SFT_MAX_ANSWER_DIGITS) for s in levels)
  if not any(weights):
    raise ValueError(
      f"no level has answers of at most {SFT_MAX_ANSWER_DIGITS} digits: the tool task's SFT "
      f"corpus shows the calls on such levels (levels: {', '.join(s.name for s in levels)})"
    )
  return weights


def sft_examples(cfg: arithmetic.TaskConfig, num_examples: int, seed: int) -> list[ToolExample]:
  """``num_examples`` examples of the easy levels, each calling the tool with probability
  ``SFT_TOOL_FRACTION``; deterministic in (cfg, seed)."""
  if cfg.digit_width or cfg.reverse_answer:
    raise ValueError("the tool task writes numbers as usual: digit_width 0, reverse_answer off")
  pairs = arithmetic.sft_corpus(cfg, num_examples, seed, sft_level_weights(cfg.levels))
  # Its own stream: the problems are sft_corpus's whatever the fraction.
  calls_N = np.random.default_rng([seed, 3]).random(num_examples) < SFT_TOOL_FRACTION
  return [
    ToolExample(prompt, prompt.removesuffix("=") if call else None, answer)
    for (prompt, answer), call in zip(pairs, calls_N.tolist())
  ]
