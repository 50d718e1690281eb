"""Packed updates (``jaxrl.rl.packing``): the packer, the packed forward, and the update it runs,
which is the padded update's objective exactly (loss, gradients, new params, up to rounding)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rounding import attention_atol, entropy_atol, grad_rtol, logp_atol
from run_helpers import (
  SMALL_MODEL,
  assert_same_step,
  assert_same_update,
  rollouts,
  step_context,
  tiny_config,
  update_hparams,
)

from jaxrl.nn import attention, model
from jaxrl.nn.logprobs import logits_f32
from jaxrl.rl import losses, micro_batches, packing, scoring, step
from jaxrl.rl.forget import eepo_forget
from jaxrl.run.context import compile_counter
from jaxrl.run.loop import initial_loop, rl_step

# ---- the packer: a pure function over lengths


def test_first_fit_decreasing_worked_example():
  """Longest first, each into the first bin with room: 8, 7, 5 open bins; 5, 3, 2 fill them."""
  bin_K, offset_K, bins = packing.first_fit_decreasing([3, 7, 5, 5, 2, 8, 0], 10)
  assert bins == 3
  np.testing.assert_array_equal(bin_K, [1, 1, 2, 2, 0, 0, -1])
  np.testing.assert_array_equal(offset_K[:6], [7, 0, 0, 5, 8, 0])


def _replay_first_fit(lengths_K, capacity, bin_K, offset_K):
  """Oracle: replays the placements longest first and checks each is the first fit at its time
  and starts where its bin ended; returns the bins' fill."""
  used = {}
  for k in sorted(range(len(lengths_K)), key=lambda k: -lengths_K[k]):
    if lengths_K[k] == 0:
      assert bin_K[k] == -1
      continue
    for b in range(bin_K[k]):  # every earlier bin was too full for it
      assert used.get(b, 0) + lengths_K[k] > capacity
    assert offset_K[k] == used.get(bin_K[k], 0)
    used[bin_K[k]] = offset_K[k] + lengths_K[k]
    assert used[bin_K[k]] <= capacity
  return used


