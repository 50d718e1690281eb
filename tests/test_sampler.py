"""The embedded JAX sampler (jaxrl.rollout.sampler) against independent oracles.

Oracles: the training forward without a cache (π_old must equal what the trainer computes),
Python loops over rows (EOS handling, group expansion), the exact softmax(z/τ) (chi-square on
many one-token samples), and transformers' own greedy ``generate`` on a tiny Qwen2 checkpoint.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jaxpr_helpers import output_shapes  # noqa: E402
from rounding import U, chain_terms, entropy_atol, logp_atol  # noqa: E402
from sampler_fixtures import (  # noqa: E402
  CFG,
  EOS,
  PAD,
  full_logits,
  left_pad,
  teacher_forced_logits,
)

from jaxrl.nn import model  # noqa: E402
from jaxrl.rollout import draws, sampler  # noqa: E402
from jaxrl.rollout.prefill import _prefill  # noqa: E402
from jaxrl.run.compiles import CompileCounter  # noqa: E402

# Three prompts of different lengths (7, 3, 5), left-padded to P = 7.
PROMPTS = [[5, 9, 12, 3, 7, 11, 4], [7, 3, 10], [14, 8, 8, 6, 2]]
P, N = 7, 10


@pytest.fixture(scope="module")
def tiny():
  graphdef, params = model.create(CFG, seed=0)
  return graphdef, params


def _gen(
  tiny,
  counts,
  key=0,
  tau=1.0,
  top_p=1.0,
  *,
  cfg=CFG,
  prompts=PROMPTS,
  p=P,
  n=N,
  eos=EOS,
  greedy=False,
):
  graphdef, params = tiny
  ids, mask = left_pad(prompts, p)
  return sampler.generate(
    graphdef,
    params,
    ids,
    mask,
    np.asarray(counts),
    jax.random.key(key),
    tau,
    top_p,
    num_rollouts=int(np.sum(counts)),
    max_new_tokens=n,
    eos_id=eos,
    pad_id=PAD,
    model_cfg=cfg,
    greedy=greedy,
  )


def _np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("tau", [0.7, 1.3])
def test_logp_and_entropy_equal_training_forward(tiny, tau):
  out = _gen(tiny, [2, 1, 3], key=1, tau=tau)  # a key whose draws stop some rows early at both τ
  logp_ref = _np_log_softmax(teacher_forced_logits(tiny, out) / tau)
  tokens = np.asarray(out.tokens_RxN)
  mask = np.asarray(out.mask_RxN)
  want_logp = np.take_along_axis(logp_ref, tokens[..., None], -1)[..., 0]
  want_entropy = -(np.exp(logp_ref) * logp_ref).sum(-1)
  # Two float32 forwards (the cached decode, the training forward) of the same sums in other
  # orders, over P + N slots; the reference's log-softmax runs in float64 (tests/rounding.py).
  z_scale = float(np.max(np.abs(teacher_forced_logits(tiny, out)[mask]))) / tau
  np.testing.assert_allclose(
    np.asarray(out.behaviour_logp_RxN)[mask],
    want_logp[mask],
    atol=logp_atol(CFG, P + N, z_scale),
    rtol=0,
  )
  np.testing.assert_allclose(
    np.asarray(out.entropy_RxN)[mask],
    want_entropy[mask],
    atol=entropy_atol(CFG, P + N, z_scale),
    rtol=0,
  )
  assert np.all(np.asarray(out.behaviour_logp_RxN)[~mask] == 0)
  assert np.all(np.asarray(out.entropy_RxN)[~mask] == 0)
  assert mask.sum() > 40 and not mask.all()  # early-stopped rows are in the batch too


def test_decode_segments_equal_one_loop(tiny, monkeypatch):
  """Past 64 tokens the decode loop runs in segments whose steps read only the cache slots their
  tokens can reach; the samples, log-probs and entropies are those of one loop over every slot,
  and the log-probs those of the training forward."""
  assert sampler.segment_ends(10) == [10]
  assert sampler.segment_ends(70) == [64, 70]
  assert sampler.segment_ends(2048) == [64, 256, 1024, 2048]
  n = 70
  graphdef, params = tiny
  jaxpr = jax.make_jaxpr(lambda p: _gen((graphdef, p), [2, 1, 3], key=3, n=n, eos=CFG.vocab_size))(
    params
  ).jaxpr
  score_widths = {shape[-1] for shape in output_shapes(jaxpr, "reduce_sum") if len(shape) == 4}
  assert {P + 64, P + n} <= score_widths, score_widths  # each segment's steps: [B, K, A, S_seg]
  segmented = _gen(tiny, [2, 1, 3], key=3, n=n, eos=CFG.vocab_size)  # no stop: all 70 steps run
  monkeypatch.setattr(sampler, "_FIRST_SEGMENT", 1 << 20)
  jax.clear_caches()  # the constant is read at trace time
  one_loop = _gen(tiny, [2, 1, 3], key=3, n=n, eos=CFG.vocab_size)
  np.testing.assert_array_equal(segmented.tokens_RxN, one_loop.tokens_RxN)
  # float32: the softmax sums over fewer (masked, exactly 0) slots in another order, and the
  # rounding of that passes on: two forwards over P + n slots (tests/rounding.py).
  logits = teacher_forced_logits(tiny, segmented)
  z_scale = float(np.max(np.abs(logits)))
  for got, want, atol in [
    (segmented.behaviour_logp_RxN, one_loop.behaviour_logp_RxN, logp_atol(CFG, P + n, z_scale)),
    (segmented.entropy_RxN, one_loop.entropy_RxN, entropy_atol(CFG, P + n, z_scale)),
  ]:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=atol)
  logp_ref = _np_log_softmax(logits)
  want_logp = np.take_along_axis(logp_ref, np.asarray(segmented.tokens_RxN)[..., None], -1)[..., 0]
  np.testing.assert_allclose(
    segmented.behaviour_logp_RxN, want_logp, rtol=0, atol=logp_atol(CFG, P + n, z_scale)
  )


def test_per_row_eos_stop(tiny):
  finished = []
  for key in range(4):  # same shapes: one compilation for all four batches
    out = _gen(tiny, [2, 2, 2], key=20 + key, tau=1.5)
    tokens, mask = np.asarray(out.tokens_RxN), np.asarray(out.mask_RxN)
    for r in range(tokens.shape[0]):
      hits = np.flatnonzero(tokens[r] == EOS)
      length = hits[0] + 1 if len(hits) else N
      assert out.lengths_R[r] == length
      assert mask[r, :length].all() and not mask[r, length:].any()
      assert np.all(tokens[r, length:] == PAD)
      assert out.finished_R[r] == bool(len(hits))
      finished.append(bool(len(hits)))
  assert 0 < sum(finished) < len(finished)  # both kinds of rows are exercised

  # Every row stops at step 0 (EOS := greedy first token): the loop exits at once, layout intact.
  first = int(_gen(tiny, [2, 2, 2], greedy=True).tokens_RxN[0, 0])
  out = _gen(tiny, [6, 0, 0], eos=first, greedy=True)
  np.testing.assert_array_equal(out.lengths_R, [1] * 6)
  assert np.all(np.asarray(out.tokens_RxN)[:, 1:] == PAD) and np.all(out.finished_R)


def test_no_recompilation_when_counts_temperature_or_top_p_change(tiny):
  # Traces of the jitted sampler (sampler.sample_program), from JAX's public monitoring events.
  # n = N - 1 is a length no other test samples: the first call of each mode must trace, which
  # shows the counter sees the sampler's traces; the value-only changes after it must not.
  n = N - 1
  counter = CompileCounter(compiles=sampler.sample_program.__name__).start()
  try:
    for traced, greedy in enumerate((False, True), start=1):
      _gen(tiny, [2, 1, 3], n=n, greedy=greedy)
      # 0 here: the counter misses sample_program (renamed?) or another test sampled this length.
      assert counter.counts()["compiles"] == traced, counter.counts()
      _gen(tiny, [1, 4, 1], key=5, tau=0.6, top_p=0.9, n=n, greedy=greedy)
      _gen(tiny, [0, 0, 6], key=6, tau=np.float32(1.4), top_p=jnp.float32(1.0), n=n, greedy=greedy)
      _gen(tiny, np.array([3, 3, 0], np.int64), tau=jnp.array(2.0), top_p=0.5, n=n, greedy=greedy)
      assert counter.counts()["compiles"] == traced, counter.counts()  # values only: no retrace
  finally:
    counter.stop()


def test_rows_follow_each_questions_own_count(tiny):
  counts = [0, 4, 2]
  out = _gen(tiny, counts, tau=0.9)
  ids, mask = left_pad(PROMPTS, P)
  want_groups = [i for i, c in enumerate(counts) for _ in range(c)]
  np.testing.assert_array_equal(out.group_ids_R, want_groups)
  np.testing.assert_array_equal(out.prompt_ids_RxP, ids[want_groups])
  np.testing.assert_array_equal(out.prompt_mask_RxP, mask[want_groups])
  with pytest.raises(ValueError, match="num_rollouts"):
    graphdef, params = tiny
    sampler.generate(
      graphdef,
      params,
      ids,
      mask,
      np.asarray(counts),
      jax.random.key(0),
      1.0,
      1.0,
      num_rollouts=7,
      max_new_tokens=N,
      eos_id=EOS,
      pad_id=PAD,
      model_cfg=CFG,
    )


@pytest.mark.parametrize("scan", [False, True])
def test_each_prompt_is_prefilled_once(scan):
  """The prefill runs the B distinct prompts, not the R = Σ G_i rows, and copies each prompt's
  cache and first logits to its rows (counts of 0 included): bit for bit the rows of a B-prompt
  forward, and the values of a prefill of the R rows up to the rounding of reordered sums."""
  cfg = dataclasses.replace(CFG, scan_layers=scan)
  graphdef, params = model.create(cfg, seed=0)
  ids, mask = left_pad(PROMPTS, P)
  counts = np.array([0, 4, 2], np.int32)
  rows = [i for i, c in enumerate(counts) for _ in range(c)]
  R = len(rows)

  def prefill(params):
    cache, logits = _prefill(graphdef, params, ids, mask, counts, rows=R, model_cfg=cfg)
    return cache.pad_slots(P + N), logits  # as the decode grows it

  dots = output_shapes(jax.make_jaxpr(prefill)(params).jaxpr, "dot_general")
  assert any(shape[0] == len(PROMPTS) * P for shape in dots)  # projections over B·P tokens
  assert not any(shape[0] == R * P for shape in dots), dots  # never over R·P
  cache, logits = jax.jit(prefill)(params)

  def forward(ids, mask, slots):
    """The model's forward with an empty cache of ``slots`` slots: (cache, last-slot logits)."""
    valid = jnp.concatenate([mask, jnp.zeros((len(ids), slots - P), bool)], axis=1)
    empty = model.init_cache(cfg, len(ids), slots, jnp.float32)
    hidden, lm_head, filled = model.forward(
      graphdef, params, ids, model.positions_from_mask(mask), valid, empty, 0
    )
    return filled, hidden[:, -1] @ lm_head.T

  # The copy is exact: the same program shapes as inside the prefill, each prompt's row repeated.
  per_prompt, per_prompt_logits = jax.jit(forward, static_argnums=2)(ids, mask, P + N)
  for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(per_prompt)):
    np.testing.assert_array_equal(np.asarray(got), np.take(want, rows, axis=want.ndim - 4))
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(per_prompt_logits)[rows])

  # A prefill of the R rows computes the same sums over matrices of other shapes, which XLA's CPU
  # kernels may block (and so add up) in another order. A dot of n float32 terms rounds to within
  # n·u·Σ|a·b| whatever the order (u = 2⁻²⁴; Higham, Accuracy and Stability, §3.1); the largest
  # sums here have n = intermediate_size terms, and each of the L layers adds its own rounding to
  # the values it passes on, so the rows agree to L·n·u times the values' scale.
  u = float(np.finfo(np.float32).eps) / 2
  bound = cfg.num_layers * max(cfg.hidden_size, cfg.intermediate_size) * u
  ref_cache, ref_logits = forward(ids[rows], mask[rows], P + N)
  for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
    assert got.shape == want.shape
    scale = float(np.max(np.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=bound * scale)
  # The logits add one more sum of hidden_size terms (the head) to the hidden state's rounding.
  scale = float(np.max(np.abs(ref_logits)))
  logits_bound = (bound + cfg.hidden_size * u) * scale
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=0, atol=logits_bound)


