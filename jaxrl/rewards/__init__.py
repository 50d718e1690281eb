"""Verifiers: map a decoded response and a reference answer to a reward."""

from jaxrl.rewards.arithmetic import MAX_RESPONSE_CHARS, score, score_batch

__all__ = ["MAX_RESPONSE_CHARS", "score", "score_batch"]
