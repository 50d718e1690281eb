"""Multi-turn generation with an environment: the model's turns and the environment's observations
in one response buffer, with static shapes (docs/algorithms.md §11).

The model writes a tool call (``<calc>12345*678</calc>``) and stops at a turn-stop token (the id
of ``</calc>``); the host's ``respond`` callback answers with observation tokens
(``<result>8369910</result>``), which are appended as they are (never re-tokenized), and the model
continues. Turns run in lockstep over the R rows, as host-driven jitted programs that each
compile once per run (their shapes are fixed by R, P, N, T and O; the turn's start is traced):

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
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.nn import kv_cache, model
from jaxrl.nn.logprobs import logits_f32
from jaxrl.parallel import distributed
from jaxrl.rollout import prefill, sampler
from jaxrl.rollout.draws import draw
from jaxrl.rollout.sampler import _put, stop_ids
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


@pytree_dataclass
class _TurnState:
  """Everything the programs carry between turns; the response buffers are as ``Rollouts``'."""

  n: Array  # i32[] the next free position, the same for every row (turns in lockstep)
  cache: kv_cache.KVCache  # P + N slots: response token n in slot P + n
  kv_valid_RxS: Array  # bool, the slots that hold real tokens
  logits_RxV: Array  # f32, predict each row's next model token
  tokens_RxN: Array
  mask_RxN: Array  # bool, every real token (model and environment)
  loss_mask_RxN: Array  # bool, the model's tokens
  logp_RxN: Array  # ℓ, full softmax(z/τ)
  behaviour_logp_RxN: Array  # ℓ_μ, the distribution sampled (``draws.draw``)
  entropy_RxN: Array
  next_pos_R: Array  # i32, real tokens so far: the RoPE position of the row's next token
  in_turn_R: Array  # bool, still decoding this turn
  asked_R: Array  # bool, this turn ended at a turn-stop id: the row waits for an observation
  called_R: Array  # bool, this turn holds a call id (``TurnConfig.call_ids``)
  ended_R: Array  # bool, generates no more (EOS, done, or a limit)
  finished_R: Array  # bool, ended by EOS or by the environment (not by a limit)
  turns_R: Array  # i32
  tool_calls_R: Array  # i32


@functools.partial(
  jax.jit, static_argnames=("num_rollouts", "max_new_tokens", "pad_id", "model_cfg")
)
def prefill_program(
  graphdef,
  params,
  prompt_ids_BxP,
  prompt_mask_BxP,
  counts_B,
  *,
  num_rollouts,
  max_new_tokens,
  pad_id,
  model_cfg,
):
  """The R prompt rows, their masks and group ids, and the state before the first turn."""
  (R, N), P = (num_rollouts, max_new_tokens), prompt_ids_BxP.shape[1]
  rows = prefill.prefill_rows(
    graphdef,
    params,
    prompt_ids_BxP,
    prompt_mask_BxP,
    counts_B,
    rows=R,
    max_new_tokens=N,
    model_cfg=model_cfg,
  )
  # One cache for every turn (a turn's start is traced): no segments as in ``sample_program``.
  st = sampler._initial_state(
    rows.cache.pad_slots(P + N), rows.kv_valid_RxS, rows.logits_RxV, max_new_tokens=N, pad_id=pad_id
  )
  false_R, zero_R = jnp.zeros(R, bool), jnp.zeros(R, jnp.int32)
  state = _TurnState(
    **{f.name: getattr(st, f.name) for f in dataclasses.fields(st)},
    loss_mask_RxN=st.mask_RxN,
    next_pos_R=rows.prompt_len_R,
    in_turn_R=false_R,
    asked_R=false_R,
    called_R=false_R,
    ended_R=false_R,
    turns_R=zero_R,
    tool_calls_R=zero_R,
  )
  return state, rows.prompt_ids_RxP, rows.prompt_mask_RxP, rows.group_ids_R


def _prompt_width(st: _TurnState) -> int:
  return st.kv_valid_RxS.shape[1] - st.tokens_RxN.shape[1]