def test_same_key_same_samples(tiny):
  a = _gen(tiny, [2, 1, 3], key=7, tau=1.1, top_p=0.95)
  b = _gen(tiny, [2, 1, 3], key=7, tau=1.1, top_p=0.95)
  c = _gen(tiny, [2, 1, 3], key=8, tau=1.1, top_p=0.95)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a.tokens_RxN, c.tokens_RxN)


def _assert_argmax_is_decided(logits, mask, gap):
  """Greedy choices of two programs agree on every CPU only if, at each step, the top logit leads
  the next by more than twice the programs' logits ``gap`` (each logit may move by it)."""
  top2 = np.sort(np.asarray(logits, np.float64), axis=-1)[..., -2:][np.asarray(mask, bool)]
  lead = float(np.min(top2[:, 1] - top2[:, 0]))
  assert lead > 2 * gap, (lead, gap)


def test_tiny_top_p_is_greedy(tiny):
  nucleus = _gen(tiny, [2, 1, 3], key=9, tau=1.0, top_p=1e-6)
  greedy = _gen(tiny, [2, 1, 3], tau=1.0, greedy=True)
  # Two sampler programs (their forwards may sum in other orders): each choice must be decided.
  logits = teacher_forced_logits(tiny, greedy)
  gap = 2 * chain_terms(CFG, P + N) * U * float(np.max(np.abs(logits)))
  _assert_argmax_is_decided(logits, greedy.mask_RxN, gap)
  np.testing.assert_array_equal(nucleus.tokens_RxN, greedy.tokens_RxN)
  np.testing.assert_array_equal(nucleus.mask_RxN, greedy.mask_RxN)
  # ℓ_μ is that of the one-token nucleus sampled from (0); ℓ, the trainer's ℓ_prox, that of the
  # full softmax(z/τ).
  on = np.asarray(nucleus.mask_RxN)
  np.testing.assert_allclose(np.asarray(nucleus.behaviour_logp_RxN)[on], 0.0, rtol=0, atol=1e-6)
  assert np.all(np.asarray(nucleus.prox_logp_RxN)[on] < -0.1)


