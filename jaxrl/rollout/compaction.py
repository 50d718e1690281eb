"""The JAX sampler's decode without the finished rows: live rows compacted into smaller batches.

``sampler.sample_program`` decodes every row until the last one finishes, so with long-tailed
response lengths most of a batch's row-steps go to rows that already ended (``wasted_share``).
``generate`` here runs the same decode steps in chunks of ``compact_every`` tokens, one jitted
loop per chunk. Between chunks the host reads which rows finished; once the live rows fit a
smaller batch bucket (``row_buckets``: R, then powers of two down to ``MIN_BUCKET``), it writes the
batch's responses into the R-row result and gathers the live rows (their KV cache, logits and
buffers) into that bucket; the bucket's spare slots hold finished copies, written nowhere.

A row draws its own uniforms whichever rows share its batch (``draws.draw`` with ``row_R``), so
for the same key the tokens are ``sampler.generate``'s and the log-probs and entropies equal theirs
within float32 rounding: XLA's CPU products sum a batch of another size in another order (about
1e-6 at the test's model). A token could differ only where its uniform falls within that rounding
of a CDF boundary. Costs: a host sync per chunk, one gather per bucket change; compiles: one
decode chunk per (bucket, cache width of a ``sampler.segment_ends`` segment).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rollout import sampler
from jaxrl.types import Array, Rollouts, pytree_dataclass

# The smallest batch the live rows are compacted into: below it a decode step costs about the same
# (its fixed cost, reading the weights, dominates: bench/decode_step.py), and each bucket is one
# more compile per segment width.
MIN_BUCKET = 8


def row_buckets(rows: int) -> list[int]:
  """The batch sizes the decode runs at, largest first: R, then the powers of two below it down to
  ``MIN_BUCKET``."""
  smaller, bucket = [], MIN_BUCKET
  while bucket < rows:
    smaller.append(bucket)
    bucket *= 2
  return [rows] + smaller[::-1]


def bucket_for(live: int, rows: int) -> int:
  """The smallest bucket of R = ``rows`` that holds ``live`` rows."""
  return min(b for b in row_buckets(rows) if b >= live)


def chunk_end(n: int, max_new_tokens: int, compact_every: int) -> int:
  """The (exclusive) last token of the chunk that starts at token n: ``compact_every`` tokens on,
  or the end of n's segment (``sampler.segment_ends``: the cache grows there)."""
  end = next(e for e in sampler.segment_ends(max_new_tokens) if e > n)
  return min(n + compact_every, end)


def wasted_share(lengths_R, max_new_tokens: int, compact_every: int = 0) -> float:
  """The share of decode row-steps (a row's model call at one token) spent on rows that had
  finished, for rows of these response lengths: without compaction (``compact_every`` 0) every
  step decodes all R rows until the longest ends; with it, each chunk decodes the bucket that
  holds the rows live at its start. A step's cost also grows with the cache it reads; not here."""
  lengths_R = np.asarray(lengths_R)
  rows, longest = len(lengths_R), int(lengths_R.max())
  # Step n (n >= 1: token 0 comes from the prefill) decodes the rows longer than n tokens.
  useful = int(np.sum(np.maximum(lengths_R - 1, 0)))
  spent, n, bucket = 0, 1, rows
  while n < longest:
    end = min(chunk_end(n, max_new_tokens, compact_every or max_new_tokens), longest)
    if compact_every:
      bucket = bucket_for(max(int(np.sum(lengths_R > n)), 1), bucket)
    spent, n = spent + bucket * (end - n), end
  return 1.0 - useful / spent if spent else 0.0


@pytree_dataclass
class _Responses:
  """The R-row buffers ``sampler._assemble`` reads from a decode carry (the same field names)."""

  tokens_RxN: Array
  mask_RxN: Array
  logp_RxN: Array
  behaviour_logp_RxN: Array
  entropy_RxN: Array
  finished_R: Array


def _responses(st: sampler._DecodeState) -> _Responses:
  return _Responses(**{f.name: getattr(st, f.name) for f in dataclasses.fields(_Responses)})


@functools.partial(jax.jit, donate_argnames=("out",))
def _write(out: _Responses, st: sampler._DecodeState, row_b: Array) -> _Responses:
  """``out`` with each batch row's responses in its rollout row (spare slots, row R, dropped)."""
  return jax.tree.map(lambda o, x: o.at[row_b].set(x, mode="drop"), out, _responses(st))


@jax.jit
def _take(st: sampler._DecodeState, prompt_len_b: Array, take_b: Array, spare_b: Array):
  """The carry of a smaller batch: its row i is the given carry's row take_b[i], finished where
  ``spare_b`` (a slot no live row fills)."""
  rows = functools.partial(jnp.take, indices=take_b, axis=0)
  return dataclasses.replace(
    st,
    cache=st.cache.take_rows(take_b),
    kv_valid_RxS=rows(st.kv_valid_RxS),
    logits_RxV=rows(st.logits_RxV),
    tokens_RxN=rows(st.tokens_RxN),
    mask_RxN=rows(st.mask_RxN),
    logp_RxN=rows(st.logp_RxN),
    behaviour_logp_RxN=rows(st.behaviour_logp_RxN),
    entropy_RxN=rows(st.entropy_RxN),
    finished_R=rows(st.finished_R) | spare_b,
  ), rows(prompt_len_b)


