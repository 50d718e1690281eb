"""Verifiers: map a decoded response and a reference answer to a reward.

``arithmetic``: the built-in task's bounded exact match (in process). ``math``: math-verify answers
(boxed / last-answer extraction, gold parsing), run with custom ``module:function`` rewards in the
bounded worker pool of ``pool`` (per-answer time limit, crash isolation, counted failures).
``math`` is not imported here: math-verify pulls in sympy (~0.4 s), which only the math task needs.
"""

from jaxrl.tasks.rewards.arithmetic import MAX_RESPONSE_CHARS, score, score_batch
from jaxrl.tasks.rewards.pool import VerifierPool, VerifyResult, load_reward_fn

__all__ = [
  "MAX_RESPONSE_CHARS",
  "VerifierPool",
  "VerifyResult",
  "load_reward_fn",
  "score",
  "score_batch",
]
