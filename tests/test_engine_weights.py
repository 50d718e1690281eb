"""Weights enter a rollout engine one way: each sampling call names its params and their int
version (``engine.generate(params, version, request)``, from ``Collector.sample`` and
``run/heldout.py: engine_sampler``), so no sample reads weights someone else set, nor params an
update has donated since."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import step_context, tiny_config

from jaxrl.config import forget_config
from jaxrl.nn import arch
from jaxrl.rollout.eepo import two_stage_rollouts
from jaxrl.rollout.engine import (
  JaxEngine,
  SampleRequest,
  check_version,
  eval_version,
  forget_version,
  is_step_version,
)
from jaxrl.rollout.hosts import PerHostEngine
from jaxrl.run.heldout import engine_sampler
from jaxrl.run.loop import initial_loop, rl_step

NOT_VERSIONS = ("0", "eval", "0-forget", 0.0, True, None)


class Recording(JaxEngine):
  """A JAX engine that records the versions it is given."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.versions = []

  def generate(self, params, version, request):
    self.versions.append(version)
    return super().generate(params, version, request)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  cfg = tiny_config("test")
  ctx, params = step_context(cfg, tmp_path_factory.mktemp("run") / "tokenizer")
  return ctx, params


def _engine(ctx, cls=JaxEngine):
  mcfg = arch.model_config(ctx.cfg.model, ctx.task.vocab_size)
  return cls(
    ctx.programs.graphdef,
    mcfg,
    max_new_tokens=ctx.cfg.rollout.max_new_tokens,
    eos_id=ctx.task.eos_id,
    pad_id=ctx.task.pad_id,
  )


def _prompts(ctx):
  b = ctx.cfg.batch_questions
  counts_B = np.full(b, ctx.cfg.rollout.group_size, np.int32)
  return ctx.task.train_prompt_ids[:b], ctx.task.train_prompt_mask[:b], counts_B


def test_versions_are_ints_and_the_special_ones_never_collide():
  steps = range(1000)
  evals, forgets = {eval_version(s) for s in steps}, {forget_version(s) for s in steps}
  assert len(evals) == len(forgets) == len(steps) and not evals & forgets
  assert all(is_step_version(s) for s in steps)
  assert not any(is_step_version(v) for v in evals | forgets)
  assert check_version(np.int64(3)) == 3 and type(check_version(np.int64(3))) is int
  for bad in NOT_VERSIONS:
    with pytest.raises(TypeError, match="weight version is an int"):
      check_version(bad)
    with pytest.raises(TypeError, match="weight version is an int"):
      eval_version(bad)


def test_the_jax_engine_refuses_a_non_int_version(run):
  ctx, params = run
  engine = _engine(ctx)
  ids, mask, counts_B = _prompts(ctx)
  request = SampleRequest(ids, mask, counts_B, jax.random.PRNGKey(0), 1.0)
  collector = dataclasses.replace(ctx.collector, engine=engine)
  for bad in NOT_VERSIONS:
    for generate in (engine.generate, PerHostEngine(engine).generate):
      with pytest.raises(TypeError, match="weight version is an int"):
        generate(params, bad, request)
    with pytest.raises(TypeError, match="weight version is an int"):
      collector.sample(params, bad, ids, mask, counts_B, 1.0, jax.random.PRNGKey(0), 4)
  with pytest.raises(TypeError, match="weight version is an int"):
    engine_sampler(engine, params, "eval", lambda out: [], 1.0)(ids, mask, counts_B, None, True)


def test_no_sample_reads_params_an_update_donated(run):
  """Step 0 samples from the train state's own params (inline: no copy), which its update
  donates. The engine keeps no reference to them: the next sample names its params, and asking
  for a sample from the donated ones is an error saying so."""
  ctx, params = run
  loop = initial_loop(ctx, ctx.programs.init_state(params))
  sampled_from = loop.train.params
  first, _ = rl_step(ctx, loop, 0)
  engine = ctx.collector.engine
  assert all(x.is_deleted() for x in jax.tree.leaves(sampled_from))
  ids, mask, counts_B = _prompts(ctx)
  key, n = jax.random.PRNGKey(3), ctx.cfg.rollout.max_new_tokens
  with pytest.raises(RuntimeError, match="version 0 were donated"):
    engine.generate(sampled_from, 0, SampleRequest(ids, mask, counts_B, key, 1.0))
  theta_1 = jax.tree.map(jnp.copy, first.train.params)  # step 1's update donates first's
  second, row = rl_step(ctx, first, 1)
  assert int(second.train.step) == 2 and np.isfinite(row["loss"])
  # Step 1 sampled from first's params, donated by its update since: a sample of θ_1 is θ_1's.
  out = ctx.collector.sample(theta_1, 1, ids, mask, counts_B, 1.0, key, n)
  fresh = dataclasses.replace(ctx.collector, engine=_engine(ctx))
  want = fresh.sample(theta_1, 1, ids, mask, counts_B, 1.0, key, n)
  for got, expected in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("fire", [True, False], ids=["forget", "no-forget"])
def test_eepo_samples_stage_2_under_the_forget_version(run, fire):
  ctx, params = run
  engine = _engine(ctx, Recording)
  collector = dataclasses.replace(ctx.collector, engine=engine)
  ids, mask, counts_B = _prompts(ctx)
  two = two_stage_rollouts(
    collector,
    lambda state, h: (jnp.asarray(fire), state),
    None,
    params,
    ids,
    mask,
    counts_B,
    1.0,
    jax.random.PRNGKey(0),
    version=4,
    max_new_tokens=ctx.cfg.rollout.max_new_tokens,
    forget=forget_config(ctx.cfg.eepo, ctx.cfg.loss),
    old_logp_from="rollout",
  )
  assert two.metrics["eepo_gate"] == float(fire)
  assert engine.versions == [4, forget_version(4) if fire else 4]
  assert all(type(v) is int for v in engine.versions)


def test_evaluation_names_its_weights_in_each_sample(run):
  ctx, params = run
  engine = _engine(ctx, Recording)
  ids, mask, counts_B = _prompts(ctx)
  sample_fn = engine_sampler(engine, params, eval_version(3), lambda out: [], 1.0)
  for greedy in (False, True):
    sample_fn(ids, mask, counts_B, jax.random.PRNGKey(0), greedy)
  assert engine.versions == [eval_version(3)] * 2 == [-7, -7]