@dataclasses.dataclass(frozen=True)
class _Turn:
  """The loop-invariant inputs of one turn's decode (as ``sampler._Decoder``)."""

  graphdef: object
  params: object
  key: Array
  tau: Array  # f32[]
  top_p: Array  # f32[]
  end: Array  # i32[] the turn's last token is at most end - 1 (min(its start + T, N))
  eos_id: tuple[int, ...]
  stop_ids: tuple[int, ...]
  call_ids: tuple[int, ...]
  pad_id: int
  greedy: bool

  def emit(self, st: _TurnState) -> _TurnState:
    """Choose position n's token for the rows in their turn; the others get a gap there."""
    live_R, P = st.in_turn_R, _prompt_width(st)
    tok_R, logp_R, behaviour_R, entropy_R = draw(
      self.key, st.n, st.logits_RxV, self.tau, self.top_p, self.greedy, live_R, self.pad_id
    )
    called_R = st.called_R
    if self.call_ids:
      called_R = called_R | jnp.isin(tok_R, jnp.asarray(self.call_ids))
    at_stop_R = jnp.isin(tok_R, jnp.asarray(self.stop_ids))
    # A stop that asks wins over EOS (a chat model's end-of-turn id is often its EOS too); a stop
    # without a call ends the trajectory like EOS.
    stop_R = live_R & at_stop_R & (called_R if self.call_ids else True)
    eos_R = live_R & ~stop_R & (jnp.isin(tok_R, jnp.asarray(self.eos_id)) | at_stop_R)
    return dataclasses.replace(
      st,
      n=st.n + 1,
      kv_valid_RxS=jax.lax.dynamic_update_slice_in_dim(
        st.kv_valid_RxS, live_R[:, None], P + st.n, 1
      ),
      tokens_RxN=_put(st.tokens_RxN, tok_R, st.n),
      mask_RxN=_put(st.mask_RxN, live_R, st.n),
      loss_mask_RxN=_put(st.loss_mask_RxN, live_R, st.n),
      logp_RxN=_put(st.logp_RxN, logp_R, st.n),
      behaviour_logp_RxN=_put(st.behaviour_logp_RxN, behaviour_R, st.n),
      entropy_RxN=_put(st.entropy_RxN, entropy_R, st.n),
      next_pos_R=st.next_pos_R + live_R,
      in_turn_R=live_R & ~eos_R & ~stop_R,
      asked_R=st.asked_R | stop_R,
      called_R=called_R,
      ended_R=st.ended_R | eos_R,
      finished_R=st.finished_R | eos_R,
    )

  def step(self, st: _TurnState) -> _TurnState:
    """Feed position n-1 (slot P+n-1) through the model, then emit position n."""
    prev, P = st.n - 1, _prompt_width(st)
    tok_Rx1 = jax.lax.dynamic_slice_in_dim(st.tokens_RxN, prev, 1, axis=1)
    real_R = jax.lax.dynamic_index_in_dim(st.mask_RxN, prev, axis=1, keepdims=False)
    # A real token at n-1 is the row's last one so far: its position is next_pos - 1.
    pos_Rx1 = jnp.maximum(st.next_pos_R - 1, 0)[:, None]
    hidden_Rx1xD, lm_head, cache = model.forward(
      self.graphdef, self.params, tok_Rx1, pos_Rx1, st.kv_valid_RxS, st.cache, P + prev
    )
    # A row that ended its turn keeps the logits after its last token (a turn-stop's: they predict
    # the row's next token if its observation comes back empty).
    logits_RxV = jnp.where(real_R[:, None], logits_f32(hidden_Rx1xD[:, 0], lm_head), st.logits_RxV)
    return self.emit(dataclasses.replace(st, cache=cache, logits_RxV=logits_RxV))

  def running(self, st: _TurnState) -> Array:
    return (st.n < self.end) & jnp.any(st.in_turn_R)