def _nucleus(z_V, top_p):
  """Float64 oracle: the top-p nucleus of softmax(z) (token ids) and each token's exclusive mass
  in the order of decreasing probability."""
  probs = np.exp(_np_log_softmax(z_V))
  order = np.argsort(-probs)
  mass_before = np.cumsum(probs[order]) - probs[order]
  return order[mass_before < top_p], mass_before


# Keys whose ~50 draws all leave every exclusive mass farther from top_p than the rounding (the
# test asserts it; most keys have one within it among so many positions).
@pytest.mark.parametrize("tau, top_p, key", [(0.8, 0.7, 1), (1.2, 0.8, 1)])
def test_behaviour_logp_is_the_truncated_renormalised_softmax(tiny, tau, top_p, key):
  """docs/algorithms.md §9.1: with top_p < 1, ℓ_μ is log softmax over the nucleus of z/τ,
  renormalised, at the sampled token (what vLLM's processed log-probs are); ℓ (``prox_logp_RxN``)
  is that of the full softmax(z/τ), the trainer's ℓ_prox for an on-policy batch."""
  out = _gen(tiny, [2, 1, 3], key=key, tau=tau, top_p=top_p)
  logits = teacher_forced_logits(tiny, out)
  tokens, mask = np.asarray(out.tokens_RxN), np.asarray(out.mask_RxN)
  z_scale = float(np.max(np.abs(logits[mask]))) / tau
  # Whether a token is in the nucleus must not hang on rounding (as in the one-step test: two
  # forwards' logits, then the sampler's own sums).
  mass_error = 2 * (2 * chain_terms(CFG, P + N) * U * z_scale) + (2 * CFG.vocab_size + 6) * U
  want_mu, want_full = np.zeros(mask.shape), np.zeros(mask.shape)
  for r, n in zip(*np.nonzero(mask)):
    z_V = logits[r, n] / tau
    inside, mass_before = _nucleus(z_V, top_p)
    _assert_nucleus_is_decided(mass_before, top_p, mass_error)
    assert tokens[r, n] in inside, (r, n)
    kept = z_V[inside]
    want_mu[r, n] = z_V[tokens[r, n]] - (kept.max() + np.log(np.exp(kept - kept.max()).sum()))
    want_full[r, n] = _np_log_softmax(z_V)[tokens[r, n]]
  # ℓ as in ``test_logp_and_entropy_equal_training_forward``; ℓ_μ = ℓ − log(nucleus mass), the
  # mass's log a difference of two log-sum-exps over the same logits: a log-prob's rounding again.
  atol = logp_atol(CFG, P + N, z_scale)
  np.testing.assert_allclose(
    np.asarray(out.prox_logp_RxN)[mask], want_full[mask], atol=atol, rtol=0
  )
  got_mu = np.asarray(out.behaviour_logp_RxN)
  np.testing.assert_allclose(got_mu[mask], want_mu[mask], atol=2 * atol, rtol=0)
  assert np.all(got_mu[~mask] == 0) and np.all(np.asarray(out.prox_logp_RxN)[~mask] == 0)
  assert np.max(want_mu[mask] - want_full[mask]) > 0.05  # the truncation is there to see


