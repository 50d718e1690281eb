"""Run as a script with 8 fake CPU devices: one GRPO step on a (data 1, fsdp 4, tensor 2) mesh must
equal the same step on one device, up to the rounding of its reordered sums. Prints, as JSON, how
far each difference stays inside its derived bound (the test asserts).
``--lora``: the model has rank-4 adapters (B moved off zero, so A gets gradients too); the update
trains them alone and the KL reference is the base (adapters off). ``--packed``: prompts of mixed
lengths, and the sharded step runs packed (``rl.packing``, docs/algorithms.md §1.6): the packed
buffers' rows split over the mesh as the rows are."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from rounding import U, grad_rtol  # noqa: E402
from run_helpers import moved_adapters, rollouts  # noqa: E402

from jaxrl.nn import lora, model
from jaxrl.parallel import sharding
from jaxrl.rl import (  # noqa: E402
  advantages,
  losses,
  packing,
  scoring,
  step,
)


def run_on(mesh, params_host, batch_host, tx, cfg, graphdef, hp, steps=1, pack=None):
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
  pack = None if pack is None else sharding.shard_batch(pack, mesh)
  for _ in range(steps):
    state, metrics = update(state, sharding.shard_batch(batch_host, mesh), hp, ref, pack)
  specs = {
    jax.tree_util.keystr(k): str(v.sharding.spec)
    for k, v in jax.tree_util.tree_leaves_with_path(state.params)
  }
  return jax.device_get(state.params), jax.device_get(metrics), specs


def _metric_scales(graphdef, params, batch, hp, groups, trainable_ref):
  """The magnitude Σ|term| (aggregated as the loss aggregates: seq-mean-token-mean) of the terms
  each float metric sums, where they may cancel: the surrogate's |ρ·A|, the k3 KL's e^d + |d| + 1
  (d = ℓ_ref − ℓ), the entropy bonus's H; and their sum for the loss."""
  f32 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  args = (batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN, batch.mask_RxN)
  logp, ent = scoring.logp_responses(graphdef, params, *args, hp.tau, 4)
  ref = jax.tree.map(lambda x: x * 0.98, params) if not trainable_ref else None
  ref_logp, _ = scoring.logp_responses(
    graphdef, ref if ref is not None else lora.without_adapters(params), *args, hp.tau, 4
  )
  adv = f32(advantages.group_advantages(batch.rewards_R, batch.group_ids_R, groups))[:, None]
  mask = f32(batch.mask_RxN)
  lp, d, h = f32(logp), f32(ref_logp) - f32(logp), f32(ent)
  rho = np.exp(np.where(mask > 0, lp - f32(batch.behaviour_logp_RxN), 0.0))
  kl_terms = np.exp(np.where(mask > 0, d, 0.0)) + np.abs(d) + 1

  def agg(x):
    rows = mask.sum(1) > 0
    per_row = (np.where(mask > 0, x, 0.0).sum(1) / np.maximum(mask.sum(1), 1))[rows]
    return float(per_row.sum() / max(rows.sum(), 1))

  beta, lam = float(hp.kl_coef), float(hp.entropy_coef)
  pg, kl_loss, ent_loss = agg(rho * np.abs(adv)), beta * agg(kl_terms), lam * agg(h)
  tokens = max(mask.sum(), 1)
  return {
    "pg_loss": pg,
    "kl_loss": kl_loss,
    "loss": pg + kl_loss + ent_loss,
    "kl": float(np.where(mask > 0, kl_terms, 0.0).sum() / tokens),
  }


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
    rope_theta=1e6,
    tie_embeddings=False,
    lora_rank=4 if "--lora" in sys.argv else 0,
  )
  graphdef, params = model.create(mcfg, 0)
  params = jax.device_get(params)
  if mcfg.lora_rank:  # trained adapters: B off zero
    params = moved_adapters(params, 0.1)
  leaves0 = [np.asarray(x) for x in jax.tree.leaves(params)]
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
  pack = None
  if "--packed" in sys.argv:  # left-padded prompts of 1..P/2 tokens: sequences share buffers
    prompt_R = rng.integers(1, P // 2 + 1, R)
    batch = dataclasses.replace(batch, prompt_mask_RxP=np.arange(P)[None] >= P - prompt_R[:, None])
    pack = packing.plan(batch.prompt_mask_RxP, batch.mask_RxN, 1, 2, buckets=4)
    assert pack.rows < R // 2, pack  # buffers shared
  cfg = losses.LossConfig(
    aggregation="seq-mean-token-mean",
    use_kl=True,
    kl_estimator="k3",
    informative_only=False,
    num_groups=B,
    micro_batches=2,
  )
  hp = losses.LossHparams.create(
    eps_low=0.2, eps_high=0.28, kl_coef=0.05, entropy_coef=0.01, tau=0.8
  )
  one, eight = sharding.make_mesh(1, 1, 1), sharding.make_mesh(1, 4, 2)
  # The mesh splits the sums (the fsdp and tensor shards' partial dots, the all-reduces) into
  # another order: the sharded step and the 1-device one are two evaluations of the same chain of
  # sums, the gradients within ``grad_rtol`` of a leaf's largest entry (tests/rounding.py).
  rtol = grad_rtol(mcfg, P + N, R * (P + N))
  # SGD: the update is the gradient itself, so every parameter leaf (biases included) compares the
  # sharded gradient with the 1-device one: lr·g = p0 − p, up to one ulp of p (the subtraction's
  # rounding, half an ulp each way).
  lr, sgd = 0.1, optax.sgd(0.1)
  p1, m1, _ = run_on(one, params, batch, sgd, cfg, graphdef, hp)
  p8, m8, specs = run_on(eight, params, batch, sgd, cfg, graphdef, hp, pack=pack)
  step_g = [np.abs(np.asarray(a) - np.asarray(p0)) for a, p0 in zip(jax.tree.leaves(p1), leaves0)]
  sgd_ratio = max(
    float(np.max(np.abs(a - b)) / (rtol * np.max(g) + np.spacing(np.max(np.abs(a)))))
    for a, b, g in zip(jax.tree.leaves(p1), jax.tree.leaves(p8), step_g)
  )
  # AdamW with sharded moments, on the same gradients. Adam's first step is lr·g/(|g| + ε) (the
  # moments' bias corrections undo their decay up to a few u): its slope in g is at most lr/ε,
  # so gradients off by Δ move a weight by ≤ (lr/ε)·Δ, plus 4u·lr and one ulp of the weight.
  adam_lr, adam_eps = 1e-2, 1e-3
  adam = optax.adamw(adam_lr, eps=adam_eps)
  a1, _, _ = run_on(one, params, batch, adam, cfg, graphdef, hp)
  a8, _, _ = run_on(eight, params, batch, adam, cfg, graphdef, hp, pack=pack)
  adam_bound = lambda g, a: (  # noqa: E731
    adam_lr / adam_eps * rtol * np.max(g) / lr + 4 * U * adam_lr + np.spacing(np.max(np.abs(a)))
  )
  adam_ratio = max(
    float(np.max(np.abs(a - b)) / adam_bound(g, a))
    for a, b, g in zip(jax.tree.leaves(a1), jax.tree.leaves(a8), step_g)
  )
  # The metrics: sums over the tokens, each a chain's rounding (``rtol``) of the magnitude of its
  # terms, which may cancel: the surrogate's ρ·A, the k3 KL's e^d, d and 1, the entropies.
  scale = _metric_scales(graphdef, params, batch, hp, B, trainable_ref=mcfg.lora_rank > 0)
  bound = {k: rtol * (abs(float(m1[k])) + scale.get(k, 0.0)) for k in m1}
  metric_ratio = {
    k: float(np.abs(np.asarray(m1[k]) - np.asarray(m8[k])) / bound[k]) if bound[k] else 0.0
    for k in m1
  }
  # A metric that is 0 (and so has no scale) must be 0 on both meshes.
  assert all(float(m1[k]) == float(m8[k]) for k in m1 if not bound[k]), (m1, m8)
  # The base's fingerprint (what a LoRA checkpoint records) does not depend on the mesh.
  on_eight = jax.device_put(params, sharding.tree_shardings(params, eight))
  same_fingerprint = lora.fingerprint(on_eight) == lora.fingerprint(params)
  print(
    json.dumps(
      {
        "same_fingerprint": same_fingerprint,
        # Each difference over its derived bound (at most 1: inside).
        "sgd_leaf_ratio": sgd_ratio,
        "adam_leaf_ratio": adam_ratio,
        "metric_ratio": metric_ratio,
        "specs": specs,
        "kl": float(m1["kl"]),
      }
    )
  )


if __name__ == "__main__":
  main()