def test_first_fit_decreasing_matches_the_replay_oracle():
  rng = np.random.default_rng(0)
  for _ in range(300):
    capacity = int(rng.integers(1, 20))
    lengths_K = rng.integers(0, capacity + 1, int(rng.integers(0, 16)))
    bin_K, offset_K, bins = packing.first_fit_decreasing(lengths_K, capacity)
    used = _replay_first_fit(lengths_K.tolist(), capacity, bin_K, offset_K)
    assert sorted(used) == list(range(bins))
    assert bins >= -(-int(lengths_K.sum()) // capacity)  # no packing does better than the sum


def test_first_fit_decreasing_refuses_what_cannot_fit():
  with pytest.raises(ValueError, match="lengths"):
    packing.first_fit_decreasing([3, 11], 10)


def test_buckets_are_few_and_hold_what_is_needed():
  assert [packing.bucket(n, 8, 4) for n in range(9)] == [2, 2, 2, 4, 4, 6, 6, 8, 8]
  assert {packing.bucket(n, 13, 4) for n in range(14)} == {4, 7, 10, 13}
  with pytest.raises(ValueError):
    packing.bucket(9, 8, 4)


@pytest.mark.parametrize("mini,micro", [(1, 1), (2, 1), (1, 4), (2, 2)])
def test_micro_batch_ids_follow_the_updates_split(mini, micro):
  """Oracle: the update's own strided splits of the row indices."""
  rows = 16
  minis = micro_batches.split_micro(jnp.arange(rows), mini)
  expected = np.zeros(rows, int)
  for m in range(mini):
    for u, chunk in enumerate(np.asarray(micro_batches.split_micro(minis[m], micro))):
      expected[chunk] = m * micro + u
  np.testing.assert_array_equal(packing.micro_batch_ids(rows, mini, micro), expected)


# ---- a batch with every kind of row

P, N = 6, 8
T = P + N
# Per row: real prompt and response tokens. Row 0 takes the whole budget (14 = P + N); the 7s fill
# buffers exactly in pairs; row 15 has no response (a padding row of the group of no question).
PROMPT_LEN = [6, 1, 4, 3, 2, 5, 6, 3, 1, 2, 4, 5, 3, 6, 2, 3]
RESPONSE_LEN = [8, 1, 3, 4, 5, 2, 1, 7, 6, 4, 3, 2, 8, 1, 5, 0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4]
REWARDS = [1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0]
NUM_GROUPS = 5


def packing_batch(seed: int = 0):
  """16 rollouts of ``SMALL_MODEL``'s vocabulary: left-padded prompts, right-padded responses;
  row 7 has a gap inside its response (a multi-turn row waiting), rows 7 and 9 an environment's
  tokens (off the loss mask); ℓ_prox and ℓ_μ apart, so ρ ≠ 1 and §9's weights act."""
  rng = np.random.default_rng(seed)
  r = len(PROMPT_LEN)
  prompt_mask = np.arange(P)[None, :] >= P - np.array(PROMPT_LEN)[:, None]
  mask = np.arange(N)[None, :] < np.array(RESPONSE_LEN)[:, None]
  mask[7] = [1, 1, 0, 1, 1, 1, 1, 1]  # 7 tokens, a gap at 2
  loss_mask = mask.copy()
  loss_mask[7, 3] = loss_mask[9, 1:3] = False  # an environment's tokens
  prox = np.where(loss_mask, -3.5 + 0.3 * rng.standard_normal((r, N)), 0.0)
  return rollouts(
    prompt_ids_RxP=rng.integers(0, 32, (r, P)).astype(np.int32),
    prompt_mask_RxP=prompt_mask,
    tokens_RxN=rng.integers(0, 32, (r, N)).astype(np.int32),
    mask_RxN=mask,
    behaviour_logp_RxN=np.where(loss_mask, prox + 0.5 * rng.standard_normal((r, N)), 0.0),
    prox_logp_RxN=prox,
    loss_mask_RxN=loss_mask,
    rewards_R=np.asarray(REWARDS, np.float32),
    group_ids_R=np.asarray(GROUPS, np.int32),
  )


def test_the_plan_places_every_sequence_whole_and_apart():
  batch = packing_batch()
  lengths_R = packing.sequence_lengths(batch.prompt_mask_RxP, batch.mask_RxN)
  assert lengths_R[0] == T and lengths_R[15] == 0
  for mini, micro in [(1, 1), (2, 2)]:
    pack = packing.plan(batch.prompt_mask_RxP, batch.mask_RxN, mini, micro, buckets=4)
    ids_R = packing.micro_batch_ids(16, mini, micro)
    fills = []
    for m in range(mini * micro):
      taken = np.zeros((pack.rows, T), int)
      for r in np.flatnonzero((ids_R == m) & (lengths_R > 0)):
        assert 0 <= pack.slot_R[r] < pack.rows and pack.offset_R[r] + lengths_R[r] <= T
        taken[pack.slot_R[r], pack.offset_R[r] : pack.offset_R[r] + lengths_R[r]] += 1
      assert taken.max() == 1  # no two sequences overlap
      fills += list(taken.sum(axis=1))
    assert pack.slot_R[15] == -1
    # The logged fill: the tokens over every buffer position, as the placements count them.
    logged = packing.metrics(pack, batch.prompt_mask_RxP, batch.mask_RxN, mini * micro)
    assert logged == {
      "train_pack_rows": pack.rows,
      "train_pack_fill": sum(fills) / (len(fills) * T),
    }
    assert fills.count(T) >= 2  # the whole-budget row's buffer, and pairs of 7 filling one
    assert pack.rows < 16 // (mini * micro)  # packing saved buffer rows


# ---- the packed forward


@pytest.mark.parametrize("block", [4, 64])  # blocked attention with segments; one block
def test_packed_logprobs_equal_padded(block):
  cfg = dataclasses.replace(SMALL_MODEL, attention_block=block)
  graphdef, params = model.create(cfg, 3)
  batch = packing_batch()
  pack = packing.plan(batch.prompt_mask_RxP, batch.mask_RxN, 1, 1, buckets=4)
  tau = jnp.float32(0.9)
  rows = (batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN, batch.mask_RxN)
  logp, ent = scoring.logp_responses(graphdef, params, *rows, tau, 16)

  def packed(params, tau, *rows_and_layout):
    fused = scoring.logprobs_entropies(tau, 16)
    return scoring.packed_token_values(graphdef, params, *rows_and_layout, pack.rows, fused)

  logp_p, ent_p = jax.jit(packed)(params, tau, *rows, pack.slot_R, pack.offset_R)
  hidden, head = scoring.response_hidden(graphdef, params, *rows)
  z_scale = float(jnp.max(jnp.abs(logits_f32(hidden.reshape(-1, cfg.hidden_size), head)))) / 0.9
  mask = np.asarray(batch.mask_RxN)
  np.testing.assert_array_equal(np.asarray(logp_p)[~mask], 0)
  # Two forwards over the same keys of each token (the packed row holds more slots, all masked
  # out): the sums run in other orders, within the rounding of a forward over T slots.
  np.testing.assert_allclose(logp_p, logp, rtol=0, atol=logp_atol(cfg, T, z_scale))
  np.testing.assert_allclose(ent_p, ent, rtol=0, atol=entropy_atol(cfg, T, z_scale))


# ---- the packed update is the padded update

CASES = {
  "token-mean": dict(),
  "token-mean, mini 2 micro 2": dict(mini_batches=2, micro_batches=2),
  "seq-mean-token-mean, micro 2": dict(aggregation="seq-mean-token-mean", micro_batches=2),
  "seq-mean-token-sum-norm, mini 2": dict(
    aggregation="seq-mean-token-sum-norm", max_response_len=N, mini_batches=2
  ),
  "k1": dict(use_kl=True, kl_estimator="k1"),
  "k2": dict(use_kl=True, kl_estimator="k2"),
  "k3, all rollouts, mini 2 micro 2": dict(
    use_kl=True, kl_estimator="k3", informative_only=False, mini_batches=2, micro_batches=2
  ),
  "dual clip, mini 2": dict(dual_clip=3.0, mini_batches=2),
  "tis": dict(behaviour_correction="tis"),
  "mis, micro 2": dict(behaviour_correction="mis", micro_batches=2),
  "seq-mis": dict(behaviour_correction="seq-mis"),
  "dynamo, mini 2 micro 2": dict(modulation=True, mini_batches=2, micro_batches=2),
}


def _hparams():
  """``update_hparams`` with the KL penalty and the entropy bonus on."""
  return dataclasses.replace(
    update_hparams(), kl_coef=jnp.float32(0.1), entropy_coef=jnp.float32(0.01)
  )


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_packed_update_equals_padded(fields):
  graphdef, params = model.create(SMALL_MODEL, 4)
  ref_params = model.create(SMALL_MODEL, 5)[1]  # a reference apart from the policy: KL ≠ 0
  cfg = losses.LossConfig(num_groups=NUM_GROUPS, **fields)
  batch = packing_batch()
  pack = packing.plan(
    batch.prompt_mask_RxP, batch.mask_RxN, cfg.mini_batches, cfg.micro_batches, buckets=4
  )
  tx = optax.sgd(0.1)
  update = jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))
  hp = _hparams()
  out = [update(step.init_state(params, tx), batch, hp, ref_params, p) for p in (None, pack)]
  assert float(out[1][1]["token_count"]) == float(out[0][1]["token_count"])
  # As ``test_step``'s micro-batch test: the packed forward sums in other orders (other matmul
  # shapes, more masked slots in each softmax), so the two updates' gradients lie within
  # ``grad_rtol`` over T slots and the mini-batch's R·T positions, and SGD's new weights within
  # lr times that and an ulp. DynaMO's f amplifies the forward's rounding by its slope, at most
  # α·γ/4, relative to f ≥ 1 − α (test_step's DynaMO test derives it).
  rtol = grad_rtol(SMALL_MODEL, T, 16 * T)
  if cfg.modulation:
    alpha, gamma = float(hp.modulation_alpha), float(hp.modulation_gamma)
    rtol *= 1 + alpha * gamma / (4 * (1 - alpha))
  assert_same_update(out, params, rtol)
  for name in ("pg_loss", "kl_loss", "entropy_loss"):  # the loss's terms, as the loss
    np.testing.assert_allclose(out[1][1][name], out[0][1][name], rtol=rtol, atol=rtol)


