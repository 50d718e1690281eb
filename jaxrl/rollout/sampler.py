"""The embedded JAX sampler: KV-cached autoregressive generation of a step's rollouts.

One jitted function turns B left-padded prompts and per-question rollout counts G_i into R = Σ G_i
sampled responses. The expansion to R rows happens inside jit with a static ``total_repeat_length``,
so a new allocation (same R) never recompiles; τ and top-p are traced arrays for the same reason.

With each sampled token it returns two log-probs and an entropy (docs/algorithms.md §9.1):
ℓ_μ (``behaviour_logp_RxN``), the token's log-prob under the distribution it was drawn from, with
top_p < 1 the nucleus of softmax(z/τ) renormalised; ℓ = log softmax(z/τ)[token] over the FULL
vocabulary (``prox_logp_RxN``: the trainer's ℓ_prox when the update starts from these params); and
the entropy of the full softmax(z/τ). ℓ and the entropy come from the same
``logprobs_entropy_from_logits`` the training forward uses. With top_p = 1 the two log-probs are
equal.

Cache layout (``jaxrl.nn.model``): the left-padded prompt fills slots 0..P-1, generated token n goes to
slot P+n, and ``kv_valid_RxS`` marks the real slots, so RoPE positions and attention match a
no-cache forward over ``prompt ++ response`` with ``positions_from_mask``.

The loop decodes every row until the last one finishes; ``jaxrl.rollout.compaction`` runs the same
decode with the finished rows dropped between chunks of steps (``rollout.compact_every``). The rows
start from ``rollout.prefill``'s set-up; each token is drawn by ``rollout.draws``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.nn import kv_cache, model
from jaxrl.nn.logprobs import logits_f32
from jaxrl.rollout.draws import draw
from jaxrl.rollout.prefill import prefill_rows
from jaxrl.types import Array, Rollouts, pytree_dataclass, static_field


@pytree_dataclass
class _DecodeState:
  """Carry of the decode loop; ``logits_RxV`` predict token ``n``."""

  n: Array  # i32[] index of the next token to emit
  cache: kv_cache.KVCache
  kv_valid_RxS: Array  # bool
  logits_RxV: Array  # f32
  tokens_RxN: Array
  mask_RxN: Array
  logp_RxN: Array  # ℓ, full softmax(z/τ)
  behaviour_logp_RxN: Array  # ℓ_μ, the distribution sampled (the nucleus's, renormalised)
  entropy_RxN: Array
  finished_R: Array


def _put(x_RxN: Array, col_R: Array, n: Array) -> Array:
  """``x_RxN`` with column ``n`` replaced by ``col_R`` (cast to the buffer's dtype)."""
  return jax.lax.dynamic_update_slice_in_dim(x_RxN, col_R[:, None].astype(x_RxN.dtype), n, 1)


def _initial_state(cache, kv_valid_RxS, logits_RxV, *, max_new_tokens, pad_id) -> _DecodeState:
  """The decode carry before token 0: empty (pad, masked) response buffers, no row finished."""
  R, N = logits_RxV.shape[0], max_new_tokens
  return _DecodeState(
    n=jnp.int32(0),
    cache=cache,
    kv_valid_RxS=kv_valid_RxS,
    logits_RxV=logits_RxV,
    tokens_RxN=jnp.full((R, N), pad_id, jnp.int32),
    mask_RxN=jnp.zeros((R, N), bool),
    logp_RxN=jnp.zeros((R, N), jnp.float32),
    behaviour_logp_RxN=jnp.zeros((R, N), jnp.float32),
    entropy_RxN=jnp.zeros((R, N), jnp.float32),
    finished_R=jnp.zeros((R,), bool),
  )


@pytree_dataclass
class _Decoder:
  """The loop-invariant inputs of a decode step (traced arrays and static settings alike), so
  ``emit``/``step``/``running`` can be the ``while_loop``'s functions without a closure; a pytree,
  so that compacted decode passes it into its chunk program (``compaction.decode_chunk``)."""

  graphdef: object
  params: object
  key: Array
  tau: Array  # f32[]
  top_p: Array  # f32[]
  prompt_len_R: Array  # i32, real prompt tokens per row: the RoPE position of token 0
  # this loop's last token is until - 1: N, a segment's end (``segment_ends``) or a chunk's (traced)
  until: int | Array
  prompt_width: int = static_field()  # P: the response's token n sits in cache slot P + n
  eos_id: tuple[int, ...] = static_field()
  pad_id: int = static_field()
  greedy: bool = static_field()
  row_R: Array | None = None  # a compacted batch's rollout rows (``draw``); None: row r is row r
  num_rows: int | None = static_field(default=None)  # the rollout rows, with ``row_R``

  def emit(self, st: _DecodeState) -> _DecodeState:
    """Choose token n from ``st.logits_RxV`` and record it (pad and masked once a row finished)."""
    live_R = ~st.finished_R
    tok_R, logp_R, behaviour_R, entropy_R = draw(
      self.key,
      st.n,
      st.logits_RxV,
      self.tau,
      self.top_p,
      self.greedy,
      live_R,
      self.pad_id,
      self.row_R,
      self.num_rows,
    )
    return _DecodeState(
      n=st.n + 1,
      cache=st.cache,
      kv_valid_RxS=jax.lax.dynamic_update_slice_in_dim(
        st.kv_valid_RxS, live_R[:, None], self.prompt_width + st.n, 1
      ),
      logits_RxV=st.logits_RxV,
      tokens_RxN=_put(st.tokens_RxN, tok_R, st.n),
      mask_RxN=_put(st.mask_RxN, live_R, st.n),
      logp_RxN=_put(st.logp_RxN, logp_R, st.n),
      behaviour_logp_RxN=_put(st.behaviour_logp_RxN, behaviour_R, st.n),
      entropy_RxN=_put(st.entropy_RxN, entropy_R, st.n),
      finished_R=st.finished_R | (live_R & jnp.isin(tok_R, jnp.asarray(stop_ids(self.eos_id)))),
    )

  def step(self, st: _DecodeState) -> _DecodeState:
    """The loop body: feed token n-1 (slot P+n-1) through the model, then emit token n."""
    prev, P = st.n - 1, self.prompt_width
    tok_Rx1 = jax.lax.dynamic_slice_in_dim(st.tokens_RxN, prev, 1, axis=1)
    pos_Rx1 = (self.prompt_len_R + prev)[:, None]
    # The segment's cache holds the slots its tokens can reach (``sample_program``): attend to them.
    visible_RxS = st.kv_valid_RxS[:, : st.cache.slots]
    hidden_Rx1xD, lm_head, cache = model.forward(
      self.graphdef, self.params, tok_Rx1, pos_Rx1, visible_RxS, st.cache, P + prev
    )
    logits_RxV = logits_f32(hidden_Rx1xD[:, 0], lm_head)
    return self.emit(dataclasses.replace(st, cache=cache, logits_RxV=logits_RxV))

  def running(self, st: _DecodeState) -> Array:
    """The loop condition: the segment has a token left and some row has not finished."""
    return (st.n < self.until) & ~jnp.all(st.finished_R)


# A decode step reads every slot of the cache. The loop therefore runs in segments that end after
# token 64, 256, 1024, ... (x4) and N, and the cache grows at each segment's start to the slots its
# tokens can reach, P + its end (one copy per segment): at N = 2048 a step reads ~70% of the P + N
# slots on average. (Slicing one full-size cache instead made XLA copy the slice every step.) One
# compiled loop body per segment: 4 at N = 2048.
_FIRST_SEGMENT, _SEGMENT_GROWTH = 64, 4


def segment_ends(max_new_tokens: int) -> list[int]:
  """The (exclusive) last token of each decode segment, increasing, ending at N."""
  ends, end = [], _FIRST_SEGMENT
  while end < max_new_tokens:
    ends.append(end)
    end *= _SEGMENT_GROWTH
  return ends + [max_new_tokens]


def _assemble(prompt_ids_RxP, prompt_mask_RxP, group_ids_R, st: _DecodeState) -> Rollouts:
  """The rollouts from the final decode carry (lengths count the masked-in response tokens)."""
  return Rollouts(
    prompt_ids_RxP=prompt_ids_RxP,
    prompt_mask_RxP=prompt_mask_RxP,
    tokens_RxN=st.tokens_RxN,
    mask_RxN=st.mask_RxN,
    loss_mask_RxN=st.mask_RxN,  # single-turn: every response token is the model's
    behaviour_logp_RxN=st.behaviour_logp_RxN,
    entropy_RxN=st.entropy_RxN,
    lengths_R=jnp.sum(st.mask_RxN, axis=-1, dtype=jnp.int32),
    group_ids_R=group_ids_R,
    finished_R=st.finished_R,
    prox_logp_RxN=st.logp_RxN,
  )


@functools.partial(
  jax.jit,
  static_argnames=("num_rollouts", "max_new_tokens", "eos_id", "pad_id", "model_cfg", "greedy"),
)
def sample_program(*args, num_rollouts, max_new_tokens, eos_id, pad_id, model_cfg, greedy):
  """Jitted body of ``generate`` (no host-side checks): expand, prefill, decode, assemble; its
  positional arguments are ``begin``'s (``request_arrays``' checked arrays).

  The trainer counts its traces (``run/context.py: COUNTED_PROGRAMS``) and ``--plan`` lowers it.
  """
  decoder, st, prompt_rows = begin(
    *args,
    num_rollouts=num_rollouts,
    max_new_tokens=max_new_tokens,
    eos_id=eos_id,
    pad_id=pad_id,
    model_cfg=model_cfg,
    greedy=greedy,
  )
  for end in segment_ends(max_new_tokens):
    segment = dataclasses.replace(decoder, until=end)
    st = dataclasses.replace(st, cache=st.cache.pad_slots(decoder.prompt_width + end))
    st = jax.lax.while_loop(segment.running, segment.step, st)
  return _assemble(*prompt_rows, st)


def begin(
  graphdef,
  params,
  prompt_ids_BxP,
  prompt_mask_BxP,
  counts_B,
  key,
  temperature,
  top_p,
  *,
  num_rollouts,
  max_new_tokens,
  eos_id,
  pad_id,
  model_cfg,
  greedy,
) -> tuple[_Decoder, _DecodeState, tuple[Array, Array, Array]]:
  """Expand, prefill and emit token 0 (traced): the decoder (``until`` N), the carry (a cache of
  P slots) and the prompt rows ``_assemble`` takes (ids, mask, group ids)."""
  rows = prefill_rows(
    graphdef,
    params,
    prompt_ids_BxP,
    prompt_mask_BxP,
    counts_B,
    rows=num_rollouts,
    max_new_tokens=max_new_tokens,
    model_cfg=model_cfg,
  )
  decoder = _Decoder(
    graphdef=graphdef,
    params=params,
    key=key,
    tau=jnp.asarray(temperature, jnp.float32),
    top_p=jnp.asarray(top_p, jnp.float32),
    prompt_len_R=rows.prompt_len_R,
    until=max_new_tokens,
    prompt_width=prompt_ids_BxP.shape[1],
    eos_id=eos_id,
    pad_id=pad_id,
    greedy=greedy,
  )
  # Token 0 comes straight from the prefill's logits; each loop step feeds the last token back.
  st = decoder.emit(
    _initial_state(
      rows.cache, rows.kv_valid_RxS, rows.logits_RxV, max_new_tokens=max_new_tokens, pad_id=pad_id
    )
  )
  return decoder, st, (rows.prompt_ids_RxP, rows.prompt_mask_RxP, rows.group_ids_R)


def generate(
  graphdef,
  params,
  prompt_ids_BxP,
  prompt_mask_BxP,
  counts_B,
  key,
  temperature,
  top_p,
  *,
  num_rollouts: int,
  max_new_tokens: int,
  eos_id: int | tuple[int, ...],
  pad_id: int,
  model_cfg,
  greedy: bool = False,
) -> Rollouts:
  """Sample counts_B[i] responses to each left-padded prompt i; needs Σ counts_B == num_rollouts.

  A row finishes at the first token in ``eos_id`` (one id, or several: e.g. Llama 3 Instruct's
  <|eot_id|> and <|end_of_text|>); the stop token is part of the response.

  Compiles once per (shapes, num_rollouts, max_new_tokens, eos/pad ids, model_cfg, greedy); counts,
  temperature, top_p and key are traced. Its traces are counted (``sample_program``, through
  ``jaxrl.run.compiles.CompileCounter``).
  """
  return sample_program(
    *request_arrays(
      graphdef,
      params,
      prompt_ids_BxP,
      prompt_mask_BxP,
      counts_B,
      key,
      temperature,
      top_p,
      num_rollouts=num_rollouts,
      max_new_tokens=max_new_tokens,
    ),
    num_rollouts=num_rollouts,
    max_new_tokens=max_new_tokens,
    eos_id=stop_ids(eos_id),
    pad_id=pad_id,
    model_cfg=model_cfg,
    greedy=greedy,
  )


def request_arrays(
  graphdef,
  params,
  prompt_ids_BxP,
  prompt_mask_BxP,
  counts_B,
  key,
  temperature,
  top_p,
  *,
  num_rollouts: int,
  max_new_tokens: int,
) -> tuple:
  """``generate``'s positional arguments, checked (``max_new_tokens``, Σ counts_B) and as the arrays
  its program takes: fixed dtypes (not weak Python scalars), so that floats, numpy and jax inputs
  share one compilation."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if not isinstance(counts_B, jax.core.Tracer):
    # Rows past Σ counts would be copies of the last prompt with a wrong group id: refuse them.
    total = int(np.sum(np.asarray(counts_B)))
    if total != num_rollouts:
      raise ValueError(f"sum(counts_B) = {total} but num_rollouts = {num_rollouts}")
  return (
    graphdef,
    params,
    jnp.asarray(prompt_ids_BxP, jnp.int32),
    jnp.asarray(prompt_mask_BxP, bool),
    jnp.asarray(counts_B, jnp.int32),
    key,
    jnp.asarray(temperature, jnp.float32),
    jnp.asarray(top_p, jnp.float32),
  )


def stop_ids(eos_id: int | tuple[int, ...]) -> tuple[int, ...]:
  """The stop token ids as a tuple (hashable, so it can be a static jit argument)."""
  return (int(eos_id),) if np.ndim(eos_id) == 0 else tuple(int(i) for i in eos_id)
