"""Bounded reward computation: a reusable pool of worker processes with per-answer time limits.

A reward function (a ``module:function`` spec: the math verifier, or a custom one) runs on model
output, which can make sympy hang in C code or exhaust memory: each answer is a bounded call in a
worker process (``jaxrl.tasks.workers``: a soft and a hard time limit per answer, a batch deadline,
an address-space limit, workers replaced after a kill or a crash). In the worker, the function's
value must be a finite number (``as_reward``). Every answer that does not finish (timed out,
skipped at the deadline, the function raised or its worker died) is counted in ``VerifyResult`` and
marked unscored (``scored_R``): the trainer leaves it out of the update rather than train on a
reward the verifier never gave.

The pool knows nothing of any task: whoever builds it may pass ``prepare`` (run in the parent on
each response: the text sent to the function, and whether it was cut) and ``warm_up`` (a (response,
answer) pair each worker scores once before it says ready). The math task passes math's answer
window and warm-up pair (``jaxrl.tasks.math_task``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.tasks.worker_process import MESSAGE_CHARS, BadResult, FunctionSpecError, load_function
from jaxrl.tasks.workers import WorkerPool

log = logging.getLogger(__name__)

# The check each worker runs on the function's value (this module's ``as_reward``).
REWARD_CHECK = "jaxrl.tasks.rewards.pool:as_reward"


class RewardFnError(FunctionSpecError):
  """A reward function spec that cannot be loaded; the message names what failed."""


def load_reward_fn(spec: str) -> Callable[[str, str], float]:
  """The callable named by ``"package.module:function"`` (the attribute may be dotted)."""
  return load_function(spec, "reward function", RewardFnError)


def as_reward(value) -> float:
  """A reward function's value as a float (run in the worker): a finite real number, or
  ``BadResult``."""
  if isinstance(value, numbers.Real) and math.isfinite(float(value)):
    return float(value)
  raise BadResult(
    f"returned {type(value).__name__} {str(value)[:MESSAGE_CHARS]!r}, not a finite number"
  )


@dataclasses.dataclass(frozen=True)
class VerifyResult:
  rewards_R: np.ndarray  # f32[R]; 0 for every answer counted below
  timeouts: int  # stopped at the per-answer limit, or while running at the batch deadline
  errors: int  # the function raised or returned a non-finite non-number, or its worker died
  skipped: int  # never started before the batch deadline
  truncated: int  # cut by the pool's ``prepare`` (math: the answer window; still scored)
  first_error: str | None = None  # the error of the lowest-index failed answer, for the log
  scored_R: np.ndarray | None = None  # bool[R]: the function returned a reward; None = all

  @property
  def scored(self) -> np.ndarray:
    """bool[R]: which answers have a reward from the function (timeouts, errors, skips do not)."""
    if self.scored_R is None:
      return np.ones(len(self.rewards_R), bool)
    return np.asarray(self.scored_R, bool)

  def metrics(self, prefix: str = "verify_") -> dict[str, float]:
    """The counters as floats, for the metrics writer."""
    return {
      prefix + k: float(getattr(self, k)) for k in ("timeouts", "errors", "skipped", "truncated")
    }


class VerifierPool(WorkerPool):
  """Scores batches of (response, gold) with ``reward_fn`` in ``num_workers`` bounded processes.

  Reusable across steps (workers persist between ``score`` calls) and not thread-safe; stop it
  with ``close()`` or a ``with`` block. The batch deadline defaults to ``time_limit_s +
  kill_grace_s + per_answer_budget_s * ceil(R / num_workers)``: room for a normal batch plus one
  hard limit.

  ``reward_fn`` is a ``module:function`` spec, imported by each worker. ``prepare`` (optional, run
  in the parent) maps a response to (the text the function is given, whether it was cut; counted
  in ``VerifyResult.truncated``). ``warm_up`` (optional) is a (response, answer) pair each worker
  scores once before it says ready, under the start-up limit, its result ignored.
  """

  spec_error = RewardFnError

  def __init__(
    self,
    reward_fn: str,
    *,
    prepare: Callable[[str], tuple[str, bool]] | None = None,
    warm_up: tuple[str, str] | None = None,
    num_workers: int | None = None,
    time_limit_s: float = 5.0,
    kill_grace_s: float = 0.5,
    batch_time_limit_s: float | None = None,
    per_answer_budget_s: float = 0.25,
    memory_limit_mb: int | None = 4096,
  ):
    if warm_up is not None and not (len(warm_up) == 2 and all(isinstance(x, str) for x in warm_up)):
      raise ValueError(f"VerifierPool: warm_up must be a (response, answer) pair, got {warm_up!r}")
    super().__init__(
      reward_fn,
      check=REWARD_CHECK,
      kind="reward function",
      warm_up=warm_up,
      num_workers=num_workers,
      time_limit_s=time_limit_s,
      kill_grace_s=kill_grace_s,
      batch_time_limit_s=batch_time_limit_s,
      per_call_budget_s=per_answer_budget_s,
      memory_limit_mb=memory_limit_mb,
    )
    self.reward_fn = reward_fn
    self.prepare = prepare

  def _check_and_prepare(
    self, responses: Sequence[str], answers: Sequence[str]
  ) -> tuple[list[str], int]:
    """The texts to score (``prepare`` applied) and how many were cut; raises on bad arguments."""
    if len(responses) != len(answers):
      raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    for i, (r, a) in enumerate(zip(responses, answers)):
      if not isinstance(r, str) or not isinstance(a, str):
        raise TypeError(
          f"item {i}: response and answer must be str, got {type(r).__name__} "
          f"and {type(a).__name__}"
        )
    if self.prepare is None:
      return list(responses), 0
    prepared = [self.prepare(r) for r in responses]
    return [text for text, _ in prepared], sum(cut for _, cut in prepared)

  def score(self, responses: Sequence[str], answers: Sequence[str]) -> VerifyResult:
    """Rewards of aligned responses and gold answers; never longer than the batch deadline."""
    if not self._finalizer.alive:
      raise RuntimeError("VerifierPool.score after close()")
    texts, truncated = self._check_and_prepare(responses, answers)
    calls = self.run(list(zip(texts, answers)))
    ok_R = np.asarray([s == "ok" for s in calls.status], bool)
    rewards_R = np.asarray([v if ok else 0.0 for v, ok in zip(calls.values, ok_R)], np.float32)
    result = VerifyResult(
      rewards_R.reshape(len(texts)),
      calls.count("timeout"),
      calls.count("error"),
      calls.count("skipped"),
      truncated,
      calls.first_error,
      ok_R.reshape(len(texts)),
    )
    if result.timeouts or result.errors or result.skipped:
      log.warning(
        "verifier: %d timeouts, %d errors, %d skipped of %d answers%s",
        result.timeouts,
        result.errors,
        result.skipped,
        len(rewards_R),
        f" (first error: {result.first_error})" if result.first_error else "",
      )
    return result
