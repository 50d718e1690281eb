"""Multi-turn generation with an environment: the model's turns and the environment's observations
in one response buffer, with static shapes (docs/algorithms.md §11).

The model writes a tool call (``<calc>12345*678</calc>``) and stops at a turn-stop token (the id
of ``</calc>``); the host's ``respond`` callback answers with observation tokens
(``<result>8369910</result>``), which are appended as they are (never re-tokenized), and the model
continues. Turns run in lockstep over the R rows, as host-driven jitted programs that each
compile once per run (their shapes are fixed by R, P, N, T and O; the turn's start is traced),
in ``turn_programs``:

  ``prefill_program``   expand B prompts to R rows, prefill once per prompt (``prefill.prefill_rows``)
  ``turn_program``      one model turn: a ``while_loop`` of at most T = ``max_turn_tokens`` steps
                        that stops when every row's turn ended
  ``observe_program``   O = ``max_observation_tokens`` observation positions for every row, filled
                        by one forward (rows without an observation: all masked)
  ``assemble_program``  the ``Rollouts``, with each row's turn counts

A row's turn ends at a turn-stop id (the host is asked for an observation; with
``TurnConfig.call_ids``, a chat model's end-of-turn id, only if the turn holds a call, else the row
finishes), at EOS (the row finishes) or after T tokens (the row ends unfinished, as a truncated
single-turn row). A row whose turn ended waits, its positions masked gaps, until every row's turn
ended; the turn then spans as many positions as its longest row. The observation follows in a
block of O positions, padded on the left, so that a model token never follows padding of its own
turn's observation. An observation is asked for where its block fits with at least one position
after it and ``max_turns`` allows another turn (``answers_fit``); the reply then takes at most T
tokens, fewer where the buffer ends first. A row asked where no answer fits ends unfinished. A row
the environment calls done finishes after its observation.

Gaps are invisible to the model: the cache slot of a gap is not valid (``kv_valid_RxS``) and
RoPE positions count real tokens only, so the log-probs are those of a forward without a cache
over ``prompt ++ response`` with ``positions_from_mask`` (the update's, ``rl/scoring.py:
response_hidden``). Response token n sits in cache slot P + n, as in the single-turn sampler,
whose token draw (``draws.draw``: the draw of token n keyed by ``fold_in(key, n)``), request
checks (``sampler.request_arrays``) and prefilled rows (``prefill.prefill_rows``) this module
shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrl.parallel import distributed
from jaxrl.rollout import sampler, turn_programs
from jaxrl.rollout.sampler import stop_ids
from jaxrl.rollout.turn_programs import TurnBuffers
from jaxrl.types import Array, Rollouts, pytree_dataclass

# respond(asked_R, turn_tokens) -> (observation_ids, done_R). ``asked_R`` [R] marks the rows whose
# turn ended at a turn-stop id; ``turn_tokens[r]`` is row r's tokens of this turn (empty where not
# asked). It returns R observations (each at most O token ids; ignored where not asked) and done_R
# [R] (the environment ended the row's trajectory; ignored where not asked).
Respond = Callable[[np.ndarray, list[np.ndarray]], tuple[Sequence[np.ndarray], np.ndarray]]


class EnvironmentRespond:
  """A ``Respond`` over an ``Environment`` (``jaxrl.tasks.envs``) for one ``generate`` call: each
  row's state starts from ``environment.reset(question_ids_R)``; ``states`` holds them after.
  The reset happens on first use: a respond only sliced (``rows``, one host's share) never
  resets the whole batch."""

  def __init__(self, environment, question_ids_R):
    self.environment = environment
    self.question_ids_R = np.asarray(question_ids_R)
    self._states: list | None = None

  @property
  def states(self) -> list:
    if self._states is None:
      self._states = list(self.environment.reset([int(q) for q in self.question_ids_R]))
    return self._states

  def rows(self, lo: int, hi: int) -> EnvironmentRespond:
    """A fresh ``EnvironmentRespond`` for rows ``lo:hi`` of this one's (one host's slice)."""
    return EnvironmentRespond(self.environment, self.question_ids_R[lo:hi])

  def __call__(self, asked_R, turn_tokens):
    rows = np.flatnonzero(asked_R)
    observations: list[np.ndarray] = [np.zeros(0, np.int32) for _ in turn_tokens]
    done_R = np.zeros(len(turn_tokens), bool)
    if len(rows):
      result = self.environment.step(
        self.states, [np.asarray(turn_tokens[r]).tolist() for r in rows], rows.tolist()
      )
      self._states = list(result.states)
      for k, r in enumerate(rows):
        observations[r] = np.asarray(result.observation_ids[k], np.int32)
      done_R[rows] = np.asarray(result.done, bool)
    return observations, done_R

  def trajectory_reward(self) -> np.ndarray | None:
    """The environment's f32[R] reward term of the trajectories (None: none)."""
    reward = self.environment.trajectory_reward(self.states)
    return None if reward is None else np.asarray(reward, np.float32)


