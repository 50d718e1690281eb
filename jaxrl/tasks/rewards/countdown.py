"""Verifier of the countdown task: 1.0 for an expression that uses exactly the problem's numbers,
each once, and equals its target; else 0.0.

The reference solution carries both: its number literals are the problem's numbers and its value is
the target, so the verifier needs nothing but (response, solution). The response is read by the
calculator's parser (``jaxrl.tasks.envs.calculator.evaluate``: bounded, never ``eval``) after a
check that it holds only digits, ``+``, ``-``, ``*`` and parentheses (no division, no negation, no
other text); a response longer than ``MAX_RESPONSE_CHARS`` scores 0 in O(1). A number literal with a
leading zero ("07") is not one of the problem's numbers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from jaxrl.tasks.envs.calculator import CalcError, evaluate
from jaxrl.tasks.rewards.pool import VerifyResult

MAX_RESPONSE_CHARS = 64
_ALLOWED = frozenset("0123456789+-*() ")
_NUMBER = re.compile(r"\d+")
# A '-' that starts the expression or follows '(' or an operator negates: not an operator of the
# task (the calculator's grammar allows it).
_UNARY_MINUS = re.compile(r"(^|[-+*(])\s*-")


def _numbers(expression: str) -> list[int] | None:
  """The expression's number literals, sorted; None if one has a leading zero."""
  literals = _NUMBER.findall(expression)
  if any(len(x) > 1 and x[0] == "0" for x in literals):
    return None
  return sorted(map(int, literals))


def score(response, solution) -> float:
  """1.0 iff ``response`` uses exactly the numbers of ``solution`` and has its value; no raise."""
  if not isinstance(response, str) or not isinstance(solution, str):
    return 0.0
  if len(response) > MAX_RESPONSE_CHARS or not set(response) <= _ALLOWED:
    return 0.0
  if _UNARY_MINUS.search(response):
    return 0.0
  numbers = _numbers(response)
  if numbers is None or numbers != _numbers(solution):
    return 0.0
  try:
    return 1.0 if evaluate(response) == evaluate(solution) else 0.0
  except CalcError:
    return 0.0


@dataclasses.dataclass(frozen=True)
class CountdownScorer:
  """The task's scorer (``TaskData.scorer``), in process: the check is a few microseconds."""

  def __call__(self, responses: Sequence, solutions: Sequence) -> VerifyResult:
    if len(responses) != len(solutions):
      raise ValueError(f"{len(responses)} responses but {len(solutions)} solutions")
    rewards_R = np.fromiter(
      (score(r, s) for r, s in zip(responses, solutions)), np.float32, count=len(responses)
    )
    return VerifyResult(rewards_R, 0, 0, 0, 0)

  def close(self) -> None:
    pass
