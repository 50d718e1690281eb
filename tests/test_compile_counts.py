"""The compile counts of a step's metrics row (``compiles_update``, ``compiles_sampler``) follow the
programs the trainer runs.

JAX names a trace after the function it traces; the trainer's counter (``run/loop.py:
compile_counter``) holds those functions by reference (``COUNTED_PROGRAMS``), not by name. A
program renamed, wrapped in another function or replaced without the counter following leaves its
count at 0, which fails here.
"""

from __future__ import annotations

import jax
import numpy as np
from run_helpers import rollouts, tiny_config

from jaxrl.config import loss_config
from jaxrl.nn import model
from jaxrl.parallel import sharding
from jaxrl.rl import optim
from jaxrl.rl.losses import LossHparams
from jaxrl.rl.programs import Programs
from jaxrl.rollout.engine import JaxEngine, SampleRequest
from jaxrl.run.context import COUNTED_PROGRAMS, compile_counter

# A vocabulary no other test's model has: the sampler (one jitted function for the process, its
# model config a static argument) traces afresh here whatever ran before.
VOCAB = 27


def _batch(cfg, n: int):
  rng = np.random.default_rng(0)
  rows, p = cfg.num_rollouts, 3
  mask = np.arange(n)[None, :] < rng.integers(1, n + 1, (rows, 1))
  return rollouts(
    prompt_ids_RxP=rng.integers(0, VOCAB, (rows, p)).astype(np.int32),
    prompt_mask_RxP=np.ones((rows, p), bool),
    tokens_RxN=rng.integers(0, VOCAB, (rows, n)).astype(np.int32),
    mask_RxN=mask,
    behaviour_logp_RxN=np.where(mask, -rng.random((rows, n)) - 0.5, 0.0),
    rewards_R=np.tile([1.0, 0.0], rows // 2),
    group_ids_R=np.repeat(np.arange(cfg.batch_questions), cfg.rollout.group_size),
  )


def test_the_counter_counts_the_update_and_the_sampler_the_trainer_runs():
  cfg = tiny_config("test", **{"rollout.max_new_tokens": 3})
  n = cfg.rollout.max_new_tokens
  mcfg = model.ModelConfig(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=8,
  )  # fmt: skip
  graphdef, params = model.create(mcfg, 0)
  programs = Programs(graphdef, params, sharding.make_mesh(1, 1, 1), optim.from_config(cfg.optim))
  engine = JaxEngine(graphdef, mcfg, max_new_tokens=n, eos_id=1, pad_id=0)
  counter = compile_counter().start()
  try:
    update = programs.update(loss_config(cfg))  # as the loop builds it
    for eps_high in (0.28, 0.3):  # a traced value: the second step compiles nothing
      hp = LossHparams.from_config(cfg.loss, cfg.modulation, 1.0, eps_high)
      update(programs.init_state(params), _batch(cfg, n), hp)
    b = cfg.batch_questions
    for temperature in (1.0, 0.7):
      request = SampleRequest(
        np.full((b, 3), 2, np.int32),
        np.ones((b, 3), bool),
        np.full(b, cfg.rollout.group_size),
        jax.random.PRNGKey(int(10 * temperature)),
        temperature,
      )
      engine.generate(params, 0, request)
  finally:
    counter.stop()
    engine.close()
  assert counter.counts() == {"compiles_update": 1, "compiles_sampler": 1}, counter.counts()
  assert set(COUNTED_PROGRAMS) == {"compiles_update", "compiles_sampler"}