def with_trajectory_reward(rollouts: Rollouts, respond: Respond) -> Rollouts:
  """``rollouts`` with the environment's trajectory reward term as ``rewards_R`` (the loop adds
  the verifier's), unchanged for an environment without one. Set by the engine that stepped the
  environment, so the term travels with its rows (gathered from several hosts like them)."""
  reward = getattr(respond, "trajectory_reward", None)
  term = None if reward is None else reward()
  return rollouts if term is None else dataclasses.replace(rollouts, rewards_R=term)


@dataclasses.dataclass(frozen=True)
class TurnConfig:
  """The static shape of a multi-turn rollout (a jit argument: hashable)."""

  stop_ids: tuple[int, ...]  # a model turn ends at one of these: the environment is asked
  max_turn_tokens: int  # T: tokens of one model turn at most
  max_observation_tokens: int  # O: tokens of one observation at most (its block's width)
  max_turns: int  # model turns per row at most
  # Ids that mark a call (a chat model's ``</tool_call>``): a turn that ends at a stop id asks the
  # environment only if it holds one of them, else it ends the trajectory, finished, as EOS does
  # (a chat model ends every turn, its last one too, with its end-of-turn token). () = every stop
  # asks (the stop id is the call's own end, ``</calc>``).
  call_ids: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "stop_ids", stop_ids(self.stop_ids))
    object.__setattr__(self, "call_ids", tuple(int(i) for i in self.call_ids))
    for name in ("max_turn_tokens", "max_observation_tokens", "max_turns"):
      if getattr(self, name) < 1:
        raise ValueError(f"TurnConfig.{name} must be >= 1, got {getattr(self, name)}")


@pytree_dataclass
class TurnCounts:
  """Per row: how many model turns it took and how many observations the environment gave."""

  turns_R: Array  # i32, turns in which the row sampled at least one token
  tool_calls_R: Array  # i32, observations appended (the host answered a turn-stop)


def _host(x) -> np.ndarray:
  """A (small) device value on the host; every process sees all of it."""
  return np.asarray(distributed.to_host(x) if jax.process_count() > 1 else x)


def answers_fit(turn: int, end: int, turns: TurnConfig, max_new_tokens: int) -> bool:
  """Is the environment asked after turn ``turn`` (from 0), which ended at position ``end``? When
  the observation block fits with at least one position for the model's reply, and ``max_turns``
  allows another turn. The reply then gets min(T, what is left) positions (as peers answer a call
  whenever the observation fits the budget)."""
  return turn + 1 < turns.max_turns and end + turns.max_observation_tokens < max_new_tokens


def observation_block(observations, done_R, asked_R, o: int, pad_id: int):
  """The callback's answer as the observe program takes it: ids [R, O] right-aligned (pad_id on
  the left), their mask, and done_R; rows not asked get none."""
  r = len(asked_R)
  if len(observations) != r or np.shape(done_R) != (r,):
    raise ValueError(
      f"respond must return {r} observations and done_R of shape ({r},), got "
      f"{len(observations)} and {np.shape(done_R)}"
    )
  ids_RxO = np.full((r, o), pad_id, np.int32)
  mask_RxO = np.zeros((r, o), bool)
  for row in np.flatnonzero(asked_R):
    obs = np.asarray(observations[row], np.int32).reshape(-1)
    if len(obs) > o:
      raise ValueError(f"row {row}'s observation has {len(obs)} tokens, over the budget of {o}")
    if len(obs):
      ids_RxO[row, o - len(obs) :] = obs
      mask_RxO[row, o - len(obs) :] = True
  return ids_RxO, mask_RxO, np.asarray(done_R, bool) & asked_R


