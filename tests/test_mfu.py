"""train_mfu: XLA's FLOPs of the update (counted on the unrolled layers) over its time and the
devices' peak; the peak from the config or the device kind, none on CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from run_helpers import step_context, tiny_config

from jaxrl.nn import arch, model
from jaxrl.parallel import sharding
from jaxrl.run import mfu
from jaxrl.run.loop import initial_loop, rl_step


@pytest.mark.parametrize(
  "kind, tflops",
  [
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0),  # the longer name wins
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("TPU v5 lite", 197.0),
    ("cpu", None),
  ],
)
def test_peak_from_the_device_kind(kind, tflops):
  assert mfu.peak_flops(0.0, kind) == (None if tflops is None else tflops * 1e12)
  assert mfu.peak_flops(2.5, kind) == 2.5e12  # a configured peak wins


def test_update_flops_count_every_layer_and_match_six_n_tokens():
  cfg = tiny_config("", **{"sft.steps": 0})
  mesh = sharding.make_mesh(1, 1, 1)
  loop_flops = mfu.update_flops(cfg, 64, mesh)
  scan_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
  assert mfu.update_flops(scan_cfg, 64, mesh) == loop_flops  # a scanned body would count once
  _, params = model.abstract(arch.model_config(cfg.model, 64))
  n = model.num_params(params)
  prompt_len = 13  # the tiny task's longest prompt (12 tokens) + BOS
  tokens = cfg.num_rollouts * (prompt_len + cfg.rollout.max_new_tokens)
  assert 1.0 < loop_flops / (6 * n * tokens) < 1.3  # matmuls + attention, recompute included


def test_a_known_peak_logs_train_mfu(tmp_path):
  cfg = tiny_config("test", **{"sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop = initial_loop(ctx, ctx.programs.init_state(params))
  copy = lambda x: jax.tree.map(jnp.copy, x)  # noqa: E731 (rl_step donates the train state)
  _, row = rl_step(ctx, copy(loop), 0)
  assert "train_mfu" not in row  # CPU: no peak known
  ctx = dataclasses.replace(ctx, peak_flops=1e9)
  _, row = rl_step(ctx, copy(loop), 0)
  useful = row["train_tok_s"] / row["train_raw_tok_s"]  # the share of positions not padding
  expected = ctx.update_flops(0) * useful / row["update_seconds"] / 1e9
  assert row["train_mfu"] == pytest.approx(expected, rel=1e-6) and row["train_mfu"] > 0