def test_the_update_compiles_once_per_bucket():
  """Buffer rows come from ``buckets`` values, so however the lengths fall, the packed update
  compiles at most that many programs: one per bucket met, none for a batch of a bucket met."""
  mcfg = dataclasses.replace(SMALL_MODEL, num_layers=1)
  graphdef, params = model.create(mcfg, 0)
  cfg = losses.LossConfig(num_groups=3)
  tx = optax.sgd(0.1)
  update = jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))
  rng = np.random.default_rng(0)
  p, n, r = 4, 6, 8
  met = []
  counter = compile_counter().start()
  try:
    # Sequences of these lengths (tokens, prompt and response) fill 2, 3 (so 4), 6 and 8 buffer
    # rows of P + N = 10; then 2 and 4 again.
    for length_R in ([2] * 8, [3] * 8, [6] * 6 + [4] * 2, [10] * 8, [2] * 8, [5] * 8):
      length_R = np.asarray(length_R)
      prompt_R = np.clip(length_R - n, 1, p)
      response_R = length_R - prompt_R
      batch = rollouts(
        prompt_ids_RxP=rng.integers(0, 32, (r, p)).astype(np.int32),
        prompt_mask_RxP=np.arange(p)[None, :] >= p - prompt_R[:, None],
        tokens_RxN=rng.integers(0, 32, (r, n)).astype(np.int32),
        mask_RxN=np.arange(n)[None, :] < response_R[:, None],
        behaviour_logp_RxN=np.full((r, n), -3.0, np.float32),
        rewards_R=np.tile([1.0, 0.0], r // 2).astype(np.float32),
        group_ids_R=np.repeat([0, 1], r // 2).astype(np.int32),
      )
      pack = packing.plan(batch.prompt_mask_RxP, batch.mask_RxN, 1, 1, buckets=4)
      met.append(pack.rows)
      update(step.init_state(params, tx), batch, update_hparams(), None, pack)
  finally:
    counter.stop()
  assert set(met) == {2, 4, 6, 8}
  assert counter.counts()["compiles_update"] == 4


@pytest.mark.parametrize("micro", [1, 2])
def test_packed_forgetting_step_equals_padded(micro):
  """EEPO's θ' = θ + η∇L (docs/algorithms.md §5) over the same rows, packed per chunk."""
  graphdef, params = model.create(SMALL_MODEL, 6)
  batch = packing_batch(1)
  pack = packing.plan(batch.prompt_mask_RxP, batch.mask_RxN, 1, micro, buckets=4)
  rows = (batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN, batch.mask_RxN)
  forget = jax.jit(
    functools.partial(eepo_forget, graphdef, 16, lr=0.1, eps_l=1e-3, eps_r=1e-2),
    static_argnames=("micro",),
  )
  out = [
    forget(params, *rows, batch.loss_mask_RxN, jnp.float32(0.9), p, micro=micro)
    for p in (None, pack)
  ]
  # As the update's: θ' moves by η times the gradient, so its weights lie within ``grad_rtol``
  # of a leaf's largest step and an ulp; L is the forward's.
  rtol = grad_rtol(SMALL_MODEL, T, 16 * T)
  assert_same_step(out[1][0], out[0][0], params, rtol)
  np.testing.assert_allclose(float(out[1][1]), float(out[0][1]), rtol=rtol)


# Three packed rows of 12 slots: three sequences and padding; one sequence filling the row; two
# sequences and padding.
SEGMENTS_BxT = np.array(
  [
    [1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0],
    [1] * 12,
    [1, 1, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0],
  ],
  np.int32,
)


@pytest.mark.parametrize("path", ["blocked-4", "one-block", "dot-product-xla"])
def test_segment_attention_is_each_sequence_alone(path):
  """Oracle: each sequence in a row of its own (boolean validity, the padded path)."""
  b, t, kv, rep, e = 3, 12, 2, 3, 8
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(b, t, kv, rep, e)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, kv, e, t)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, kv, t, e)), jnp.float32)
  segments = jnp.asarray(SEGMENTS_BxT)
  if path == "dot-product-xla":  # the call cuDNN takes on a GPU, through its XLA implementation
    out = jax.jit(attention.fused_attention, static_argnums=4)(q, k, v, segments, "xla")
  else:
    block = 4 if path == "blocked-4" else t
    out = jax.jit(attention.attention, static_argnums=(4, 5))(q, k, v, segments, 0, block)
  for row in range(b):
    for seg in set(SEGMENTS_BxT[row]) - {0}:
      at = np.flatnonzero(SEGMENTS_BxT[row] == seg)
      alone = attention.attention(
        q[row : row + 1, at], k[row : row + 1][..., at], v[row : row + 1][:, :, at],
        jnp.ones((1, len(at)), bool), 0, t,
      )  # fmt: skip
      # The same attention of each query over the same keys (the other slots masked out give
      # exactly 0 weight): two evaluations of it, within ``attention_atol``.
      np.testing.assert_allclose(
        np.asarray(out[row, at]), np.asarray(alone[0]), rtol=0, atol=attention_atol(q, k, v)
      )