@functools.partial(
  jax.jit,
  static_argnames=("num_rollouts", "max_new_tokens", "eos_id", "pad_id", "model_cfg", "greedy"),
)
def _start(*args, num_rollouts, max_new_tokens, eos_id, pad_id, model_cfg, greedy):
  """``sampler.begin``, jitted: the decoder without its params (each chunk passes them), the
  carry after token 0 and the prompt rows."""
  decoder, st, prompt_rows = sampler.begin(
    *args,
    num_rollouts=num_rollouts,
    max_new_tokens=max_new_tokens,
    eos_id=eos_id,
    pad_id=pad_id,
    model_cfg=model_cfg,
    greedy=greedy,
  )
  return dataclasses.replace(decoder, params=None), st, prompt_rows


@functools.partial(jax.jit, donate_argnames=("st",))
def decode_chunk(
  params, decoder: sampler._Decoder, st: sampler._DecodeState
) -> sampler._DecodeState:
  """Decode ``decoder``'s batch of rollout rows (``row_R``) up to its token ``until`` (traced) or
  until every row finished (the cache holds the slots of ``until``'s segment: ``_grow``)."""
  decoder = dataclasses.replace(decoder, params=params)
  return jax.lax.while_loop(decoder.running, decoder.step, st)


@functools.partial(jax.jit, static_argnames=("slots",))
def _grow(st: sampler._DecodeState, slots: int) -> sampler._DecodeState:
  """The carry with a cache of ``slots`` slots (its own program, so that ``decode_chunk``'s input
  and output have one shape and the carry it is given is updated in place)."""
  return dataclasses.replace(st, cache=st.cache.pad_slots(slots))


def _compact(out: _Responses | None, decoder: sampler._Decoder, st, finished_b):
  """(out, decoder, carry) for the next chunk: once the live rows (not ``finished_b``) fit a
  smaller bucket, the batch's responses written into ``out`` (the first batch's are ``out``) and
  the live rows gathered; unchanged otherwise."""
  row_b = np.asarray(decoder.row_R)
  live = np.flatnonzero(~finished_b)
  bucket = bucket_for(len(live), len(row_b))
  if bucket == len(row_b):
    return out, decoder, st
  # The first batch is every rollout row in order: its responses are the result so far.
  out = _responses(st) if out is None else _write(out, st, row_b)
  spare = bucket - len(live)
  take_b = np.concatenate([live, np.full(spare, live[0])]).astype(np.int32)
  spare_b = np.arange(bucket) >= len(live)
  st, prompt_len_b = _take(st, decoder.prompt_len_R, take_b, spare_b)
  row_b = np.where(spare_b, decoder.num_rows, row_b[take_b]).astype(np.int32)
  return out, dataclasses.replace(decoder, prompt_len_R=prompt_len_b, row_R=row_b), st


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
  compact_every: int = 32,
) -> Rollouts:
  """``sampler.generate``'s rollouts (the same for the same key), decoded in chunks of
  ``compact_every`` tokens with the finished rows dropped between chunks."""
  if compact_every < 1:
    raise ValueError(f"compact_every must be >= 1, got {compact_every}")
  args = sampler.request_arrays(
    *(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, key, temperature, top_p),
    num_rollouts=num_rollouts,
    max_new_tokens=max_new_tokens,
  )
  R, N = num_rollouts, max_new_tokens
  decoder, st, prompt_rows = _start(
    *args,
    num_rollouts=R,
    max_new_tokens=N,
    eos_id=sampler.stop_ids(eos_id),
    pad_id=pad_id,
    model_cfg=model_cfg,
    greedy=greedy,
  )
  decoder = dataclasses.replace(decoder, row_R=np.arange(R, dtype=np.int32), num_rows=R)
  P, out = decoder.prompt_width, None
  n, finished_b = jax.device_get((st.n, st.finished_R))
  while n < N and not finished_b.all():
    out, decoder, st = _compact(out, decoder, st, finished_b)
    # The cache holds the slots of the chunk's segment (``sampler.segment_ends``).
    end = next(e for e in sampler.segment_ends(N) if e > n)
    if st.cache.slots < P + end:
      st = _grow(st, P + end)
    chunk = dataclasses.replace(decoder, until=jnp.int32(chunk_end(n, N, compact_every)))
    st = decode_chunk(params, chunk, st)
    n, finished_b = jax.device_get((st.n, st.finished_R))
  out = _responses(st) if out is None else _write(out, st, np.asarray(decoder.row_R))
  return sampler._assemble(*prompt_rows, out)
