"""What a multi-turn sampler talks to: the ``Environment`` protocol, batched over rows.

Tokens in, tokens out: a model turn reaches the environment as the token ids the model sampled,
and the environment answers with observation token ids; the trajectory is the exact
concatenation of the two (never a chat re-tokenized), and only the model's ids train. A turn ends
at one of the environment's stop sequences (``stop_sequences``, ids; ``stop_strings`` for engines
that match text), at EOS, or at the sampler's per-turn budget; only the rows whose turn ended at a
stop sequence are stepped. How to write one: ``docs/environments.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np


class StepResult(NamedTuple):
  """``Environment.step``'s answer; the last three are aligned with the stepped ``rows``."""

  states: list  # every row's state after the step (rows not stepped: as they were)
  observation_ids: list[list[int]]  # ids appended after each stepped row's turn (may be empty)
  done: np.ndarray  # bool[len(rows)]: the trajectory ends here, the model gets no other turn
  info: list[dict]  # what happened, for logs and metrics (e.g. {"status": "timeout"})


@runtime_checkable
class Environment(Protocol):
  """Answers model turns of many rows at once; a row's state is the environment's own value."""

  stop_strings: tuple[str, ...]  # texts that end a model turn
  stop_sequences: tuple[tuple[int, ...], ...]  # the same as token id sequences
  # Ids that mark a call: a turn ending at a stop asks only if it holds one, else it finishes the
  # trajectory (a chat model's end-of-turn token ends every turn); () = every stop asks.
  call_ids: tuple[int, ...]
  max_observation_tokens: int  # no observation is longer

  def reset(self, question_ids: Sequence[int]) -> list[Any]:
    """One fresh state per row; ``question_ids[r]``: the question row r answers."""
    ...

  def step(
    self, states: Sequence[Any], turn_ids: Sequence[Sequence[int]], rows: Sequence[int]
  ) -> StepResult:
    """Answers the latest turn of each of ``rows`` (``turn_ids[k]``: row ``rows[k]``'s turn, the
    ids from its last observation through the stop sequence)."""
    ...

  def trajectory_reward(self, states: Sequence[Any]) -> np.ndarray | None:
    """f32[R] added to the verifier's reward of each trajectory, or None (no term)."""
    ...

  def close(self) -> None:
    """Stops what the environment started (worker processes); idempotent."""
    ...


@dataclasses.dataclass(frozen=True)
class TurnState:
  """A row's progress: what a tool-calling environment needs to bound it."""

  question_id: int
  turns: int = 0  # model turns the environment has seen
  calls: int = 0  # tool calls answered
  failures: int = 0  # of those, answered with an error (timeout, crash, no call)
  done: bool = False


def token_ids(tokenizer, text: str) -> list[int]:
  """``text``'s ids without special tokens (BOS, EOS), as the model would sample them."""
  return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def stop_sequences_of(tokenizer, strings: Sequence[str]) -> tuple[tuple[int, ...], ...]:
  """Each stop string as a token id sequence (a tokenizer that merges it differently in context
  can still emit other ids for the same text: engines that match text use the strings)."""
  return tuple(tuple(token_ids(tokenizer, s)) for s in strings)


def ends_with_stop(ids: Sequence[int], stop_sequences: Sequence[Sequence[int]]) -> bool:
  """True when ``ids`` end with one of ``stop_sequences``: the check a sampler makes per token."""
  ids = list(ids)
  return any(seq and ids[-len(seq) :] == list(seq) for seq in stop_sequences)


def bounded_observation(
  head: Sequence[int],
  body: Sequence[int],
  tail: Sequence[int],
  max_tokens: int,
  marker: Sequence[int] = (),
) -> tuple[list[int], bool]:
  """(head + body + tail, whether cut) in at most ``max_tokens`` ids: a body that does not fit is
  cut and ends with ``marker``, the head and tail (tags) kept; when even those do not fit, the
  whole is cut at ``max_tokens``."""
  whole = [*head, *body, *tail]
  if len(whole) <= max_tokens:
    return whole, False
  room = max_tokens - len(head) - len(tail) - len(marker)
  if room < 0:
    return whole[:max_tokens], True
  return [*head, *body[:room], *marker, *tail], True
