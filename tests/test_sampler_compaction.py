"""The compacted decode (jaxrl.rollout.compaction) against the sampler that decodes every row.

Oracle: ``sampler.generate`` with the same key, whose rows all stay in the batch to the end; and
hand-counted row-steps for the waste measure.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from rounding import entropy_atol, logp_atol
from run_helpers import run_steps, step_context, tiny_config
from sampler_fixtures import CFG, EOS, PAD, left_pad, teacher_forced_logits

from jaxrl.config import ConfigError
from jaxrl.nn import model
from jaxrl.rollout import compaction, engine, sampler
from jaxrl.run.compiles import CompileCounter
from jaxrl.run.loop import initial_loop

# Four prompts, 32 rows: the buckets are 32, 16 and 8; EOS (1 of 16 tokens) ends rows at spread
# lengths, and N = 80 crosses the first cache segment (64) so compaction meets a cache growth.
PROMPTS = [[5, 9, 12, 3], [7, 3, 10], [14, 8, 8, 6, 2], [1, 2, 3, 4, 5, 6]]
COUNTS, P = [12, 8, 6, 6], 6


@pytest.fixture(scope="module")
def tiny():
  return model.create(CFG, seed=0)


def _request(n, key, top_p, **kw):
  ids, mask = left_pad(PROMPTS, P)
  return (ids, mask, np.asarray(COUNTS), jax.random.key(key), 1.0, top_p), dict(
    num_rollouts=sum(COUNTS), max_new_tokens=n, eos_id=EOS, pad_id=PAD, model_cfg=CFG, **kw
  )


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_compacted_rollouts_equal_the_full_batchs(tiny, top_p):
  n = 80
  args, kw = _request(n, 3, top_p)
  want = jax.tree.map(np.asarray, sampler.generate(*tiny, *args, **kw))
  jax_engine = engine.JaxEngine(
    tiny[0], CFG, max_new_tokens=n, eos_id=EOS, pad_id=PAD, top_p=top_p, compact_every=4
  )
  request = engine.SampleRequest(*args[:5])
  got = jax.tree.map(np.asarray, jax_engine.generate(tiny[1], 0, request))
  lengths = want.lengths_R
  # The batch shrank: most rows ended early, some ran to N.
  assert compaction.wasted_share(lengths, n, 4) < compaction.wasted_share(lengths, n) / 1.3
  assert (lengths < 20).sum() > 8 and (lengths == n).any()
  for field in ("tokens_RxN", "mask_RxN", "loss_mask_RxN", "lengths_R", "finished_R"):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
  for field in ("prompt_ids_RxP", "prompt_mask_RxP", "group_ids_R"):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
  # The same sums over batches of other sizes: XLA's CPU products add them in other orders.
  z_scale = float(np.max(np.abs(teacher_forced_logits(tiny, want)[want.mask_RxN])))
  for field in ("behaviour_logp_RxN", "prox_logp_RxN"):
    np.testing.assert_allclose(
      getattr(got, field), getattr(want, field), atol=logp_atol(CFG, P + n, z_scale), rtol=0
    )
  np.testing.assert_allclose(
    got.entropy_RxN, want.entropy_RxN, atol=entropy_atol(CFG, P + n, z_scale), rtol=0
  )


def test_compiles_stay_within_the_buckets(tiny):
  # N = 75 is a length no other test samples, so the first call traces its programs.
  n, every = 75, 8
  counter = CompileCounter(chunks=compaction.decode_chunk.__name__).start()
  try:
    lengths = []
    for key in (4, 5, 6):
      args, kw = _request(n, key, 1.0, compact_every=every)
      lengths.append(np.asarray(compaction.generate(*tiny, *args, **kw).lengths_R))
    traced = counter.counts()["chunks"]
    # One decode chunk per bucket a call reached, at most per cache segment (64, 75).
    assert 2 <= traced <= len(compaction.row_buckets(sum(COUNTS))) * len(sampler.segment_ends(n))
    args, kw = _request(n, 4, 1.0, compact_every=every)
    compaction.generate(*tiny, *args, **kw)
    assert counter.counts()["chunks"] == traced  # a batch met before: no new trace
  finally:
    counter.stop()
  assert len({tuple(x) for x in lengths}) == 3  # three keys, three different batches


def test_buckets_are_r_then_powers_of_two():
  assert compaction.row_buckets(512) == [512, 256, 128, 64, 32, 16, 8]
  assert compaction.row_buckets(24) == [24, 16, 8]
  assert compaction.row_buckets(8) == [8]
  assert compaction.row_buckets(5) == [5]
  assert [compaction.bucket_for(live, 24) for live in (24, 17, 16, 9, 8, 1)] == [
    24,
    24,
    16,
    16,
    8,
    8,
  ]


def test_wasted_share_counts_row_steps_by_hand():
  # 15 rows of 1 token (the prefill's draw) and one of 9: steps 1..8 do 8 useful row-steps.
  lengths = [1] * 15 + [9]
  assert compaction.wasted_share(lengths, 64) == pytest.approx(1 - 8 / (16 * 8))
  # Compacted every 4 tokens: one row live, so both chunks (tokens 1-4, 5-8) run bucket 8.
  assert compaction.wasted_share(lengths, 64, 4) == pytest.approx(1 - 8 / (8 * 4 + 8 * 4))
  # A chunk also ends where the cache grows (token 64): 63 steps of 16 rows, then 6 of 8.
  lengths = [30] * 8 + [70] * 8
  useful, spent = 8 * 29 + 8 * 69, 16 * 63 + 8 * 6
  assert compaction.wasted_share(lengths, 80, 100) == pytest.approx(1 - useful / spent)


def test_a_training_step_samples_the_same_rollouts_compacted(tmp_path, monkeypatch):
  """The trainer's step with ``rollout.compact_every``: the same rollouts, so the same rewards,
  lengths and accuracies, as without (the update's own numbers move with ℓ_prox's rounding)."""
  compactions = []

  def counted_take(*args):
    compactions.append(len(args[2]))  # the new batch's rows
    return take(*args)

  take = compaction._take
  monkeypatch.setattr(compaction, "_take", counted_take)
  rows = {}
  for every in (0, 2):
    # 16 rows of a fresh model, up to 32 tokens: EOS ends most rows before the last
    overrides = {"rollout.compact_every": every, "rollout.max_new_tokens": 32}
    cfg = tiny_config("test", steps=1, **overrides)
    ctx, params = step_context(cfg, tmp_path / "tokenizer")
    rows[every] = run_steps(ctx, initial_loop(ctx, ctx.programs.init_state(params)), 0, 1)[1][0]
  assert compactions == [8]  # the step's batch went from 16 rows to 8
  assert rows[2].keys() == rows[0].keys()
  exact = [k for k in rows[0] if "reward" in k or "len" in k or "accuracy" in k]
  assert len(exact) >= 3 and all(rows[2][k] == rows[0][k] for k in exact), exact


def test_the_engine_compacts_only_budgets_longer_than_a_chunk(tiny, monkeypatch):
  """A budget of at most ``compact_every`` tokens is one chunk: the plain sampler decodes it."""
  calls = []
  full = compaction.generate
  monkeypatch.setattr(compaction, "generate", lambda *a, **k: calls.append(1) or full(*a, **k))
  args, _ = _request(8, 1, 1.0)
  for n, compacted in ((8, False), (9, True)):
    e = engine.JaxEngine(tiny[0], CFG, max_new_tokens=n, eos_id=EOS, pad_id=PAD, compact_every=8)
    calls.clear()
    e.generate(tiny[1], 0, engine.SampleRequest(*args[:5]))
    assert bool(calls) == compacted, n


def test_several_processes_decode_without_compaction(tiny, monkeypatch, caplog):
  """Between chunks the host reads every row: on several processes the engine decodes every row to
  the end instead, and says so."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with caplog.at_level("WARNING", logger=engine.__name__):
    e = engine.JaxEngine(tiny[0], CFG, max_new_tokens=64, eos_id=EOS, pad_id=PAD, compact_every=8)
  assert e._compact_every == 0
  assert "off on several processes" in caplog.text


def test_the_config_refuses_a_negative_interval():
  with pytest.raises(ConfigError, match="rollout.compact_every"):
    tiny_config("test", **{"rollout.compact_every": -1})
