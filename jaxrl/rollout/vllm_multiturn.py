"""Multi-turn rollouts through a vLLM server: the turns of ``jaxrl.rollout.multiturn``
(docs/algorithms.md §11) as completion requests, laid out position for position as the JAX
sampler lays them out.

Each turn is one request per running row whose prompt is the row's token ids so far (its prompt,
its turns, the environment's observations: never a text re-tokenized; the server's prefix cache
makes the repeated prefix cheap), with ``max_tokens = T`` and the environment's stop sequences:
single-token ones as stop token ids, longer ones as stop strings kept in the output. The turn's
tokens come back with their behaviour log-probs; the rows whose turn ended at a stop sequence are
answered by ``respond`` with observation ids, which go into the row as they are (loss mask 0,
behaviour log-prob 0).

The layout and the limits are the JAX sampler's (``multiturn.generate``), so the two engines give
the same rollouts for the same draws: turns in lockstep, a turn spanning as many positions as its
longest row (the shorter rows' positions after their turn are masked gaps), each observation in a
block of O positions, right-aligned; an observation is asked for where its block and at least one
token of the reply fit and ``max_turns`` allows another turn (``multiturn.answers_fit``), the reply
then asked for min(T, what is left) tokens. A turn that ends at a stop asks the environment (with
``call_ids``: only if it holds a call; a chat model's end-of-turn without one finishes the row).
A row ends at EOS or when the environment says done (finished), or at T tokens in a turn or a
limit (unfinished). A turn the server ends before any token (its context is full) ends the row
and is not counted as a turn: the JAX sampler's turns always hold a token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.rollout import multiturn
from jaxrl.rollout.vllm_api import Completion


@dataclasses.dataclass(frozen=True)
class TurnStops:
  """How a model turn ends on the server: ``turns.stop_ids`` are the environment's single-token
  stop sequences; ``stop_strings`` its longer ones, matched as text (a tokenizer may spell the same
  text with other ids in context)."""

  turns: multiturn.TurnConfig
  stop_strings: tuple[str, ...] = ()


# complete(prompts_R, running_R, turn, max_tokens) -> one completion per running row ([] for the
# others): the engine's request of one turn, with its seeds, weights and restarts.
Complete = Callable[[list[list[int]], np.ndarray, int, int], list[list[Completion]]]


@dataclasses.dataclass
class _Buffers:
  """The response buffers of ``Rollouts`` (host arrays) and the per-row turn state."""

  tokens_RxN: np.ndarray
  mask_RxN: np.ndarray
  loss_mask_RxN: np.ndarray
  logp_RxN: np.ndarray
  ended_R: np.ndarray
  finished_R: np.ndarray
  turns_R: np.ndarray
  tool_calls_R: np.ndarray

  @classmethod
  def empty(cls, r: int, n: int, pad_id: int) -> _Buffers:
    return cls(
      tokens_RxN=np.full((r, n), pad_id, np.int32),
      mask_RxN=np.zeros((r, n), bool),
      loss_mask_RxN=np.zeros((r, n), bool),
      logp_RxN=np.zeros((r, n), np.float32),
      ended_R=np.zeros(r, bool),
      finished_R=np.zeros(r, bool),
      turns_R=np.zeros(r, np.int32),
      tool_calls_R=np.zeros(r, np.int32),
    )


def _turn_end(ids: np.ndarray, c: Completion, stops: TurnStops, eos: tuple[int, ...]) -> str:
  """How the turn ``ids`` (all of ``c``'s) ended, by the sampler's rule: "ask" (a stop that asks
  the environment: with ``call_ids``, only a turn holding a call), "finish" (EOS, or a stop
  without a call) or "cut" (the turn's budget)."""
  last = int(ids[-1])
  # A stop string: the server ends the request there ("stop"), the string kept in the output.
  at_string = bool(stops.stop_strings) and c.finish_reason == "stop" and last not in eos
  at_stop = last in stops.turns.stop_ids or at_string
  calls = stops.turns.call_ids
  if at_stop and (not calls or bool(np.isin(ids, calls).any())):
    return "ask"
  return "finish" if at_stop or last in eos else "cut"


def _place_turn(buf: _Buffers, done, running_R, n: int, t: int, stops, eos):
  """Write each running row's turn from position n; (the turn's width, the rows that asked for an
  observation, each asked row's turn ids)."""
  width, turn_ids = 1, [np.zeros(0, np.int32) for _ in running_R]
  asked_R = np.zeros(len(running_R), bool)
  for r in np.flatnonzero(running_R):
    (c,) = done[r]
    ids = np.asarray(c.token_ids[:t], np.int32)
    if len(ids) == 0:  # the server ended the turn before any token (its context is full)
      buf.ended_R[r] = True
      continue
    k = len(ids)
    buf.turns_R[r] += 1
    buf.tokens_RxN[r, n : n + k] = ids
    buf.mask_RxN[r, n : n + k] = buf.loss_mask_RxN[r, n : n + k] = True
    buf.logp_RxN[r, n : n + k] = c.logprobs[:k]
    width = max(width, k)
    end = _turn_end(ids, c, stops, eos) if k == len(c.token_ids) else "cut"
    if end == "ask":
      asked_R[r], turn_ids[r] = True, ids
    else:  # "cut": T tokens without a stop, the row ends unfinished
      buf.ended_R[r], buf.finished_R[r] = True, end == "finish"
  return width, asked_R, turn_ids


def generate(
  complete: Complete,
  prompts_R: Sequence[Sequence[int]],
  respond: multiturn.Respond,
  *,
  stops: TurnStops,
  max_new_tokens: int,
  eos_id: tuple[int, ...],
  pad_id: int,
):
  """(tokens_RxN, mask_RxN, loss_mask_RxN, behaviour_logp_RxN, finished_R, ``TurnCounts``) of
  R multi-turn responses to the R prompts (each a row's real prompt ids), as
  ``multiturn.generate`` defines them."""
  tc = stops.turns
  T, O, N = tc.max_turn_tokens, tc.max_observation_tokens, max_new_tokens
  if T > N:
    raise ValueError(f"max_turn_tokens = {T} exceeds max_new_tokens = {N}")
  r = len(prompts_R)
  buf = _Buffers.empty(r, N, pad_id)
  seqs = [list(map(int, p)) for p in prompts_R]  # each row's ids so far: the next request's prompt
  n = 0
  for turn in range(tc.max_turns):
    running_R = ~buf.ended_R
    t = min(T, N - n)  # the reply to an observation near the end gets what is left
    done = complete(seqs, running_R, turn, t)
    width, asked_R, turn_ids = _place_turn(buf, done, running_R, n, t, stops, eos_id)
    for row in np.flatnonzero(running_R):
      seqs[row] += buf.tokens_RxN[row, n : n + width][buf.mask_RxN[row, n : n + width]].tolist()
    n += width
    if not multiturn.answers_fit(turn, n, tc, N) or not asked_R.any():
      break
    observations, done_R = respond(asked_R.copy(), turn_ids)
    ids_RxO, mask_RxO, done_R = multiturn.observation_block(
      observations, done_R, asked_R, O, pad_id
    )
    buf.tokens_RxN[:, n : n + O] = np.where(mask_RxO, ids_RxO, pad_id)
    buf.mask_RxN[:, n : n + O] = mask_RxO
    for row in np.flatnonzero(asked_R):
      seqs[row] += ids_RxO[row][mask_RxO[row]].tolist()
    buf.ended_R |= done_R
    buf.finished_R |= done_R
    buf.tool_calls_R += asked_R
    n += O
    if not (asked_R & ~done_R).any():
      break
  # Rows asked on the last turn (no room or no turn left for an answer) stay unfinished.
  counts = multiturn.TurnCounts(turns_R=buf.turns_R, tool_calls_R=buf.tool_calls_R)
  return buf.tokens_RxN, buf.mask_RxN, buf.loss_mask_RxN, buf.logp_RxN, buf.finished_R, counts