def _chi2(counts, probs, rows):
  """Pearson statistic and degrees of freedom, pooling bins with expected count < 5 into one."""
  expected = rows * probs
  small = expected < 5
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def _chi2_upper(df, z=3.719):
  """Wilson–Hilferty approximation of the chi-square quantile at upper tail 1e-4 (z = 3.719)."""
  a = 2.0 / (9 * df)
  return df * (1 - a + z * np.sqrt(a)) ** 3


def test_one_step_samples_follow_softmax_at_tau(tiny):
  rows, tau = 20_000, 0.7
  prompt = [[5, 9, 12, 3]]
  ids, mask = left_pad(prompt, 4)
  z = np.asarray(full_logits(*tiny, ids, mask)[0, -1], np.float64)
  probs = np.exp(_np_log_softmax(z / tau))
  wrong_tau = np.exp(_np_log_softmax(z / 0.8))
  # The sampler's logits (a cached prefill) and these (the training forward) are two forwards: a
  # probability moves by up to 2× their logits' gap, relative, besides the sampler's own sums.
  logits_gap = 2 * chain_terms(CFG, 4) * U * float(np.max(np.abs(z))) / tau
  mass_error = 2 * logits_gap + (2 * CFG.vocab_size + 6) * U

  out = _gen(tiny, [rows], key=11, tau=tau, prompts=prompt, p=4, n=1, eos=-1)
  hist = np.bincount(np.asarray(out.tokens_RxN)[:, 0], minlength=CFG.vocab_size)
  stat, df = _chi2(hist, probs, rows)
  assert stat < _chi2_upper(df), (stat, df)
  stat_wrong, df_wrong = _chi2(hist, wrong_tau, rows)
  assert stat_wrong > 3 * _chi2_upper(df_wrong), (stat_wrong, df_wrong)  # the test has power

  # top-p: nothing outside the nucleus, and inside it the renormalised softmax(z/τ).
  top_p = 0.5
  order = np.argsort(-probs)
  mass_before = np.cumsum(probs[order]) - probs[order]
  inside = order[mass_before < top_p]
  _assert_nucleus_is_decided(mass_before, top_p, mass_error)
  out = _gen(tiny, [rows], key=12, tau=tau, top_p=top_p, prompts=prompt, p=4, n=1, eos=-1)
  hist = np.bincount(np.asarray(out.tokens_RxN)[:, 0], minlength=CFG.vocab_size)
  assert hist[np.setdiff1d(np.arange(CFG.vocab_size), inside)].sum() == 0
  assert 2 <= len(inside) < CFG.vocab_size // 2
  stat, df = _chi2(hist[inside], probs[inside] / probs[inside].sum(), rows)
  assert stat < _chi2_upper(df), (stat, df)


