"""Verifier of the arithmetic task: 1.0 for exactly the canonical answer, else 0.0.

Runs on the host for every rollout, so it is bounded before it parses: a response longer than
``MAX_RESPONSE_CHARS`` scores 0 in O(1), whatever a broken model emits. Comparison is on the
canonical integer literal (surrounding whitespace ignored), not on int() values: with answers
written least-significant digit first, leading zeros are significant ("01" means 10, "1" means 1),
so normalising them would reward wrong answers. Canonical answers never carry spurious zeros.

With a tool (``FinalAnswerScorer``) the answer is the text after the last tool result: what the
model wrote once the environment last spoke.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.tasks.rewards.pool import VerifyResult

# Far above any answer of the task (a 9x9-digit product has 18 digits), far below harmful sizes.
MAX_RESPONSE_CHARS = 64
_DIGITS = frozenset("0123456789")


def _is_int_literal(s: str) -> bool:
  """True for an optional '-' followed by one or more ASCII digits."""
  body = s[1:] if s.startswith("-") else s
  return bool(body) and all(c in _DIGITS for c in body)


def score(response, answer) -> float:
  """1.0 iff the stripped response is an integer literal equal to the stripped answer; no raise."""
  if not isinstance(response, str) or not isinstance(answer, str):
    return 0.0
  if len(response) > MAX_RESPONSE_CHARS:
    return 0.0
  response = response.strip()
  return 1.0 if _is_int_literal(response) and response == answer.strip() else 0.0


def score_batch(responses: Sequence, answers: Sequence) -> np.ndarray:
  """f32[B] of ``score`` over aligned responses and answers."""
  if len(responses) != len(answers):
    raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
  return np.fromiter(
    (score(r, a) for r, a in zip(responses, answers)), np.float32, count=len(responses)
  )


def final_answer(response: str, after: str) -> str:
  """The text after the last ``after`` (a tool result's closing tag); the whole without one."""
  cut = response.rfind(after)
  return response if cut < 0 else response[cut + len(after) :]


@dataclasses.dataclass(frozen=True)
class FinalAnswerScorer:
  """A task's scorer (``TaskData.scorer``): exact match of each response's final answer."""

  after: str  # the closing tag of the environment's observations

  def __call__(self, responses: Sequence, answers: Sequence) -> VerifyResult:
    finals = [final_answer(r, self.after) if isinstance(r, str) else r for r in responses]
    return VerifyResult(score_batch(finals, list(answers)), 0, 0, 0, 0)

  def close(self) -> None:
    pass