@functools.partial(
  jax.jit,
  static_argnames=("max_turn_tokens", "eos_id", "stop_ids", "call_ids", "pad_id", "greedy"),
  donate_argnames=("state",),
)
def turn_program(
  graphdef,
  params,
  state: _TurnState,
  key,
  temperature,
  top_p,
  *,
  max_turn_tokens,
  eos_id,
  stop_ids,
  call_ids=(),
  pad_id,
  greedy,
) -> _TurnState:
  """One model turn of every row not ended, from position ``state.n`` (< N): at most T tokens,
  fewer where the response ends sooner."""
  turn = _Turn(
    graphdef=graphdef,
    params=params,
    key=key,
    tau=jnp.asarray(temperature, jnp.float32),
    top_p=jnp.asarray(top_p, jnp.float32),
    end=jnp.minimum(state.n + max_turn_tokens, state.tokens_RxN.shape[1]),
    eos_id=eos_id,
    stop_ids=stop_ids,
    call_ids=call_ids,
    pad_id=pad_id,
    greedy=greedy,
  )
  live_R = ~state.ended_R
  no_R = jnp.zeros_like(live_R)
  st = dataclasses.replace(
    state, in_turn_R=live_R, asked_R=no_R, called_R=no_R, turns_R=state.turns_R + live_R
  )
  # The turn's first token comes from the logits the prefill or the observation left.
  st = jax.lax.while_loop(turn.running, turn.step, turn.emit(st))
  # Rows still in their turn used its T tokens: they end, unfinished.
  return dataclasses.replace(
    st, ended_R=st.ended_R | st.in_turn_R, in_turn_R=jnp.zeros_like(live_R)
  )


@functools.partial(jax.jit, static_argnames=("pad_id",), donate_argnames=("state",))
def observe_program(
  graphdef, params, state: _TurnState, obs_ids_RxO, obs_mask_RxO, done_R, *, pad_id
) -> _TurnState:
  """Append each asked row's observation (right-aligned in ``obs_ids_RxO``, ``obs_mask_RxO`` its
  real tokens) at the next O positions and run them through the model; ``done_R`` rows end,
  finished.

  The forward covers 1 + O positions: the turn's last one too, whose token the decode loop has not
  fed yet (a turn-stop on the turn's last step). Its T = 1 + O queries attend to the valid cache
  slots, so one forward serves every row, asked or not (a row without an observation: all masked).
  """
  st, P, o = state, _prompt_width(state), obs_ids_RxO.shape[1]
  prev = st.n - 1
  asked_R = st.asked_R
  obs_mask_RxO = obs_mask_RxO & asked_R[:, None]
  done_R = done_R & asked_R
  last_tok_R = jax.lax.dynamic_index_in_dim(st.tokens_RxN, prev, axis=1, keepdims=False)
  last_real_R = jax.lax.dynamic_index_in_dim(st.mask_RxN, prev, axis=1, keepdims=False)
  ids_RxT = jnp.concatenate([last_tok_R[:, None], obs_ids_RxO.astype(jnp.int32)], axis=1)
  real_RxT = jnp.concatenate([last_real_R[:, None], obs_mask_RxO], axis=1)
  # Real tokens before position n-1, plus those up to each of the 1 + O.
  before_R = st.next_pos_R - last_real_R
  pos_RxT = jnp.maximum(before_R[:, None] + jnp.cumsum(real_RxT, axis=1, dtype=jnp.int32) - 1, 0)
  kv_valid_RxS = jax.lax.dynamic_update_slice_in_dim(st.kv_valid_RxS, obs_mask_RxO, P + st.n, 1)
  hidden_RxTxD, lm_head, cache = model.forward(
    graphdef, params, ids_RxT, pos_RxT, kv_valid_RxS, st.cache, P + prev
  )
  # The next model token follows the observation's last token (right-aligned: the last position),
  # or with an empty observation the turn-stop, if that is at n-1 (else the loop's logits stand).
  count_R = jnp.sum(obs_mask_RxO, axis=1, dtype=jnp.int32)
  last_T = jnp.where(count_R > 0, o, 0)
  hidden_RxD = jnp.take_along_axis(hidden_RxTxD, last_T[:, None, None], axis=1)[:, 0]
  fresh_R = (count_R > 0) | last_real_R
  logits_RxV = jnp.where(fresh_R[:, None], logits_f32(hidden_RxD, lm_head), st.logits_RxV)

  def put_block(x_RxN, block_RxO):
    return jax.lax.dynamic_update_slice_in_dim(x_RxN, block_RxO.astype(x_RxN.dtype), st.n, 1)

  return dataclasses.replace(
    st,
    n=st.n + o,
    cache=cache,
    kv_valid_RxS=kv_valid_RxS,
    logits_RxV=logits_RxV,
    tokens_RxN=put_block(st.tokens_RxN, jnp.where(obs_mask_RxO, obs_ids_RxO, pad_id)),
    mask_RxN=put_block(st.mask_RxN, obs_mask_RxO),
    next_pos_R=st.next_pos_R + count_R,
    asked_R=jnp.zeros_like(asked_R),
    ended_R=st.ended_R | done_R,
    finished_R=st.finished_R | done_R,
    tool_calls_R=st.tool_calls_R + asked_R,
  )


