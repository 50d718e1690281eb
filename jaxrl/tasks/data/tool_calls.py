"""The arithmetic task with the calculator: the examples its SFT corpus shows.

The corpus draws from the levels ``task.sft_levels`` names, with their weights (``tiny:tools``:
levels a tiny model also computes in its head, longer ones with the hard levels' operand lengths,
and a sliver of the hard levels themselves): a ``SFT_TOOL_FRACTION`` of its examples call the
calculator with the question's expression and copy the result, the others answer directly. RL
then has both behaviours to choose from on every level; where only a call and a faithful copy
score (3-digit products, 5-digit sums), it learns to call. Draws come from
``arithmetic.sft_corpus`` (train buckets only).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.tasks.data import arithmetic

SFT_TOOL_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class ToolExample:
  """One SFT example: the model calls ``call`` (None: answers directly), then writes ``answer``."""

  prompt: str
  call: str | None
  answer: str


def sft_examples(cfg: arithmetic.TaskConfig, num_examples: int, seed: int) -> list[ToolExample]:
  """``num_examples`` examples of the SFT levels (``cfg.sft_level_weights``), each calling the
  tool with probability ``SFT_TOOL_FRACTION``; deterministic in (cfg, seed)."""
  if cfg.digit_width or cfg.reverse_answer:
    raise ValueError("the tool task writes numbers as usual: digit_width 0, reverse_answer off")
  pairs = arithmetic.sft_corpus(cfg, num_examples, seed)
  # Its own stream: the problems are sft_corpus's whatever the fraction.
  calls_N = np.random.default_rng([seed, 3]).random(num_examples) < SFT_TOOL_FRACTION
  return [
    ToolExample(prompt, prompt.removesuffix("=") if call else None, answer)
    for (prompt, answer), call in zip(pairs, calls_N.tolist())
  ]