def _draws(fn, z_V, rows, seed):
  """``rows`` draws of ``fn(u_R, z_RxV)`` (one uniform per row) for one logit vector, as a
  histogram over V."""
  z_RxV = jnp.broadcast_to(jnp.asarray(z_V, jnp.float32), (rows, z_V.shape[0]))
  u_R = jax.random.uniform(jax.random.key(seed), (rows,), jnp.float32)
  return np.bincount(np.asarray(jax.jit(fn)(u_R, z_RxV)), minlength=z_V.shape[0])


def test_inverse_cdf_draws_follow_softmax_across_blocks():
  # 300 entries: two full blocks of the two-level search and a partial one (padded with weight 0),
  # a -inf entry in each block that must never be drawn.
  rows, v = 40_000, 300
  z_V = np.random.default_rng(3).normal(0.0, 1.5, v)
  z_V[[5, 130, 299]] = -np.inf
  hist = _draws(draws.inverse_cdf_sample, z_V, rows, seed=0)
  assert hist[[5, 130, 299]].sum() == 0
  probs = np.exp(_np_log_softmax(z_V))
  stat, df = _chi2(hist, probs, rows)
  assert stat < _chi2_upper(df), (stat, df)
  shifted = np.exp(_np_log_softmax(np.roll(z_V, 1)))
  assert _chi2(hist, shifted, rows)[0] > 3 * _chi2_upper(df)  # the test has power


