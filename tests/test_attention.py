"""Blockwise attention (attention.attention) against the one-pass softmax (attention._attend).

Blocks of queries attend to every slot with the full softmax, so values and gradients equal the
one-pass ones up to float32 rounding, for left padding, cache offsets (queries at slots start..),
GQA, and T not a multiple of the block. The model computes the same with any ``attention_block``,
in training (forward, log-probs, loss gradients) and in the sampler (cached prefill + decode);
and XLA's memory for the blocked backward really shrinks. Against transformers: test_hf_parity.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import output_shapes
from rounding import U, attention_atol, chain_terms, entropy_atol, grad_rtol, logp_atol

from jaxrl.nn import attention, model
from jaxrl.rl import losses, scoring
from jaxrl.rollout import sampler

B, K, REP, E = 3, 2, 3, 8  # GQA: 2 kv heads, 3 query heads each
_rng = np.random.default_rng(0)


def _qkv(t, s, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, t, K, REP, E)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, K, E, s)), jnp.float32)  # keys [.., E, S], as the model
  v = jnp.asarray(rng.normal(size=(B, K, s, E)), jnp.float32)
  # Left padding of 0, 4 and 9 slots: row 2's first queries see no valid slot at all.
  valid = jnp.asarray(np.arange(s)[None] >= np.array([0, 4, 9])[:, None])
  return q, k, v, valid


@pytest.mark.parametrize("start", [0, 7])  # 0: training (S = T); 7: queries after a cache
@pytest.mark.parametrize("block", [1, 4, 5, 13])
def test_blocks_equal_one_pass(block, start):
  t = 13
  q, k, v, valid = _qkv(t, start + t)
  one_pass = attention._attend(q, k, v, valid, start)
  blocked = attention.attention(q, k, v, valid, start, block)
  assert blocked.shape == one_pass.shape == (B, t, K, REP, E)
  # Same einsums on slices: only the matmuls' summation order may differ (XLA's CPU kernels block
  # [Z, S] and [T, S] products differently, and differently on AVX2, AVX-512 and AMX machines).
  np.testing.assert_allclose(
    np.asarray(blocked), np.asarray(one_pass), rtol=0, atol=attention_atol(q, k, v)
  )
  assert np.isfinite(np.asarray(blocked)).all()


def test_blocks_give_the_same_gradients():
  q, k, v, valid = _qkv(13, 16)

  def grads(block):
    def loss(q, k, v):
      return jnp.sum(jnp.sin(attention.attention(q, k, v, valid, 3, block)))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  # The backward adds to the forward's sums (E + 2 for the scores, 2S + 4 for the softmax and
  # the mix, as in ``attention_atol``) the transposed ones: E for dP = g·Vᵀ, S for the softmax's
  # Σ_s p·dP, and S or T for dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·g; each side within that many u of
  # the values' scale (inputs and gradients are O(1) here: at least 1), the two within twice it.
  e, s, t = q.shape[-1], k.shape[-1], q.shape[1]
  terms = (e + 2) + (2 * s + 4) + e + s + max(s, t)
  for blocked, one_pass in zip(grads(4), grads(64)):
    scale = float(jnp.max(jnp.abs(one_pass)))
    np.testing.assert_allclose(
      np.asarray(blocked), np.asarray(one_pass), rtol=0, atol=2 * terms * U * max(scale, 1.0)
    )


def test_blocked_backward_needs_less_memory():
  """XLA's temp for value-and-grad at T = 1024: blocks of 128 keep [B, H, 128, T] scores live,
  the one pass [B, H, T, T] scores, probs and their gradients (measured on CPU: 37 MiB against
  289 MiB, where one scores buffer is 72 MiB)."""
  q, k, v, valid = _qkv(1024, 1024)

  def temp(block):
    def loss(q, k, v):
      return jnp.sum(attention.attention(q, k, v, valid, 0, block))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

  scores = B * K * REP * 1024 * 1024 * 4  # one f32 [B, H, T, T] buffer
  blocked, one_pass = temp(128), temp(1024)
  assert one_pass >= 2 * scores
  assert blocked <= one_pass / 4 and blocked < scores


def test_blocks_are_balanced():
  """T = 9 in blocks of at most 4: three blocks of 3 queries (no padded query), not 4 + 4 + 4."""
  q, k, v, valid = _qkv(9, 9)
  jaxpr = jax.make_jaxpr(lambda q: attention.attention(q, k, v, valid, 0, 4))(q).jaxpr
  # the scores [b, k, a, t, s] (dims in dot_general's order): S = 9 slots, 3 queries per block
  score_shapes = [sorted(s) for s in output_shapes(jaxpr, "dot_general") if 9 in s]
  assert score_shapes and all(s == sorted((B, K, REP, 3, 9)) for s in score_shapes), score_shapes


# A small Qwen2-like model (q/k/v biases, GQA) in both layouts; prompts P = 5 and responses N = 6
# are longer than the blocks of 2, so training, prefill and decode all cross block boundaries.
BASE = model.ModelConfig(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  rope_theta=1e6,
  tie_embeddings=False,
)
R, P, N = 4, 5, 6
PROMPT_IDS = _rng.integers(1, 64, (R, P)).astype(np.int32)
PROMPT_MASK = np.arange(P)[None] >= np.array([0, 2, 4, 1])[:, None]
RESPONSE_IDS = _rng.integers(1, 64, (R, N)).astype(np.int32)
RESPONSE_MASK = np.arange(N)[None] < np.array([6, 3, 1, 5])[:, None]


def _logits(graphdef, params, slots=P + N, rows=None, tokens=None):
  """The training forward's logits over the prompts ++ ``tokens`` (the fixed responses by
  default), at the valid positions: their scale enters the bounds."""
  rows = np.arange(R) if rows is None else rows
  tokens = RESPONSE_IDS if tokens is None else np.asarray(tokens)
  ids = np.concatenate([PROMPT_IDS[rows], tokens], 1)[:, :slots]
  mask = np.concatenate([PROMPT_MASK[rows], np.ones_like(tokens, bool)], 1)[:, :slots]
  hidden, lm_head, _ = model.forward(graphdef, params, ids, model.positions_from_mask(mask), mask)
  return np.asarray(hidden @ lm_head.T)[mask]


def _models(scan: bool):
  one_pass = dataclasses.replace(BASE, scan_layers=scan, remat="full" if scan else "none")
  blocked = dataclasses.replace(one_pass, attention_block=2)
  graphdef, params = model.create(one_pass, 0)
  rng = np.random.default_rng(1)  # biases and norms off 0 and 1
  params = jax.tree.map(lambda x: x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype), params)
  return (one_pass, graphdef), (blocked, model.create(blocked, 0)[0]), params


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan-remat"])
def test_model_loss_and_grads_equal_with_blocks(scan):
  (_, graphdef), (_, blocked_graphdef), params = _models(scan)
  denom = jnp.float32(RESPONSE_MASK.sum())
  hp = losses.LossHparams.create(eps_low=0.2, eps_high=0.28, kl_coef=0.0, entropy_coef=0.01)
  cfg = losses.LossConfig(aggregation="token-mean", informative_only=False)
  old_logp = jnp.asarray(-_rng.random((R, N)), jnp.float32)
  adv = jnp.asarray([1.0, -1.0, 0.5, -0.5], jnp.float32)

  def loss(params, gd):
    logp, ent = scoring.logp_responses(
      gd, params, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, jnp.float32(0.9), 4
    )
    value, _ = losses.grpo_loss(
      logp, old_logp, adv, RESPONSE_MASK, ent, None, jnp.ones((R,), bool), denom, hp, cfg
    )
    return value, logp

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (l1, logp1), g1 = grad_fn(params, graphdef)
  (l2, logp2), g2 = grad_fn(params, blocked_graphdef)
  # Blocks change the order of the attention's sums and so, through the rounding of what they
  # pass on, every later value: the bounds of a whole forward and backward (tests/rounding.py).
  slots, cfg = P + N, BASE
  z_scale = float(np.max(np.abs(_logits(graphdef, params)))) / 0.9
  np.testing.assert_allclose(
    np.asarray(logp2), np.asarray(logp1), rtol=0, atol=logp_atol(cfg, slots, z_scale)
  )
  # The loss: per-token terms of scale ~1 (ratios, advantages, λ·entropy), so the gradient's bound.
  rtol = grad_rtol(cfg, slots, R * slots)
  np.testing.assert_allclose(float(l2), float(l1), rtol=rtol, atol=rtol)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1), strict=True):
    scale = float(jnp.max(jnp.abs(b)))
    assert scale > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan-remat"])
def test_sampler_equal_with_blocks(scan):
  """Prefill (P = 5 queries into the cache, in blocks of 2) and 1-token decode steps."""
  (cfg, graphdef), (blocked_cfg, blocked_graphdef), params = _models(scan)
  counts = np.array([2, 1, 3, 2])
  outs = [
    sampler.generate(
      gd,
      params,
      PROMPT_IDS,
      PROMPT_MASK,
      counts,
      jax.random.key(3),
      1.0,
      0.95,
      num_rollouts=8,
      max_new_tokens=7,
      eos_id=1,
      pad_id=0,
      model_cfg=c,
    )
    for gd, c in ((graphdef, cfg), (blocked_graphdef, blocked_cfg))
  ]
  one_pass, blocked = outs
  np.testing.assert_array_equal(np.asarray(blocked.tokens_RxN), np.asarray(one_pass.tokens_RxN))
  assert len(np.unique(np.asarray(one_pass.tokens_RxN))) > 5  # real samples
  # Bounds of two forwards summing in other orders (tests/rounding.py), over P + 7 slots, at the
  # scale of the sampled sequences' logits (τ = 1).
  slots = P + 7
  z = _logits(graphdef, params, slots, np.repeat(np.arange(R), counts), one_pass.tokens_RxN)
  z_scale = float(np.max(np.abs(z)))
  for name, atol in (
    ("behaviour_logp_RxN", logp_atol(cfg, slots, z_scale)),
    ("entropy_RxN", entropy_atol(cfg, slots, z_scale)),
  ):
    np.testing.assert_allclose(
      np.asarray(getattr(blocked, name)), np.asarray(getattr(one_pass, name)), rtol=0, atol=atol
    )


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan-remat"])
def test_prefill_attends_to_the_prompt_slots_only(scan):
  """A prefill from slot 0 writes P tokens into a cache of S = P + N slots: a query at slot i < P
  sees slots <= i only, so its scores span the P slots, not S; the hidden states are those of the
  no-cache forward (under remat too, where ``start`` must stay static)."""
  (cfg, graphdef), _, params = _models(scan)
  slots = P + 17  # no other dimension of the model is 22
  positions = model.positions_from_mask(jnp.asarray(PROMPT_MASK))
  valid = jnp.concatenate([jnp.asarray(PROMPT_MASK), jnp.zeros((R, slots - P), bool)], axis=1)

  def prefill(params):
    cache = model.init_cache(cfg, R, slots, jnp.float32)
    hidden, _, cache = model.forward(graphdef, params, PROMPT_IDS, positions, valid, cache, 0)
    return hidden, cache

  dots = output_shapes(jax.make_jaxpr(prefill)(params).jaxpr, "dot_general")
  assert any(shape[-1] == P for shape in dots)  # scores [.., P, P]
  assert not any(slots in shape for shape in dots), dots  # never [.., P, S]
  hidden, cache = jax.jit(prefill)(params)
  no_cache, _, _ = model.forward(graphdef, params, PROMPT_IDS, positions, jnp.asarray(PROMPT_MASK))
  # The same sums in two programs (jitted with a cache, eager without), which XLA may block and
  # fuse differently: two forwards within the final norm's output, less the head's D terms.
  scale = float(np.max(np.abs(np.asarray(no_cache))))
  atol = 2 * (chain_terms(cfg, P) - cfg.hidden_size) * U * scale
  np.testing.assert_allclose(np.asarray(hidden), np.asarray(no_cache), rtol=0, atol=atol)
  assert np.asarray(cache.k)[..., :P].any()  # the prompt's keys are in the cache (keys [.., E, S])
  assert not np.asarray(cache.k)[..., P:].any()  # and nothing past them


def test_block_size_must_be_positive():
  with pytest.raises(ValueError, match="attention_block"):
    dataclasses.replace(BASE, attention_block=0)


@pytest.mark.parametrize("concat_halves", [True, False])
def test_rope_forms_are_hfs_rotation(concat_halves):
  """Both layouts of ``rope`` rotate (x1, x2) by HF's angles: against a float64 rotate-half, at
  positions up to 40k (large angles), values and gradients; and the two agree to the rounding of
  their products."""
  rng = np.random.default_rng(3)
  b, t, h, e = 2, 5, 3, 16
  x = rng.normal(size=(b, t, h, e)).astype(np.float32)
  positions = rng.integers(0, 40_000, size=(b, t)).astype(np.int32)
  inv_freq = (1.0 / (10_000.0 ** (np.arange(e // 2) / (e // 2)))).astype(np.float32)
  angles = positions[..., None, None].astype(np.float32) * inv_freq  # float32, as the model
  cos, sin = np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))
  x1, x2 = x[..., : e // 2].astype(np.float64), x[..., e // 2 :].astype(np.float64)
  expected = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  rot = jax.jit(lambda x: attention.rope(x, positions, inv_freq, concat_halves=concat_halves))
  # Elementwise, no sums: an output x1·c − x2·s (or x2·c + x1·s) takes c and s within 2u
  # absolute (XLA's float32 cos and sin, the same code on every CPU, are within 0.55u of float64's
  # at these float32 angles), two products and a difference (or FMAs) within u·(|x1| + |x2|) each:
  # within 4u·(|x1| + |x2|) of the float64 value.
  atol = 4 * U * float(np.max(np.abs(x1) + np.abs(x2)))
  np.testing.assert_allclose(np.asarray(rot(jnp.asarray(x))), expected, rtol=0, atol=atol)
  # The rotation is orthogonal: the gradient of <rope(x), w> is rope's transpose applied to w.
  w = rng.normal(size=x.shape).astype(np.float32)
  w1, w2 = w[..., : e // 2].astype(np.float64), w[..., e // 2 :].astype(np.float64)
  expected_grad = np.concatenate([w1 * cos + w2 * sin, w2 * cos - w1 * sin], axis=-1)
  grad = jax.grad(lambda x: jnp.sum(rot(x) * w))(jnp.asarray(x))
  atol = 4 * U * float(np.max(np.abs(w1) + np.abs(w2)))
  np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=0, atol=atol)
  # The two forms take the same c and s and differ only in how the products and the difference
  # round (FMA contraction): each within 2u·(|x1·c| + |x2·s|) of exact, the two within twice it.
  other = attention.rope(jnp.asarray(x), positions, inv_freq, concat_halves=not concat_halves)
  atol = 4 * U * float(np.max(np.abs(x1 * cos) + np.abs(x2 * sin)))
  np.testing.assert_allclose(np.asarray(rot(jnp.asarray(x))), np.asarray(other), rtol=0, atol=atol)