def _turn_tokens(tokens_RxN, mask_RxN, asked_R, start: int, end: int) -> list[np.ndarray]:
  """Each asked row's tokens of the turn at positions start..end-1 (empty for the others)."""
  empty = np.zeros((0,), np.int32)
  return [
    tokens_RxN[r, start:end][mask_RxN[r, start:end]] if asked_R[r] else empty
    for r in range(len(asked_R))
  ]


def generate(
  graphdef,
  params,
  prompt_ids_BxP,
  prompt_mask_BxP,
  counts_B,
  key,
  temperature,
  top_p,
  respond: Respond,
  *,
  num_rollouts: int,
  max_new_tokens: int,
  turns: TurnConfig,
  eos_id: int | tuple[int, ...],
  pad_id: int,
  model_cfg,
  greedy: bool = False,
) -> Rollouts:
  """Sample counts_B[i] multi-turn responses to each left-padded prompt i, asking ``respond`` for
  the observations; needs Σ counts_B == num_rollouts and T <= N.

  ``mask_RxN`` marks every real response token (the model's and the environment's), ``loss_mask_RxN``
  the model's; the behaviour log-probs and entropies are 0 elsewhere. ``finished_R``: the row ended
  at EOS or the environment ended it; a row that a limit stopped (T tokens in a turn, no room or
  no turn left for another) is unfinished. ``turns_R`` and ``tool_calls_R``: each row's model
  turns and observations. The host syncs once per turn (which rows were asked, their tokens); each
  program compiles once per (shapes, statics).
  """
  T, N = turns.max_turn_tokens, max_new_tokens
  if T > N:
    raise ValueError(f"max_turn_tokens = {T} exceeds max_new_tokens = {N}")
  # graphdef, params, ids, mask, counts, key, τ, top_p: checked, in the programs' dtypes
  args = sampler.request_arrays(
    *(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, key, temperature, top_p),
    num_rollouts=num_rollouts,
    max_new_tokens=N,
  )
  st, *prompt_rows = turn_programs.prefill_program(
    *args[:5], num_rollouts=num_rollouts, max_new_tokens=N, pad_id=pad_id, model_cfg=model_cfg
  )
  static = dict(max_new_tokens=N, eos_id=stop_ids(eos_id), pad_id=pad_id, greedy=greedy)
  st = _take_turns(args, st, respond, turns, **static)
  return turn_programs.assemble_program(st, *prompt_rows)


def _take_turns(args, st, respond, turns, *, max_new_tokens, eos_id, pad_id, greedy) -> TurnBuffers:
  """The model's turns from the prefilled state ``st`` (``args``: ``sampler.request_arrays``'),
  each answered by ``respond`` where it asked and an answer fits (``answers_fit``), until no row
  asks or no turn is left."""
  graphdef, params, *_, key, tau, top_p = args
  statics = dict(eos_id=eos_id, stop_ids=turns.stop_ids, call_ids=turns.call_ids, pad_id=pad_id)
  start, o = 0, turns.max_observation_tokens
  for turn in range(turns.max_turns):
    st = turn_programs.turn_program(
      graphdef,
      params,
      st,
      key,
      tau,
      top_p,
      max_turn_tokens=turns.max_turn_tokens,
      greedy=greedy,
      **statics,
    )
    end, asked_R = int(_host(st.n)), _host(st.asked_R)
    if not answers_fit(turn, end, turns, max_new_tokens) or not asked_R.any():
      break
    st, done_R = _answer(graphdef, params, st, respond, asked_R, (start, end), o, pad_id)
    start = end + o
    if not (asked_R & ~done_R).any():
      break
  return st


def _answer(graphdef, params, st: TurnBuffers, respond: Respond, asked_R, span, o: int, pad_id):
  """The observations ``respond`` gives the ``asked_R`` rows for their turn's tokens (positions
  ``span``: start, end), run through the model (``observe_program``): the state after them, and
  the rows the environment ended."""
  tokens = _turn_tokens(_host(st.tokens_RxN), _host(st.mask_RxN), asked_R, *span)
  observations, done_R = respond(asked_R.copy(), tokens)
  ids_RxO, mask_RxO, done_R = observation_block(observations, done_R, asked_R, o, pad_id)
  return turn_programs.observe_program(
    graphdef, params, st, ids_RxO, mask_RxO, done_R, pad_id=pad_id
  ), done_R