def _assert_nucleus_is_decided(mass_before, top_p, error):
  """Whether a token is in the nucleus compares its exclusive mass (the float32 sampler's, another
  sum than the float64 oracle's) with top_p: the oracle's nucleus is the sampler's on any CPU only
  if no exclusive mass lies within the sampler's rounding ``error`` of top_p."""
  margin = float(np.min(np.abs(mass_before - top_p)))
  assert margin > error, (margin, error)


# (vocabulary, logit scale, top_p, the path that finds the nucleus): peaked, the first top-k tier
# holds it; flatter, the second tier; flat, no tier does and the vocabulary is sorted. The flatter
# one's top_p is 0.5, not 0.9: at 0.9 a token's exclusive mass lies 2.5e-6 from top_p, inside the
# rounding of a 1,024-term cumulative sum (at 0.5 the nearest lies 5.1e-4 away).
NUCLEUS_PATHS = [(300, 6.0, 0.9, "top-64"), (2048, 2.0, 0.5, "top-1024"), (300, 0.1, 0.9, "sort")]


@pytest.mark.parametrize("v, scale, top_p, path", NUCLEUS_PATHS)
def test_nucleus_draws_stay_inside_the_nucleus(v, scale, top_p, path):
  rows = 40_000
  z_V = np.random.default_rng(4).normal(0.0, scale, v)
  probs = np.exp(_np_log_softmax(z_V))
  order = np.argsort(-probs)
  mass_before = np.cumsum(probs[order]) - probs[order]
  inside = order[mass_before < top_p]
  # The sampler's masses: z rounded to float32 (probabilities off by ≤ 2u·max|z| relative), a
  # log-sum-exp over V terms, an exp, a cumulative sum of at most V terms less one: (2V + 6)·u.
  _assert_nucleus_is_decided(mass_before, top_p, (2 * v + 6 + 2 * np.max(np.abs(z_V))) * U)
  tiers = [t for t in draws._NUCLEUS_CANDIDATES if t < v]
  holds = [f"top-{t}" for t in tiers if len(inside) <= t]
  assert path == (holds[0] if holds else "sort"), (len(inside), tiers)
  hist = _draws(lambda u, z: draws._nucleus_sample(u, z, jnp.float32(top_p))[0], z_V, rows, seed=1)
  assert hist[np.setdiff1d(np.arange(v), inside)].sum() == 0
  stat, df = _chi2(hist[inside], probs[inside] / probs[inside].sum(), rows)
  assert stat < _chi2_upper(df), (stat, df)
  # The log of the nucleus's mass (ℓ_μ = ℓ − log mass), whichever path found it: a difference of
  # two float32 log-sum-exps of z, each within (V + 4)·u·max|z| (tests/rounding.py's terms).
  z_1xV = jnp.asarray(z_V[None], jnp.float32)
  _, log_mass = draws._nucleus_sample(jnp.zeros(1), z_1xV, jnp.float32(top_p))
  want = np.log(probs[inside].sum())
  bound = 2 * (v + 4 + 2) * U * float(np.max(np.abs(z_V)))
  np.testing.assert_allclose(float(log_mass[0]), want, rtol=0, atol=bound)


