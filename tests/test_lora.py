"""LoRA: a fresh adapter computes the base model exactly; an update moves the adapters only (no
gradient, no optimizer state, no change for any base leaf); the KL reference is the base; EEPO's
θ' moves the adapters; merged weights compute the adapted model; scanned layers and bfloat16 base
params work; a checkpoint keeps the adapters and refuses another base."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rounding import U, chain_terms
from run_helpers import SMALL_MODEL, moved_adapters, random_batch, update_hparams

from jaxrl.nn import lora, model, model_config
from jaxrl.rl import losses, optim, scoring, step
from jaxrl.rl.forget import eepo_forget

LORA = dataclasses.replace(SMALL_MODEL, lora_rank=4, lora_alpha=8.0)


def _paths(tree) -> set[tuple]:
  return {path for path, _ in nnx.to_flat_state(tree)}


def _hidden(graphdef, params, seed=0):
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 32, (3, 7)), jnp.int32)
  valid = jnp.ones_like(tokens)
  return model.forward(graphdef, params, tokens, model.positions_from_mask(valid), valid)[0]


def _hidden_atol(cfg, want):
  """Merged weights W + s·B·A and the adapter path x·Wᵀ + s·(x·Aᵀ)·Bᵀ are the same function summed
  in other orders (and the merged kernel rounded once more): two forwards of the LoRA model over
  the 7 tokens, up to the final norm's output (the head's D terms not taken), within twice
  ``chain_terms`` (which counts each adapted projection's r + 2 extra terms) of the values' scale."""
  scale = float(np.max(np.abs(np.asarray(want, np.float64))))
  return 2 * (chain_terms(cfg, 7) - cfg.hidden_size) * U * scale


def _with_random_b(params, seed=1):
  """The adapters with non-zero B (as after training), so the adapter path is exercised."""
  return moved_adapters(params, 0.3, seed)


def test_a_fresh_adapter_computes_the_base_model_exactly():
  g0, base = model.create(SMALL_MODEL, 3)
  g1, adapted = model.create(LORA, 3)
  # The base weights of a seed do not depend on the rank (A draws from its own stream).
  _, base_part = lora.partition(adapted, "adapters")
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(base_part)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(_hidden(g0, base), _hidden(g1, adapted))
  names = {str(p[-1]) for p in _paths(lora.partition(adapted, "adapters")[0])}
  assert names == {f"{t}_proj_lora_{x}" for t in model_config.LORA_TARGETS for x in "ab"}


def test_targets_choose_the_projections():
  cfg = dataclasses.replace(LORA, lora_targets=("q", "down"))
  _, params = model.create(cfg, 0)
  adapters = lora.partition(params, "adapters")[0]
  assert {str(p[-1]) for p in _paths(adapters)} == {
    "q_proj_lora_a",
    "q_proj_lora_b",
    "down_proj_lora_a",
    "down_proj_lora_b",
  }
  leaf = adapters["layers"][0]["self_attn"]["q_proj_lora_a"]
  assert leaf.shape == (4, 32) and leaf.get_metadata()["logical_axes"] == ("lora", "embed")


def test_without_adapters_is_the_base_and_merged_is_the_adapted_model():
  g0, base = model.create(SMALL_MODEL, 5)
  g1, adapted = model.create(LORA, 5)
  trained = _with_random_b(adapted)
  h_trained = _hidden(g1, trained)
  assert float(jnp.max(jnp.abs(h_trained - _hidden(g0, base)))) > 1e-2  # the adapter acts
  np.testing.assert_array_equal(_hidden(g1, lora.without_adapters(trained)), _hidden(g0, base))
  merged = lora.merged(trained, LORA.lora_alpha, LORA.lora_rank)
  assert _paths(merged) == _paths(base)
  np.testing.assert_allclose(
    _hidden(g0, merged), h_trained, atol=_hidden_atol(LORA, h_trained), rtol=0
  )


def _update(cfg: model.ModelConfig, kl_coef=0.0, trainable=None, seed=0):
  graphdef, params = model.create(cfg, seed)
  tx = optim.adamw(1e-2, 0)
  trainable = trainable or lora.policy_trainable(params)
  step_cfg = losses.LossConfig(
    aggregation="token-mean",
    use_kl=kl_coef > 0,
    informative_only=False,
    num_groups=2,
    mini_batches=2,
  )
  hp = dataclasses.replace(update_hparams(), kl_coef=jnp.float32(kl_coef))
  state = step.init_state(params, tx, trainable)
  update = jax.jit(functools.partial(step.rl_update, graphdef, tx, step_cfg, trainable=trainable))
  batch = random_batch(np.random.default_rng(seed))
  new, metrics = update(state, batch, hp)
  return graphdef, params, state, new, metrics


def test_an_update_moves_the_adapters_only():
  _, params, state, new, metrics = _update(LORA)
  assert int(new.step) == 2 and int(metrics["nonfinite_updates"]) == 0
  adapter_paths = _paths(lora.partition(params, "adapters")[0])
  before, after = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(new.params))
  assert before.keys() == after.keys()
  for path in before:  # over the whole tree
    same = np.array_equal(np.asarray(before[path][...]), np.asarray(after[path][...]))
    if path in adapter_paths and str(path[-1]).endswith(lora.ADAPTER_B):
      assert not same, path  # B moves first (A's gradient is 0 while B = 0)
    elif path not in adapter_paths:
      assert same, path
  # Optimizer moments exist for the adapters only.
  moments = [
    s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, nnx.State))
  ]
  adam = [s for s in moments if isinstance(s, nnx.State)]
  assert adam and all(_paths(s) == adapter_paths for s in adam)
  n_adapter = sum(x.size for x in jax.tree.leaves(lora.partition(params, "adapters")[0]))
  n_state = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert n_state == 2 * n_adapter  # AdamW's mu and nu, nothing for the base


def test_gradients_exist_for_the_trained_part_only():
  graphdef, params = model.create(LORA, 0)
  params = _with_random_b(params)
  batch = random_batch(np.random.default_rng(0))

  def nll(p):
    logp, _ = scoring.logp_responses(
      graphdef, p, batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN,
      batch.mask_RxN, jnp.float32(1), 128,
    )  # fmt: skip
    return -jnp.sum(logp), None

  for trainable in ("adapters", "base", "all"):
    (_, _), grads = step.grad_of_part(nll, trainable)(params)
    assert _paths(grads) == _paths(lora.partition(params, trainable)[0]), trainable
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads)), trainable


def test_rank_zero_trains_everything():
  _, params, state, new, _ = _update(SMALL_MODEL)
  assert lora.policy_trainable(params) == "all"
  changed = [
    not np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new.params))
  ]
  assert all(changed)


def test_the_kl_reference_is_the_base_model():
  """At step 0 the policy is the base: its first mini-batch's KL is 0; the second (after an
  update of the adapters) is not. Same as passing the base model's params as the reference."""
  graphdef, params, state, new, m = _update(LORA, kl_coef=0.1)
  g0, base = model.create(SMALL_MODEL, 0)
  tx = optim.adamw(1e-2, 0)
  step_cfg = losses.LossConfig(
    aggregation="token-mean", use_kl=True, informative_only=False, num_groups=2, mini_batches=2
  )
  hp = dataclasses.replace(update_hparams(), kl_coef=jnp.float32(0.1))
  # The same update with the reference given as a separate copy of the base (rank-0 tree of the
  # same weights, merged with zero adapters so it fits the graph): identical metrics.
  ref = lora.combine(jax.tree.map(jnp.zeros_like, lora.partition(params, "adapters")[0]), base)
  state2 = step.init_state(params, tx, "adapters")
  new2, m2 = jax.jit(
    functools.partial(step.rl_update, graphdef, tx, step_cfg, trainable="adapters")
  )(state2, random_batch(np.random.default_rng(0)), hp, ref)
  assert float(m["kl"]) > 0
  np.testing.assert_array_equal(np.asarray(m["kl"]), np.asarray(m2["kl"]))
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(new2.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eepo_forgetting_moves_the_adapters_only():
  graphdef, params = model.create(LORA, 2)
  params = _with_random_b(params)
  batch = random_batch(np.random.default_rng(2))
  forget = jax.jit(
    functools.partial(
      eepo_forget, graphdef, 128, lr=0.5, eps_l=0.02, eps_r=0.02, trainable="adapters"
    )
  )
  theta2, value = forget(
    params, batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN, batch.mask_RxN,
    batch.loss_mask_RxN, jnp.float32(1),
  )  # fmt: skip
  adapters = _paths(lora.partition(params, "adapters")[0])
  moved = set()
  for path, v in nnx.to_flat_state(params):
    if not np.array_equal(
      np.asarray(v[...]), np.asarray(dict(nnx.to_flat_state(theta2))[path][...])
    ):
      moved.add(path)
  assert moved and moved <= adapters


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_scanned_layers_and_bfloat16_bases(param_dtype):
  """Scan mode stacks the adapters on the layer axis; with a bfloat16 base the adapters (and so
  their moments) stay float32; merged weights compute the adapted model in both layouts."""
  loop_cfg = dataclasses.replace(LORA, param_dtype=param_dtype)
  scan_cfg = dataclasses.replace(loop_cfg, scan_layers=True)
  g_loop, p_loop = model.create(loop_cfg, 4)
  g_scan, p_scan = model.create(scan_cfg, 4)
  p_loop, p_scan = _with_random_b(p_loop), _with_random_b(p_scan)
  a = p_scan["layers"]["mlp"]["up_proj_lora_a"]
  assert a.shape == (2, 4, 32) and a.get_metadata()["logical_axes"] == ("layers", "lora", "embed")
  assert a.dtype == jnp.float32
  assert p_scan["layers"]["mlp"]["up_proj"].dtype == jnp.dtype(param_dtype)
  _, _, state, new, metrics = _update(scan_cfg, seed=4)
  assert int(metrics["nonfinite_updates"]) == 0
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state) if x.ndim)
  # Each layout's merged weights (float32 kernels; the rest keeps its dtype) compute its model.
  for cfg, g, p in ((loop_cfg, g_loop, p_loop), (scan_cfg, g_scan, p_scan)):
    merged = lora.merged(p, LORA.lora_alpha, LORA.lora_rank)
    g_plain, _ = model.create(dataclasses.replace(cfg, lora_rank=0), 0)
    want = _hidden(g, p)
    np.testing.assert_allclose(_hidden(g_plain, merged), want, atol=_hidden_atol(cfg, want), rtol=0)