@pytest.mark.parametrize("mini,micro", [(1, 1), (2, 1), (1, 4), (2, 2)])
def test_a_pass_over_the_micro_batches_keeps_the_row_order(mini, micro):
  """The KL reference's packed pass maps over the update's micro-batches and puts each row's
  values back in its place: the identity comes back unchanged."""
  rows_RxN = jnp.arange(16 * 3).reshape(16, 3)
  got = micro_batches.packed_by_micro_batches(
    lambda chunk: chunk[0] * 1, (rows_RxN, rows_RxN), mini, micro
  )
  np.testing.assert_array_equal(got, rows_RxN)


def test_packed_rescoring_equals_padded():
  """π_old rescoring (``logp_responses_chunked``, 2 chunks) packed per chunk: the same values
  within the bounds of ``test_packed_logprobs_equal_padded``."""
  graphdef, params = model.create(SMALL_MODEL, 7)
  batch = packing_batch(2)
  pack = packing.plan(batch.prompt_mask_RxP, batch.mask_RxN, 1, 2, buckets=4)
  rows = (batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN, batch.mask_RxN)
  tau = jnp.float32(0.9)
  score = jax.jit(
    functools.partial(scoring.logp_responses_chunked, graphdef, chunk_size=16),
    static_argnames=("micro",),
  )
  (logp, ent), (logp_p, ent_p) = (score(params, *rows, tau, micro=2, pack=p) for p in (None, pack))
  hidden, head = scoring.response_hidden(graphdef, params, *rows)
  z_scale = float(jnp.max(jnp.abs(logits_f32(hidden.reshape(-1, SMALL_MODEL.hidden_size), head))))
  z_scale /= 0.9
  np.testing.assert_allclose(logp_p, logp, rtol=0, atol=logp_atol(SMALL_MODEL, T, z_scale))
  np.testing.assert_allclose(ent_p, ent, rtol=0, atol=entropy_atol(SMALL_MODEL, T, z_scale))


@pytest.mark.parametrize("packed", [True, False])
def test_the_loop_packs_the_update_when_the_switch_is_on(tmp_path, packed):
  """``loss.packing`` (on by default) decides whether a step's update runs packed; the step logs
  what packing did."""
  cfg = tiny_config("test", **{"sft.steps": 0, "loss.packing": packed})
  assert tiny_config("test").loss.packing  # the default
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  _, row = rl_step(ctx, initial_loop(ctx, ctx.programs.init_state(params)), 0)
  assert np.isfinite(row["loss"])
  if not packed:
    assert "train_pack_rows" not in row
    return
  per_micro = cfg.num_rollouts // (cfg.loss.mini_batches * cfg.loss.micro_batches)
  assert 1 <= row["train_pack_rows"] <= per_micro and 0 < row["train_pack_fill"] <= 1
  # the raw throughput counts the packed buffers' positions: their share of tokens is the fill
  assert row["train_tok_s"] / row["train_raw_tok_s"] == pytest.approx(row["train_pack_fill"])