def test_greedy_equals_hf_generate(tmp_path):
  torch = pytest.importorskip("torch")
  import hf_fixtures
  import transformers

  from jaxrl.nn import hf_load

  path = hf_fixtures.make_tiny_hf("qwen2", False, tmp_path / "qwen2")
  cfg, graphdef, params = hf_load.load_hf_checkpoint(path)
  prompts = [[15, 99, 3, 42, 7, 120], [61, 8, 150]]
  ids, mask = left_pad(prompts, 6)
  new, eos = 12, cfg.vocab_size - 1
  out = sampler.generate(
    graphdef,
    params,
    ids,
    mask,
    np.array([1, 1]),
    jax.random.key(0),
    1.0,
    1.0,
    num_rollouts=2,
    max_new_tokens=new,
    eos_id=eos,
    pad_id=PAD,
    model_cfg=cfg,
    greedy=True,
  )

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    hf_out = hf_model.generate(
      input_ids=torch.tensor(ids, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
      do_sample=False,
      max_new_tokens=new,
      eos_token_id=eos,
      pad_token_id=PAD,
    )
  hf_tokens = hf_out[:, ids.shape[1] :].numpy()
  hf_tokens = np.pad(hf_tokens, ((0, 0), (0, new - hf_tokens.shape[1])), constant_values=PAD)
  # Two frameworks' forwards, each summing in its own CPU kernels' order: each choice must be
  # decided by more than their logits' gap (two float32 forwards, tests/rounding.py).
  logits = teacher_forced_logits((graphdef, params), out)
  gap = 2 * chain_terms(cfg, ids.shape[1] + new) * U * float(np.max(np.abs(logits)))
  _assert_argmax_is_decided(logits, out.mask_RxN, gap)
  np.testing.assert_array_equal(np.asarray(out.tokens_RxN), hf_tokens)
  assert len(set(hf_tokens.ravel().tolist())) > 3  # not a degenerate repeat of one token
