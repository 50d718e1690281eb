"""The jitted programs of a multi-turn rollout (docs/algorithms.md §11), which ``multiturn.generate``
drives from the host: ``prefill_program``, ``turn_program`` (one model turn of every row),
``observe_program`` (the environment's observations through the model) and ``assemble_program``
(the ``Rollouts``), over ``TurnBuffers``, the state they carry between turns. How turns,
observations and gaps are laid out in the response buffer: ``multiturn``'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl.nn import kv_cache, model
from jaxrl.nn.logprobs import logits_f32
from jaxrl.rollout import prefill, sampler
from jaxrl.rollout.draws import draw
from jaxrl.rollout.sampler import _put
from jaxrl.types import Array, Rollouts, pytree_dataclass


@pytree_dataclass
class TurnBuffers:
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
  state = TurnBuffers(
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


def _prompt_width(st: TurnBuffers) -> int:
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

  def emit(self, st: TurnBuffers) -> TurnBuffers:
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

  def step(self, st: TurnBuffers) -> TurnBuffers:
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

  def running(self, st: TurnBuffers) -> Array:
    return (st.n < self.end) & jnp.any(st.in_turn_R)


@functools.partial(
  jax.jit,
  static_argnames=("max_turn_tokens", "eos_id", "stop_ids", "call_ids", "pad_id", "greedy"),
  donate_argnames=("state",),
)
def turn_program(
  graphdef,
  params,
  state: TurnBuffers,
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
) -> TurnBuffers:
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
  graphdef, params, state: TurnBuffers, obs_ids_RxO, obs_mask_RxO, done_R, *, pad_id
) -> TurnBuffers:
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
def assemble_program(state: TurnBuffers, prompt_ids_RxP, prompt_mask_RxP, group_ids_R):
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
