"""Token log-probabilities and full-vocabulary entropy at temperature τ, without a [B,T,V] buffer.

Every RL loss here needs, per response token, ℓ = log softmax(z/τ)[o_t] and H = entropy of
softmax(z/τ) over the whole vocabulary, with z = hidden · lm_headᵀ. Materialising z for a batch costs
B·T·V·4 bytes (2 GiB for 8×2k tokens at V=32k) and autodiff keeps several such buffers for the
backward pass. `fused_logprobs_entropy` instead splits the flattened tokens into chunks of C rows,
maps over them with `lax.map`, and wraps the per-chunk function in `jax.checkpoint` so the backward
pass recomputes each chunk's logits: temporary memory is a few C×V buffers, independent of T.

The per-row math lives in one place, `logprobs_entropy_from_logits`, which the fused path, the naive
reference and the sampler (one decode position) all call. It picks the sampled token by comparing
against an iota instead of gathering, so it also works when V is sharded over a 'tensor' mesh axis.
All of it runs in float32 whatever the input dtype, and τ is a traced array (schedules change it every
step without recompiling).
"""

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 128


def logprobs_entropy_from_logits(logits_UxV, tokens_U, tau):
  """Return (log p(token), entropy) of softmax(logits/τ) per row, in float32."""
  z_UxV = logits_UxV.astype(jnp.float32) / jnp.asarray(tau, jnp.float32)
  lse_U = jax.nn.logsumexp(z_UxV, axis=-1)
  logp_UxV = z_UxV - lse_U[:, None]
  p_UxV = jnp.exp(logp_UxV)
  # −Σ p·log p rather than lse − Σ p·z: the latter cancels two large numbers when τ is small.
  # Masked (−inf) logits would give 0·(−inf) = NaN, in the value and in the gradient; the inner
  # where keeps both finite (the outer product is then 0·0).
  safe_logp_UxV = jnp.where(p_UxV > 0, logp_UxV, 0.0)
  entropy_U = -jnp.sum(p_UxV * safe_logp_UxV, axis=-1)
  # One-hot select instead of take_along_axis: elementwise + reduce shards over V, a gather does not.
  vocab_ids_UxV = jax.lax.broadcasted_iota(jnp.int32, logp_UxV.shape, 1)
  is_token_UxV = vocab_ids_UxV == tokens_U.astype(jnp.int32)[:, None]
  logp_U = jnp.sum(jnp.where(is_token_UxV, logp_UxV, 0.0), axis=-1)
  return logp_U, entropy_U


def logits_f32(hidden_UxD, lm_head_VxD):
  """Float32 logits hidden · lm_headᵀ (the head stored [V, D], as HF's); bf16 inputs stay bf16 in
  the matmul but accumulate in float32."""
  contract_d = (((1,), (1,)), ((), ()))
  return jax.lax.dot_general(
    hidden_UxD, lm_head_VxD, contract_d, preferred_element_type=jnp.float32
  )


def naive_logprobs_entropy(hidden_BxTxD, lm_head_VxD, tokens_BxT, tau):
  """Reference version that materialises the full [B,T,V] logits (tests and benchmarks only)."""
  B, T, D = hidden_BxTxD.shape
  logits_UxV = logits_f32(hidden_BxTxD.reshape(B * T, D), lm_head_VxD)
  logp_U, entropy_U = logprobs_entropy_from_logits(logits_UxV, tokens_BxT.reshape(B * T), tau)
  return logp_U.reshape(B, T), entropy_U.reshape(B, T)


def _map_token_chunks(row_fn, hidden_BxTxD, lm_head_VxD, tokens_BxT, tau, chunk_size):
  """Apply ``row_fn(logits_UxV, tokens_U, tau) -> tuple of [U]`` chunk by chunk over the U = B·T tokens.

  Each chunk's logits exist only inside a ``jax.checkpoint``-ed function, so the backward pass
  recomputes them too: no [B,T,V] buffer in either pass.
  """
  B, T, D = hidden_BxTxD.shape
  U = B * T
  C = min(chunk_size, U)
  J = -(-U // C)  # number of chunks, rounding up
  pad = J * C - U
  # Padded rows (zero hidden, token 0) compute harmless values that are sliced off below; their
  # cotangents are zero, so they contribute nothing to the gradients.
  hidden_JxCxD = jnp.pad(hidden_BxTxD.reshape(U, D), ((0, pad), (0, 0))).reshape(J, C, D)
  tokens_JxC = jnp.pad(tokens_BxT.reshape(U), (0, pad)).reshape(J, C)
  tau = jnp.asarray(tau, jnp.float32)

  @jax.checkpoint
  def one_chunk(lm_head, tau, hidden_CxD, tokens_C):
    return row_fn(logits_f32(hidden_CxD, lm_head), tokens_C, tau)

  outs_JxC = jax.lax.map(lambda xs: one_chunk(lm_head_VxD, tau, *xs), (hidden_JxCxD, tokens_JxC))
  return tuple(o.reshape(J * C)[:U].reshape(B, T) for o in outs_JxC)


def fused_logprobs_entropy(
  hidden_BxTxD, lm_head_VxD, tokens_BxT, tau, *, chunk_size: int = DEFAULT_CHUNK_SIZE
):
  """(log p(token), entropy) per token at τ, chunked over B·T tokens so no [B,T,V] buffer exists."""
  return _map_token_chunks(
    logprobs_entropy_from_logits, hidden_BxTxD, lm_head_VxD, tokens_BxT, tau, chunk_size
  )


def logp_log1m_p_from_logits(logits_UxV, tokens_U, tau):
  """Return (log p(token), log(1 − p(token))) of softmax(logits/τ) per row, in float32.

  For p ≥ ½, log(1 − p) is logsumexp over the other logits minus logsumexp over all of them
  (docs/algorithms.md §5): finite, with a nonzero gradient (−p on the token's logit), even where
  p rounds to 1 and log(1 − exp(log p)) is −inf. For p < ½ that difference cancels (absolute error
  ≈ ulp(logsumexp), a large relative error when p is small), so log1p(−p) is used there instead.
  """
  z_UxV = logits_UxV.astype(jnp.float32) / jnp.asarray(tau, jnp.float32)
  lse_U = jax.nn.logsumexp(z_UxV, axis=-1)
  # Iota compare rather than a gather, as above, so V may be sharded.
  vocab_ids_UxV = jax.lax.broadcasted_iota(jnp.int32, z_UxV.shape, 1)
  is_token_UxV = vocab_ids_UxV == tokens_U.astype(jnp.int32)[:, None]
  logp_U = jnp.sum(jnp.where(is_token_UxV, z_UxV, 0.0), axis=-1) - lse_U
  others_lse_U = jax.nn.logsumexp(jnp.where(is_token_UxV, -jnp.inf, z_UxV), axis=-1)
  small_U = logp_U < jnp.log(0.5)
  # Double where: the log1p branch sees only p < ½, so its gradient stays finite where unused.
  log1m_small_U = jnp.log1p(-jnp.exp(jnp.where(small_U, logp_U, jnp.log(0.25))))
  return logp_U, jnp.where(small_U, log1m_small_U, others_lse_U - lse_U)


def fused_log1m_p(hidden_BxTxD, lm_head_VxD, tokens_BxT, tau, *, chunk_size=DEFAULT_CHUNK_SIZE):
  """(log p, log(1 − p)) of each token at τ, chunked over B·T tokens so no [B,T,V] buffer exists."""
  return _map_token_chunks(
    logp_log1m_p_from_logits, hidden_BxTxD, lm_head_VxD, tokens_BxT, tau, chunk_size
  )