def test_merging_onto_a_bfloat16_base_keeps_small_updates():
  """An adapter update far below a bfloat16 kernel's precision (as after a few RL steps) must
  survive the merge: rounded to bfloat16 it would vanish, and the export would be the base."""
  cfg = dataclasses.replace(LORA, param_dtype="bfloat16")
  g, params = model.create(cfg, 5)
  small_b = moved_adapters(params, 1e-4, seed=2)
  base = lora.without_adapters(small_b)
  merged = lora.merged(small_b, cfg.lora_alpha, cfg.lora_rank)
  kernel = ("layers", 0, "mlp", "up_proj")
  w_bf16, w_merged = (dict(nnx.to_flat_state(t))[kernel][...] for t in (base, merged))
  assert w_merged.dtype == jnp.float32
  # rounded to bfloat16, nine entries in ten (all but some near 0) would be the base's again
  assert np.mean(np.asarray(w_merged.astype(jnp.bfloat16) != w_bf16)) < 0.1
  g_plain, _ = model.create(dataclasses.replace(cfg, lora_rank=0), 0)
  adapted, unadapted = _hidden(g, small_b), _hidden(g, base)
  atol = _hidden_atol(cfg, adapted)
  assert np.max(np.abs(adapted - unadapted)) > 10 * atol  # far above the tolerance below
  np.testing.assert_allclose(_hidden(g_plain, merged), adapted, atol=atol, rtol=0)


