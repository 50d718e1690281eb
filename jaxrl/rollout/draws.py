"""How a decode step draws each row's next token from its logits: greedy, or a sample of softmax(z/τ)
or of its top-p nucleus, with the token's ℓ (the full softmax at τ), ℓ_μ (the distribution drawn
from, docs/algorithms.md §9.1) and entropy.

A sample inverts the CDF with one uniform per row (``inverse_cdf_sample``); the nucleus is looked
for in top-k tiers before the vocabulary is sorted (``_nucleus_sample``). Token n's uniforms are
keyed by ``fold_in(key, n)``, one per rollout row, so a row draws the same tokens whichever rows
share its batch (``draw``). The single-turn, compacted and multi-turn decodes all draw here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.nn.logprobs import logprobs_entropy_from_logits
from jaxrl.types import Array

# Sampling inverts the CDF of softmax(z) with one uniform per row (``inverse_cdf_sample``), where
# ``jax.random.categorical`` adds V Gumbel noises (a threefry pass and two logs per vocabulary entry),
# a cost per token that grows with the vocabulary and rivals the decode step's own work at
# 151,936 entries. The same key therefore draws other tokens than
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

  The nucleus is looked for among the top ``_NUCLEUS_CANDIDATES[0]`` tokens (``lax.top_k``, a
  partial selection, where a sort of the whole vocabulary costs two orders of magnitude more at
  151,936 entries);
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


def draw(
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
