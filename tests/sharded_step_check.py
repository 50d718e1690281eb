"""Run as a script with 8 fake CPU devices: one GRPO step on a (data 1, fsdp 4, tensor 2) mesh must
equal the same step on one device. Prints the max relative differences as JSON (the test asserts).
``--lora``: the model has rank-4 adapters (B moved off zero, so A gets gradients too); the update
trains them alone and the KL reference is the base (adapters off)."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from run_helpers import moved_adapters, rollouts  # noqa: E402

from jaxrl.nn import lora, model
from jaxrl.parallel import sharding
from jaxrl.rl import (
  losses,
  step,  # noqa: E402
)


def run_on(mesh, params_host, batch_host, tx, cfg, graphdef, hp, steps=1):
  trainable = lora.policy_trainable(params_host)
  p_sh = sharding.tree_shardings(params_host, mesh)
  trained = lora.partition(params_host, trainable)[0]
  state_sh = step.TrainState(
    step=sharding.replicated(mesh),
    params=p_sh,
    opt_state=sharding.tree_shardings(jax.eval_shape(tx.init, trained), mesh),
  )
  params = jax.device_put(params_host, p_sh)
  # The frozen KL reference: a perturbed copy, so the KL term is non-zero (LoRA: the base).
  ref = None
  if trainable == "all":
    ref = jax.device_put(jax.tree.map(lambda x: x * 0.98, params_host), p_sh)
  init = functools.partial(step.init_state, tx=tx, trainable=trainable)
  state = jax.jit(init, out_shardings=state_sh)(params)
  update = jax.jit(
    functools.partial(step.rl_update, graphdef, tx, cfg, trainable=trainable),
    donate_argnums=(0,),
    out_shardings=(state_sh, None),
  )
  for _ in range(steps):
    state, metrics = update(state, sharding.shard_batch(batch_host, mesh), hp, ref)
  specs = {
    jax.tree_util.keystr(k): str(v.sharding.spec)
    for k, v in jax.tree_util.tree_leaves_with_path(state.params)
  }
  return jax.device_get(state.params), jax.device_get(metrics), specs


def main():
  assert len(jax.devices()) == 8, jax.devices()
  mcfg = model.ModelConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    lora_rank=4 if "--lora" in sys.argv else 0,
  )
  graphdef, params = model.create(mcfg, 0)
  params = jax.device_get(params)
  if mcfg.lora_rank:  # trained adapters: B off zero
    params = moved_adapters(params, 0.1)
  rng = np.random.default_rng(0)
  R, P, N, B = 16, 6, 5, 4
  batch = rollouts(
    prompt_ids_RxP=rng.integers(0, 64, (R, P)).astype(np.int32),
    prompt_mask_RxP=np.ones((R, P), bool),
    tokens_RxN=rng.integers(0, 64, (R, N)).astype(np.int32),
    mask_RxN=np.arange(N)[None, :] < rng.integers(1, N + 1, (R, 1)),
    behaviour_logp_RxN=(-rng.random((R, N)) * 3).astype(np.float32),
    rewards_R=rng.integers(0, 2, R).astype(np.float32),
    group_ids_R=np.repeat(np.arange(B), R // B).astype(np.int32),
  )
  cfg = step.RLStepConfig(
    loss=losses.LossConfig(aggregation="seq-mean-token-mean", use_kl=True, kl_estimator="k3"),
    num_groups=B,
    micro_batches=2,
  )
  f32 = jnp.float32
  hp = step.StepHparams(
    loss=losses.LossHparams(
      eps_low=f32(0.2), eps_high=f32(0.28), kl_coef=f32(0.05), entropy_coef=f32(0.01)
    ),
    tau=f32(0.8),
  )
  one, eight = sharding.make_mesh(1, 1, 1), sharding.make_mesh(1, 4, 2)
  rel = lambda a, b: float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-12))
  # SGD: the update is the gradient itself, so every parameter leaf (biases included) compares the
  # sharded gradient with the 1-device one.
  sgd = optax.sgd(0.1)
  p1, m1, _ = run_on(one, params, batch, sgd, cfg, graphdef, hp)
  p8, m8, specs = run_on(eight, params, batch, sgd, cfg, graphdef, hp)
  sgd_leaf_diff = max(rel(a, b) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)))
  metric_diff = {k: rel(np.asarray(m1[k]), np.asarray(m8[k])) for k in m1}
  # AdamW with sharded moments. Adam's first step is lr·g/(|g|+eps): where |g| is near rounding
  # level it amplifies reduction-order noise, so it is compared over the whole tree, not per leaf.
  adam = optax.adamw(1e-2, eps=1e-3)
  a1, _, _ = run_on(one, params, batch, adam, cfg, graphdef, hp)
  a8, _, _ = run_on(eight, params, batch, adam, cfg, graphdef, hp)
  leaves1, leaves8 = jax.tree.leaves(a1), jax.tree.leaves(a8)
  adam_tree_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves1, leaves8)) / max(
    float(np.max(np.abs(a))) for a in leaves1
  )
  # The base's fingerprint (what a LoRA checkpoint records) does not depend on the mesh.
  on_eight = jax.device_put(params, sharding.tree_shardings(params, eight))
  same_fingerprint = lora.fingerprint(on_eight) == lora.fingerprint(params)
  print(
    json.dumps(
      {
        "same_fingerprint": same_fingerprint,
        "sgd_leaf_rel_diff": sgd_leaf_diff,
        "adam_tree_rel_diff": adam_tree_diff,
        "metric_rel_diff": metric_diff,
        "specs": specs,
        "kl": float(m1["kl"]),
      }
    )
  )


if __name__ == "__main__":
  main()
