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
decode with the finished rows dropped between chunks of steps (``rollout.compact_every``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.nn import kv_cache, model
from jaxrl.nn.logprobs import logits_f32, logprobs_entropy_from_logits
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


# Sampling inverts the CDF of softmax(z) with one uniform per row (``inverse_cdf_sample``), where
# ``jax.random.categorical`` adds V Gumbel noises (a threefry pass and two logs per vocabulary entry):
# measured at 64 rows on 2 AVX2 cores, 1.9 ms of a ~13 ms decode step at vocab 2048 and 235 ms per
# step at 151,936, against 0.2 and 21 ms. The same key therefore draws other tokens than
# categorical would; the distribution is the same (chi-square tests in tests/test_sampler.py).
_CDF_BLOCK = 128  # vocabulary entries per block of the two-level search
_NUCLEUS_CANDIDATES = (64, 1024)  # top-k tiers the nucleus is looked for in before a sort


def _invert(cdf_RxI: Array, u_R: Array, weight_RxI: Array) -> Array:
  """Index of the first entry whose cumulative weight exceeds u, per row: the entry whose CDF
  interval holds u. Rounding can leave u at or past the last cumulative value; then the last entry
  with weight is taken, so an entry of weight 0 (a -inf logit, padding) is never returned."""
  i = cdf_RxI.shape[-1]
  below_R = jnp.sum(cdf_RxI <= u_R[:, None], axis=-1, dtype=jnp.int32)
  last_with_weight_R = i - 1 - jnp.argmax(weight_RxI[:, ::-1] > 0, axis=-1).astype(jnp.int32)
  return jnp.minimum(below_R, last_with_weight_R)


def inverse_cdf_sample(u_R: Array, z_RxV: Array) -> Array:
  """One token per row from softmax(z), exactly in distribution, from one uniform on [0, 1) per
  row (``u_R``).

  Two levels keep it one pass over the vocabulary: the block of ``_CDF_BLOCK`` entries holding u
  (a cumsum over V / 128 block masses), then the entry inside that block (a cumsum over 128).
  Weights are exp(z - max z), unnormalised: u is scaled to [0, total weight).
  """
  r, v = z_RxV.shape
  blocks = -(-v // _CDF_BLOCK)
  w_RxV = jnp.exp(z_RxV - jnp.max(z_RxV, axis=-1, keepdims=True))  # 0 where z = -inf
  w_RxOxI = jnp.pad(w_RxV, ((0, 0), (0, blocks * _CDF_BLOCK - v))).reshape(r, blocks, -1)
  mass_RxO = jnp.sum(w_RxOxI, axis=-1)
  cdf_RxO = jnp.cumsum(mass_RxO, axis=-1)
  u_R = u_R * cdf_RxO[:, -1]
  block_R = _invert(cdf_RxO, u_R, mass_RxO)
  before_R = jnp.where(
    block_R > 0, jnp.take_along_axis(cdf_RxO, jnp.maximum(block_R - 1, 0)[:, None], -1)[:, 0], 0.0
  )
  w_RxI = jnp.take_along_axis(w_RxOxI, block_R[:, None, None], axis=1)[:, 0]
  within_R = _invert(jnp.cumsum(w_RxI, axis=-1), u_R - before_R, w_RxI)
  return block_R * _CDF_BLOCK + within_R


def _sample_sorted_nucleus(
  u_R, z_sorted_RxI, ids_sorted_RxI, p_sorted_RxI, top_p, log_norm_Rx1
) -> tuple[Array, Array]:
  """Sample among the most likely tokens (sorted by probability, ``p_sorted`` normalised over the
  full vocabulary, whose log-normaliser is ``log_norm``) the smallest top set whose mass reaches
  top_p. Returns the tokens and the log of that set's mass: ℓ_μ = ℓ − log mass."""
  mass_before_RxI = jnp.cumsum(p_sorted_RxI, axis=-1) - p_sorted_RxI
  # The most likely token is always kept, so top_p -> 0 degrades to greedy, never to nothing.
  keep_RxI = (mass_before_RxI < top_p) | (jnp.arange(z_sorted_RxI.shape[-1]) == 0)
  z_kept_RxI = jnp.where(keep_RxI, z_sorted_RxI, -jnp.inf)
  rank_R = inverse_cdf_sample(u_R, z_kept_RxI)
  log_mass_R = jax.nn.logsumexp(z_kept_RxI, axis=-1) - log_norm_Rx1[:, 0]
  return jnp.take_along_axis(ids_sorted_RxI, rank_R[:, None], axis=-1)[:, 0], log_mass_R


def _nucleus_sample(u_R: Array, z_RxV: Array, top_p: Array) -> tuple[Array, Array]:
  """Sample from softmax(z) restricted to the smallest top set whose mass reaches top_p: the
  tokens and the log of the set's mass (``_sample_sorted_nucleus``).

  The nucleus is looked for among the top ``_NUCLEUS_CANDIDATES[0]`` tokens (``lax.top_k``: 1.2 ms
  at 64 rows x 2048, 18 ms at 151,936, where sorting the whole vocabulary takes 25 ms and 2.8 s);
  when their mass falls short of top_p in some row (a flatter distribution) among the next tier's,
  and only past the last tier is the vocabulary sorted. Whichever path, the kept set is the same.
  """
  v = z_RxV.shape[-1]
  log_norm_Rx1 = jax.nn.logsumexp(z_RxV, axis=-1, keepdims=True)

  def full_sort():
    ids_RxV = jax.lax.broadcasted_iota(jnp.int32, z_RxV.shape, 1)
    neg_z_sorted_RxV, ids_sorted_RxV = jax.lax.sort_key_val(-z_RxV, ids_RxV, dimension=-1)
    z_sorted_RxV = -neg_z_sorted_RxV
    p_sorted_RxV = jnp.exp(z_sorted_RxV - log_norm_Rx1)
    return _sample_sorted_nucleus(
      u_R, z_sorted_RxV, ids_sorted_RxV, p_sorted_RxV, top_p, log_norm_Rx1
    )

  def among_top(tiers):
    if not tiers or tiers[0] >= v:
      return full_sort()
    z_top_RxI, ids_top_RxI = jax.lax.top_k(z_RxV, tiers[0])
    p_top_RxI = jnp.exp(z_top_RxI - log_norm_Rx1)
    return jax.lax.cond(
      jnp.all(jnp.sum(p_top_RxI, axis=-1) >= top_p),
      lambda: _sample_sorted_nucleus(u_R, z_top_RxI, ids_top_RxI, p_top_RxI, top_p, log_norm_Rx1),
      lambda: among_top(tiers[1:]),
    )

  return among_top(_NUCLEUS_CANDIDATES)


def _choose(
  u_R: Array, logits_RxV: Array, tau: Array, top_p: Array, greedy: bool
) -> tuple[Array, Array]:
  """Next token per row: argmax, or a sample from the top-p nucleus of softmax(z/τ); and the log
  of the sampled set's mass under softmax(z/τ), 0 when it is the whole vocabulary (top_p = 1, and
  greedy decoding, whose ℓ_μ is reported as the full softmax's: evaluation never trains on it)."""
  if greedy:
    tok_R = jnp.argmax(logits_RxV, axis=-1).astype(jnp.int32)
    return tok_R, jnp.zeros(tok_R.shape, jnp.float32)
  z_RxV = logits_RxV / tau

  def whole_vocabulary():
    tok_R = inverse_cdf_sample(u_R, z_RxV)
    return tok_R, jnp.zeros(tok_R.shape, jnp.float32)

  # top_p = 1 skips the nucleus search; its cumsum can also round just past 1 and drop tail tokens.
  return jax.lax.cond(top_p < 1.0, lambda: _nucleus_sample(u_R, z_RxV, top_p), whole_vocabulary)


def _draw(
  key, n, logits_RxV, tau, top_p, greedy: bool, live_R, pad_id: int, row_R=None, num_rows=None
):
  """Token n of each row from its logits, with ℓ (the full softmax at τ), ℓ_μ (the distribution
  drawn from: the nucleus renormalised) and the entropy at τ; ``pad_id`` and 0, 0, 0 in the rows
  not ``live_R``.

  Token n's draws are the ``num_rows`` uniforms keyed by ``fold_in(key, n)``, one per rollout row;
  a compacted batch (``row_R``: the rollout row each of its rows holds, ``num_rows`` or more in a
  slot that holds none) takes its rows' own, so a row draws the same tokens whichever rows share
  its batch. Without ``row_R`` batch row r is rollout row r."""
  rows = logits_RxV.shape[0] if row_R is None else num_rows
  u_R = jax.random.uniform(jax.random.fold_in(key, n), (rows,), jnp.float32)
  if row_R is not None:
    u_R = jnp.take(u_R, row_R, mode="clip")
  tok_R, log_mass_R = _choose(u_R, logits_RxV, tau, top_p, greedy)
  logp_R, entropy_R = logprobs_entropy_from_logits(logits_RxV, tok_R, tau)
  return (
    jnp.where(live_R, tok_R, pad_id),
    jnp.where(live_R, logp_R, 0.0),
    jnp.where(live_R, logp_R - log_mass_R, 0.0),
    jnp.where(live_R, entropy_R, 0.0),
  )


def _put(x_RxN: Array, col_R: Array, n: Array) -> Array:
  """``x_RxN`` with column ``n`` replaced by ``col_R`` (cast to the buffer's dtype)."""
  return jax.lax.dynamic_update_slice_in_dim(x_RxN, col_R[:, None].astype(x_RxN.dtype), n, 1)


def _expand(prompt_ids_BxP: Array, prompt_mask_BxP: Array, counts_B: Array, num_rollouts: int):
  """Repeat question i's prompt counts_B[i] times: the R prompt rows, their masks and group ids.

  The static ``total_repeat_length`` keeps R fixed, so new counts (same R) reuse the compilation.
  """

  def expand(x_B):
    return kv_cache.repeat_by_counts(x_B, counts_B, num_rollouts)

  prompt_ids_RxP = expand(prompt_ids_BxP).astype(jnp.int32)
  prompt_mask_RxP = expand(prompt_mask_BxP).astype(bool)
  group_ids_R = expand(jnp.arange(prompt_ids_BxP.shape[0], dtype=jnp.int32))
  return prompt_ids_RxP, prompt_mask_RxP, group_ids_R


def _prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, *, rows, model_cfg):
  """Run each distinct prompt through the model once, then give each of its counts_B[i] rollouts
  a copy of its cache (``rows`` rows in all, P slots: the decode grows it, ``sample_program``).

  A GRPO batch repeats every prompt G times: prefilling the B prompts rather than the R = Σ G_i
  rows does 1/G of the work (vLLM's prefix cache does the same for a request's n samples; HF
  ``generate`` prefills every row). The rows are independent, so the values are those of a
  prefill over the R rows. Returns the R-row cache and the logits that predict token 0.
  """
  cache = model.init_cache(
    model_cfg, prompt_ids_BxP.shape[0], prompt_ids_BxP.shape[1], jnp.dtype(model_cfg.dtype)
  )
  hidden_BxPxD, lm_head_VxD, cache = model.forward(
    graphdef,
    params,
    prompt_ids_BxP,
    model.positions_from_mask(prompt_mask_BxP),
    prompt_mask_BxP,
    cache,
    0,
  )
  # Token 0 comes from the prefill's last slot (P-1 holds every row's last prompt token).
  logits_BxV = logits_f32(hidden_BxPxD[:, -1], lm_head_VxD)
  logits_RxV = kv_cache.repeat_by_counts(logits_BxV, counts_B, rows)
  return cache.repeat_rows(counts_B, rows), logits_RxV


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
  row_R: Array | None = None  # a compacted batch's rollout rows (``_draw``); None: row r is row r
  num_rows: int | None = static_field(default=None)  # the rollout rows, with ``row_R``

  def emit(self, st: _DecodeState) -> _DecodeState:
    """Choose token n from ``st.logits_RxV`` and record it (pad and masked once a row finished)."""
    live_R = ~st.finished_R
    tok_R, logp_R, behaviour_R, entropy_R = _draw(
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

  The trainer counts its traces (``run/loop.py: COUNTED_PROGRAMS``) and ``--plan`` lowers it.
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


@pytree_dataclass
class Prefilled:
  """R rollout rows before their token 0: where every decode starts, single- or multi-turn."""

  prompt_ids_RxP: Array  # i32
  prompt_mask_RxP: Array  # bool
  group_ids_R: Array  # i32, the row's prompt
  prompt_len_R: Array  # i32, real prompt tokens: the RoPE position of response token 0
  cache: kv_cache.KVCache  # the prompts' keys and values, P slots
  kv_valid_RxS: Array  # bool over P + N slots: the real prompt slots, none of the response's yet
  logits_RxV: Array  # f32, predict token 0


def prefill_rows(
  graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, *, rows, max_new_tokens, model_cfg
) -> Prefilled:
  """Expand the B prompts to ``rows`` = R rows (``_expand``) and prefill them (``_prefill``: once
  per distinct prompt), for responses of at most ``max_new_tokens`` tokens."""
  prompt_ids_RxP, prompt_mask_RxP, group_ids_R = _expand(
    prompt_ids_BxP, prompt_mask_BxP, counts_B, rows
  )
  cache, logits_RxV = _prefill(
    graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, rows=rows, model_cfg=model_cfg
  )
  return Prefilled(
    prompt_ids_RxP=prompt_ids_RxP,
    prompt_mask_RxP=prompt_mask_RxP,
    group_ids_R=group_ids_R,
    # Response token n sits at RoPE position prompt_len + n (no gap after a left-padded prompt).
    prompt_len_R=jnp.sum(prompt_mask_RxP, axis=-1, dtype=jnp.int32),
    cache=cache,
    kv_valid_RxS=jnp.concatenate(
      [prompt_mask_RxP, jnp.zeros((rows, max_new_tokens), bool)], axis=1
    ),
    logits_RxV=logits_RxV,
  )


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