def test_fingerprint_tells_bases_apart():
  _, a = model.create(LORA, 0)
  _, b = model.create(LORA, 1)
  fa = lora.fingerprint(a)
  assert fa == lora.fingerprint(_with_random_b(a))  # adapters do not count
  assert fa != lora.fingerprint(b)

  def edit(params, change):
    flat = dict(nnx.to_flat_state(params))
    path = ("layers", 0, "mlp", "down_proj")
    flat[path] = flat[path].replace(change(flat[path][...]))
    return nnx.from_flat_state(flat)

  # One element one float32 ulp off; two elements swapped (the plain bit sum is unchanged); the
  # same values in bfloat16.
  one_ulp = edit(a, lambda w: w.at[0, 0].set(jnp.nextafter(w[0, 0], jnp.inf)))
  swapped = edit(a, lambda w: w.at[0, :2].set(w[0, 1::-1]))
  assert lora.fingerprint(one_ulp) != fa and lora.fingerprint(swapped) != fa
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), a)
  assert lora.fingerprint(bf16) != fa
  with pytest.raises(ValueError, match="another base model"):
    lora.check_base(fa, one_ulp, "ckpt")
  lora.check_base(fa, a, "ckpt")


def test_adamw_moments_match_the_adapter_tree():
  _, params = model.create(LORA, 0)
  tx = optim.adamw(1e-3, 0)
  state = step.init_state(params, tx, "adapters")
  grads = jax.tree.map(jnp.ones_like, lora.partition(params, "adapters")[0])
  new = step.apply_update(tx, state, grads, "adapters")
  assert int(new.step) == 1
  assert optax.global_norm(lora.partition(new.params, "adapters")[0]) != optax.global_norm(
    lora.partition(params, "adapters")[0]
  )
