"""The two attention paths compute the same attention: the blocked softmax attention
(``attention.attention``: the CPU path and the fallback) and one ``jax.nn.dot_product_attention``
call (``attention.fused_attention``: cuDNN's on an NVIDIA GPU), here through the call's XLA
implementation, which takes the same mask and the same layouts on any backend. Causal, rows padded
on the left and the right, GQA heads, float32 and bfloat16; then the whole model with the fused
path where a GPU would take it, and which calls the GPU path takes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rounding import U, attention_atol, chain_terms, grad_rtol

from jaxrl.nn import attention, model

B, K, REP, E = 3, 2, 3, 8  # GQA: 2 kv heads, 3 query heads each
T = 12  # even, as cuDNN needs it with a mask
UB = 2.0**-8  # bfloat16's unit roundoff (8 significand bits)
# Row 0 all valid; row 1 left-padded by 4 (a prompt); row 2 by 3 on the left and 2 on the right
# (a response that stopped early): its last queries see valid slots before them only.
VALID_BxT = (np.arange(T)[None] >= np.array([0, 4, 3])[:, None]) & (
  np.arange(T)[None] < np.array([T, T, T - 2])[:, None]
)


def _qkv(dtype):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, K, REP, E)), dtype)
  k = jnp.asarray(rng.normal(size=(B, K, E, T)), dtype)  # keys [.., E, S], as the model keeps them
  v = jnp.asarray(rng.normal(size=(B, K, T, E)), dtype)
  return q, k, v


def _sees_a_slot_BxT():
  """Queries with at least one valid slot at or before their own: the rows anything reads. A
  query that sees none (a left pad) gets an arbitrary finite mix on either path."""
  return np.cumsum(VALID_BxT, axis=1) > 0


def _atol(q, k, v) -> float:
  """How far the two paths may lie apart. Both compute the scores as float32 sums of exact
  products (bf16 products are exact in float32), softmax in float32, and the mix as a float32
  sum: ``attention_atol`` (tests/rounding.py) bounds two such evaluations in units of u = 2⁻²⁴.
  In bfloat16 each side also rounds the probabilities (Σ_s |δp_s·v_s| ≤ u_bf16·max|v|, as
  Σ p_s = 1) and its output (u_bf16·max|v|) to bfloat16: 2 roundings per side, 2 sides."""
  f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
  bound = attention_atol(*f32)
  if q.dtype == jnp.bfloat16:
    bound += 2 * 2 * UB * float(jnp.max(jnp.abs(f32[2])))
  return bound


# Three blocks of 4 queries, or one pass. Not bf16 in one pass here: XLA CPU has no kernel for a
# batched bf16 x bf16 -> f32 dot standing alone in a program (UNIMPLEMENTED when it runs); in the
# model, and in the blocks' loop, it is fused with what feeds it and runs.
@pytest.mark.parametrize(
  "dtype,block",
  [(jnp.float32, 4), (jnp.float32, T), (jnp.bfloat16, 4)],
  ids=["f32-4", "f32-T", "bf16-4"],
)
def test_blocked_equals_dot_product_attention(dtype, block):
  q, k, v = _qkv(dtype)
  valid = jnp.asarray(VALID_BxT)
  # jitted, as the model runs them (XLA CPU's eager dispatch has no bf16 x bf16 = f32 batched dot)
  blocked = jax.jit(attention.attention, static_argnums=(4, 5))(q, k, v, valid, 0, block)
  fused = jax.jit(attention.fused_attention, static_argnums=4)(q, k, v, valid, "xla")
  assert fused.shape == blocked.shape == (B, T, K, REP, E) and fused.dtype == dtype
  seen = _sees_a_slot_BxT()
  got, want = (np.asarray(x, np.float32)[seen] for x in (fused, blocked))
  np.testing.assert_allclose(got, want, rtol=0, atol=_atol(q, k, v))
  assert np.isfinite(np.asarray(fused, np.float32)).all()


def test_gpu_path_choice(monkeypatch):
  """Which calls take cuDNN on an NVIDIA GPU: bf16/fp16 queries from slot 0 over their own T
  (even) slots, head dim a multiple of 8 up to 128. Never on this CPU."""
  q, k, _ = _qkv(jnp.bfloat16)
  assert attention.fused_implementation(q, k, 0) is None  # this backend has no cuDNN
  monkeypatch.setattr(attention, "_on_cuda", lambda: True)

  def choice(q_shape=(B, T, K, REP, E), s=T, start=0, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    return attention.fused_implementation(q, jax.ShapeDtypeStruct((B, K, E, s), dtype), start)

  assert choice() == "cudnn"
  assert choice(dtype=jnp.float16) == "cudnn"
  assert choice(dtype=jnp.float32) is None  # cuDNN's fused attention has no float32
  assert choice(start=3, s=T + 3) is None  # queries after a cache: its causal mask is from 0
  assert choice(start=jnp.int32(0)) is None  # a traced start is never assumed to be 0
  assert choice((B, 1, K, REP, E), s=1) is None  # a decode step
  assert choice((B, T - 1, K, REP, E), s=T - 1) is None  # odd T with a mask
  assert choice((B, T, K, REP, 12)) is None  # head dim not a multiple of 8
  assert choice((B, T, K, REP, 256)) is None  # above 128: only some GPUs take it


CFG = model.ModelConfig(
  vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
  num_kv_heads=2, head_dim=8,
)  # fmt: skip


def _model_outputs(graphdef, params, tokens, mask):
  """Logits [B, T, V] and the gradient of a loss over them, freshly traced (the choice of path
  is made when tracing)."""

  def logits_fn(params):
    hidden, head, _ = model.forward(graphdef, params, tokens, model.positions_from_mask(mask), mask)
    return jnp.einsum("btd,vd->btv", hidden, head)

  def loss(params):
    logits = logits_fn(params)
    return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0))

  return jax.jit(logits_fn)(params), jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize("scan", [False, True])
def test_model_with_the_fused_path_equals_blocked(monkeypatch, scan):
  """The decoder where a GPU would run the fused call (float32 admitted, XLA's implementation)
  against the blocked path: logits within two float32 forwards' rounding, gradients within two
  backwards'. Both layouts and remat, as the configs run them."""
  cfg = dataclasses.replace(CFG, scan_layers=scan, remat="full" if scan else "none")
  graphdef, params = model.create(cfg, 0)
  rng = np.random.default_rng(1)
  mask = jnp.asarray(VALID_BxT)
  tokens = jnp.asarray(np.where(VALID_BxT, rng.integers(1, cfg.vocab_size, (B, T)), 0))
  logits_blocked, grads_blocked = _model_outputs(graphdef, params, tokens, mask)

  calls = []
  real_choice, real_fused = attention.fused_implementation, attention.fused_attention

  def as_on_a_gpu(q, k, start):
    bf16 = jax.ShapeDtypeStruct(q.shape, jnp.bfloat16)  # cuDNN's dtypes aside, the GPU's choice
    return "xla" if real_choice(bf16, k, start) else None

  def counted(*args):
    calls.append(args[0].shape)
    return real_fused(*args)

  monkeypatch.setattr(attention, "_on_cuda", lambda: True)
  monkeypatch.setattr(attention, "fused_implementation", as_on_a_gpu)
  monkeypatch.setattr(attention, "fused_attention", counted)
  logits_fused, grads_fused = _model_outputs(graphdef, params, tokens, mask)
  assert calls, "the fused path was not taken"

  seen = _sees_a_slot_BxT()
  ref = np.asarray(logits_blocked)[seen]
  atol = 2 * chain_terms(cfg, T) * U * float(np.max(np.abs(ref)))
  np.testing.assert_allclose(np.asarray(logits_fused)[seen], ref, rtol=0, atol=atol)
  rtol = grad_rtol(cfg, T, B * T)
  for got, want in zip(jax.tree.leaves(grads_fused), jax.tree.leaves(grads_blocked), strict=True):
    scale = float(np.max(np.abs(np.asarray(want))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=rtol * scale)
