"""Verifiers: map a decoded response and a reference answer to a reward.

``arithmetic``: the built-in task's bounded exact match (in process). ``math``: math-verify answers
(boxed / last-answer extraction, gold parsing), run with custom ``module:function`` rewards in the
bounded worker pool of ``pool`` (per-answer time limit, crash isolation, counted failures).
"""

from jaxrl.tasks.rewards.arithmetic import MAX_RESPONSE_CHARS, score, score_batch
from jaxrl.tasks.rewards.math import MATH_REWARD
from jaxrl.tasks.rewards.pool import VerifierPool, VerifyResult, load_reward_fn

__all__ = [
  "MAX_RESPONSE_CHARS",
  "MATH_REWARD",
  "VerifierPool",
  "VerifyResult",
  "load_reward_fn",
  "score",
  "score_batch",
]
