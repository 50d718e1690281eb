"""Methods are found by name (``jaxrl.methods.registry``): a new allocator is its own factory plus
one registry line, and it reaches the loop's allocation without touching config or loop code."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import read_metrics, tiny_config

from jaxrl.config import ConfigError
from jaxrl.methods import allocation, registry
from jaxrl.run.components import phase_methods
from jaxrl.run.train import Trainer


def front_loaded_allocator(a, g: int) -> allocation.Allocator:
  """A toy allocator: the first question of the batch gets every rollout beyond one per question."""
  del a

  def allocate(state, stats, question_ids_B):
    del state, stats
    b = question_ids_B.shape[0]
    return jnp.ones((b,), jnp.int32).at[0].add(b * (g - 1))

  return allocation.Allocator(
    init=lambda num_questions: allocation.UniformAllocState(),
    on_epoch_end=lambda state, stats, epoch: state,
    allocate=allocate,
  )


def test_a_registered_allocator_is_used_by_the_methods_and_the_loop(monkeypatch, tmp_path):
  monkeypatch.setitem(registry.ALLOCATORS, "front", front_loaded_allocator)  # the one line
  cfg = tiny_config("test", steps=1, **{"allocation.method": "front", "sft.steps": 0})
  methods = phase_methods(cfg, vocab_size=32)
  state = methods.init(10)
  counts = np.asarray(methods.allocate(state, None, jnp.arange(cfg.batch_questions)))
  g, b = cfg.rollout.group_size, cfg.batch_questions
  assert counts.tolist() == [1 + b * (g - 1)] + [1] * (b - 1) and counts.sum() == b * g
  # Through one RL step of the loop: the step's allocation histogram is the toy's.
  with Trainer.open(cfg, str(tmp_path)) as trainer:
    trainer.rl(trainer.init_params())
  (row,) = read_metrics(tmp_path)
  assert row["alloc_max"] == 1 + b * (g - 1) and row["alloc_min"] == 1


@pytest.mark.parametrize("field", ["allocation.method", "temperature.method", "clip.method"])
def test_an_unregistered_method_is_a_one_line_config_error(field):
  cfg = tiny_config("test", **{field: "nope"})
  with pytest.raises(ConfigError, match=rf"^config\.{field}: 'nope' is not one of \("):
    registry.check(allocation=cfg.allocation, temperature=cfg.temperature, clip=cfg.clip)
