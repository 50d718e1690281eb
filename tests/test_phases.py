"""The annealing-phase curriculum: mixtures and their cursor, the phase config, and a run that
switches data, G and response length at the phase start, compiles once there, and resumes exactly."""

import json
import math

import jax
import numpy as np
import pytest
from run_helpers import read_metrics, tiny_config

from jaxrl.config import ConfigError, annealing
from jaxrl.run.phases import anneal_start, phase_at, run_phases
from jaxrl.run.train import Trainer
from jaxrl.tasks.data.cursor import Cursor, Mixture, MixtureCursor, next_batch, next_mixture_batch

# -- mixtures ---------------------------------------------------------------------------------------


def test_one_pool_mixture_draws_what_the_plain_cursor_draws():
  mix, cur, plain = Mixture.whole(37), MixtureCursor.start(Mixture.whole(37)), Cursor()
  for _ in range(9):
    a, cur = next_mixture_batch(cur, 5, mix, 8)
    b, plain = next_batch(plain, 5, 37, 8)
    np.testing.assert_array_equal(a, b)
    assert cur.epoch(mix) == plain.epoch


def test_weighted_mixture_follows_weights_and_passes_each_pool():
  pools = (np.arange(0, 30, dtype=np.int32), np.arange(100, 110, dtype=np.int32))
  mix = Mixture(pools, (1.0, 3.0))
  cur, drawn = MixtureCursor.start(mix), []
  for _ in range(250):
    ids, cur = next_mixture_batch(cur, 0, mix, 16)
    drawn.append(ids)
  drawn = np.concatenate(drawn)
  share = np.mean(drawn >= 100)
  # 4000 draws with p = 0.75: the binomial std of the share is 0.0068; allow 5 std.
  assert abs(share - 0.75) < 5 * math.sqrt(0.75 * 0.25 / len(drawn))
  # Each pool is read in whole passes: within a pool's first pass every question appears once.
  small = drawn[drawn >= 100]
  assert sorted(small[:10].tolist()) == list(range(100, 110))
  assert sorted(drawn[drawn < 100][:30].tolist()) == list(range(30))
  assert cur.epoch(mix) == 4000 // 40


def test_mixture_cursor_resumes_from_json():
  mix = Mixture((np.arange(7, dtype=np.int32), np.arange(7, 20, dtype=np.int32)), (2.0, 1.0), 1)
  cur = MixtureCursor.start(mix, epoch0=3)
  for _ in range(5):
    _, cur = next_mixture_batch(cur, 1, mix, 6)
  restored = MixtureCursor.from_json(cur.to_json())
  assert restored == cur
  a, _ = next_mixture_batch(cur, 1, mix, 6)
  b, _ = next_mixture_batch(restored, 1, mix, 6)
  np.testing.assert_array_equal(a, b)
  assert restored.epoch(mix) == 3 + 30 // 20


def test_mixture_rejects_empty_pools_and_bad_weights():
  with pytest.raises(ValueError, match="weight"):
    Mixture((np.arange(3),), (0.0,))
  with pytest.raises(ValueError, match="questions"):
    Mixture((np.arange(3), np.arange(0)), (1.0, 1.0))


# -- the phase config ------------------------------------------------------------------------------


def test_annealing_config_scales_group_size_length_and_bounds():
  cfg = tiny_config(
    "test",
    **{
      "anneal_phase.enabled": True,
      "anneal_phase.group_size": 16,
      "anneal_phase.max_new_tokens": 9,
    },
  )
  a = annealing(cfg)
  assert (a.rollout.group_size, a.rollout.max_new_tokens) == (16, 9)
  assert a.num_rollouts == 4 * cfg.num_rollouts
  # Bounds keep their shape around the new G (×4): DynaMO [2, 8] → [8, 32], E3 floor/cap 2/12 → 8/48.
  assert (a.allocation.g_min, a.allocation.g_max) == (8, 32)
  assert (a.allocation.e3.g_min_floor, a.allocation.e3.g_max_cap) == (8, 48)
  assert not a.anneal_phase.enabled


def _anneal_start(cfg) -> int:
  return anneal_start(
    anneal_phase=cfg.anneal_phase, clip=cfg.clip, temperature=cfg.temperature, steps=cfg.steps
  )