@jax.jit
def assemble_program(state: _TurnState, prompt_ids_RxP, prompt_mask_RxP, group_ids_R):
  """The rollouts (lengths count every real response token) with their turn counts."""
  st = state
  return Rollouts(
    prompt_ids_RxP=prompt_ids_RxP,
    prompt_mask_RxP=prompt_mask_RxP,
    tokens_RxN=st.tokens_RxN,
    mask_RxN=st.mask_RxN,
    loss_mask_RxN=st.loss_mask_RxN,
    behaviour_logp_RxN=st.behaviour_logp_RxN,
    entropy_RxN=st.entropy_RxN,
    lengths_R=jnp.sum(st.mask_RxN, axis=-1, dtype=jnp.int32),
    group_ids_R=group_ids_R,
    finished_R=st.finished_R,
    prox_logp_RxN=st.logp_RxN,
    turns_R=st.turns_R,
    tool_calls_R=st.tool_calls_R,
  )


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
  st, *prompt_rows = prefill_program(
    *args[:5], num_rollouts=num_rollouts, max_new_tokens=N, pad_id=pad_id, model_cfg=model_cfg
  )
  static = dict(max_new_tokens=N, eos_id=stop_ids(eos_id), pad_id=pad_id, greedy=greedy)
  st = _take_turns(args, st, respond, turns, **static)
  return assemble_program(st, *prompt_rows)


def _take_turns(args, st, respond, turns, *, max_new_tokens, eos_id, pad_id, greedy) -> _TurnState:
  """The model's turns from the prefilled state ``st`` (``args``: ``sampler.request_arrays``'),
  each answered by ``respond`` where it asked and an answer fits (``answers_fit``), until no row
  asks or no turn is left."""
  graphdef, params, *_, key, tau, top_p = args
  statics = dict(eos_id=eos_id, stop_ids=turns.stop_ids, call_ids=turns.call_ids, pad_id=pad_id)
  start, o = 0, turns.max_observation_tokens
  for turn in range(turns.max_turns):
    st = turn_program(
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


def _answer(graphdef, params, st: _TurnState, respond: Respond, asked_R, span, o: int, pad_id):
  """The observations ``respond`` gives the ``asked_R`` rows for their turn's tokens (positions
  ``span``: start, end), run through the model (``observe_program``): the state after them, and
  the rows the environment ended."""
  tokens = _turn_tokens(_host(st.tokens_RxN), _host(st.mask_RxN), asked_R, *span)
  observations, done_R = respond(asked_R.copy(), tokens)
  ids_RxO, mask_RxO, done_R = observation_block(observations, done_R, asked_R, o, pad_id)
  return observe_program(graphdef, params, st, ids_RxO, mask_RxO, done_R, pad_id=pad_id), done_R