def test_phase_start_follows_the_entropy_schedule():
  on = {"anneal_phase.enabled": True}
  assert _anneal_start(tiny_config("test", steps=10, **on)) == 6  # ⌊0.6·T⌋
  es = tiny_config(
    "es,test", steps=10, **on, **{"clip.schedule": "stable_then_anneal", "clip.rho": 0.25}
  )
  assert _anneal_start(es) == 8  # ⌈(1−ρ)·T⌉
  assert (
    _anneal_start(tiny_config("e3,test", steps=10, **on, **{"temperature.anneal_start": 3})) == 3
  )
  explicit = tiny_config("test", steps=10, **on, **{"anneal_phase.start": 2})
  phases = run_phases(explicit)
  assert [p.start for p in phases] == [0, 2]
  assert [phase_at(phases, s).index for s in range(4)] == [0, 0, 1, 1]
  assert len(run_phases(tiny_config("test"))) == 1


@pytest.mark.parametrize(
  "overrides, field",
  [
    ({"anneal_phase.mixture": "2x1+:0"}, "anneal_phase.mixture"),
    ({"anneal_phase.mixture": "2x1+:heavy"}, "anneal_phase.mixture"),
    ({"anneal_phase.start": -1}, "anneal_phase.start"),
    ({"anneal_phase.max_new_tokens": -4}, "anneal_phase.max_new_tokens"),
    ({"anneal_phase.group_size": 5, "loss.micro_batches": 8}, "anneal_phase.group_size"),
  ],
)
def test_bad_phase_config_names_the_field(overrides, field):
  with pytest.raises(ConfigError) as e:
    tiny_config("test", **{"anneal_phase.enabled": True, **overrides})
  assert e.value.field == field, e.value


def test_unknown_mixture_level_fails_before_compiling(tmp_path):
  cfg = tiny_config("test", **{"anneal_phase.enabled": True, "anneal_phase.mixture": "9x9+"})
  with pytest.raises(ConfigError, match="unknown level '9x9\\+'"):
    Trainer.open(cfg, str(tmp_path))


# -- a run through the switch ----------------------------------------------------------------------


def _anneal_cfg(preset: str, steps: int):
  # Phase from step index 3 (metrics step 4): only level 2+1, G 4 → 8, responses 4 → 8 tokens.
  return tiny_config(f"{preset},test,anneal", steps=steps, **{"anneal_phase.start": 3})


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["grpo", "all"])
def test_run_switches_phase_and_compiles_once(tmp_path, preset):
  cfg = _anneal_cfg(preset, 6)
  assert cfg.anneal_phase.mixture == "2x1+"
  trainer = Trainer.open(cfg, str(tmp_path))
  result = trainer.run()
  rows = read_metrics(tmp_path)
  with open(tmp_path / "metrics.jsonl") as f:
    compiles = [json.loads(line) for line in f]
  assert [r["phase"] for r in rows] == [0, 0, 0, 1, 1, 1]
  assert [r["group_size"] for r in rows] == [4, 4, 4, 8, 8, 8]
  assert [r["max_new_tokens"] for r in rows] == [4, 4, 4, 8, 8, 8]
  for r in rows:
    assert sum(np.asarray(r["alloc_hist"]) * np.arange(len(r["alloc_hist"]))) == 4 * r["group_size"]
  # One compile of the train step and one of the sampler per phase; none within a phase.
  for key in ("compiles_update", "compiles_sampler"):
    values = [r[key] for r in compiles]
    assert values[:3] == [values[0]] * 3 and values[3:] == [values[3]] * 3, (key, values)
  assert compiles[3]["compiles_update"] == compiles[0]["compiles_update"] + 1
  assert compiles[3]["compiles_sampler"] == compiles[0]["compiles_sampler"] + 1
  # From the switch on, only questions of the phase's mixture (level 2+1) were sampled.
  task = trainer.task
  last_step_Q = np.asarray(result.rl.stats.last_step_Q)
  sampled_late = np.flatnonzero(last_step_Q >= 3)
  assert len(sampled_late) and set(task.train_levels[sampled_late]) == {task.level_index("2x1+")}


@pytest.mark.slow
def test_resume_at_and_after_the_phase_boundary_continues_exactly(tmp_path):
  # E3 allocation re-ranks at the switch; no schedule depends on `steps`, so shorter runs of the
  # same config stop where the longer one passes: at the boundary (3) and inside the phase (5).
  cfg = lambda steps: tiny_config(
    "grpo,test,anneal", steps=steps, **{"anneal_phase.start": 3, "allocation.method": "e3"}
  )
  straight = Trainer.open(cfg(6), str(tmp_path / "straight")).run().rl
  for steps in (3, 5, 6):
    resumed = Trainer.open(cfg(steps), str(tmp_path / "resumed")).run().rl
  assert read_metrics(tmp_path / "straight") == read_metrics(tmp_path / "resumed")
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(straight.stats), jax.tree.leaves(resumed.stats)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
