"""ModelConfig's execution options change how the decoder runs, never what it computes.

scan_layers (stacked [L, ...] params + lax.scan) against the loop layout: the same seed gives the
same weights, and the same weights give the same logits, log-probs, sampled rollouts and GRPO
update. remat "full" / "dots" against "none": the same loss and gradients, with the recomputation
really in the program. param_dtype bfloat16: params stored in bf16 compute exactly like their
float32 upcast; a bf16-compute forward and backward run. Both layouts against transformers, and
bf16 checkpoints, are in test_hf_parity.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jaxpr_helpers import contains_primitive
from rounding import U, chain_terms, entropy_atol, grad_rtol, logp_atol
from run_helpers import rollouts

from jaxrl.nn import model
from jaxrl.parallel import sharding
from jaxrl.rl import losses, scoring, step
from jaxrl.rl.forget import eepo_forget
from jaxrl.rl.programs import Programs
from jaxrl.rollout import sampler
from jaxrl.run import plan_compile

# Qwen2-like (q/k/v biases), GQA, 3 layers so a wrong layer order or index shows.
LOOP = model.ModelConfig(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  rope_theta=1e6,
  tie_embeddings=False,
)
SCAN = dataclasses.replace(LOOP, scan_layers=True)
# The name of jax.checkpoint's primitive in a jaxpr (it has changed across jax versions).
_REMAT = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive.name
# Four left-padded prompts and right-padded responses.
R, P, N = 4, 5, 6
_rng = np.random.default_rng(0)
PROMPT_IDS = _rng.integers(1, 64, (R, P)).astype(np.int32)
PROMPT_MASK = np.arange(P)[None] >= np.array([0, 2, 4, 1])[:, None]
RESPONSE_IDS = _rng.integers(1, 64, (R, N)).astype(np.int32)
RESPONSE_MASK = np.arange(N)[None] < np.array([6, 3, 1, 5])[:, None]
# Loop and scan programs, and remat's recomputation, may sum in different orders (measured here:
# ≤ 6e-7 of a leaf's largest gradient; the bound is 2.2e-4).
GRAD_RTOL = grad_rtol(LOOP, P + N, R * (P + N))


def _perturbed(params, seed=1):
  """Params with norms and biases moved off 1 and 0, so mixing up layers shows in every leaf."""
  rng = np.random.default_rng(seed)

  def perturb(path, x):
    # A kernel's noise is drawn [in, out] and stored [out, in], as ``model.create`` draws its
    # weights: the same model (and so the same bf16 margin below) as before the layout changed.
    kernel = re.search(r"(_proj|lm_head)'\]", jax.tree_util.keystr(path))
    noise = rng.standard_normal(x.shape[::-1]).T if kernel else rng.standard_normal(x.shape)
    return x + 0.2 * noise.astype(x.dtype)

  return jax.tree_util.tree_map_with_path(perturb, params)


def _as_scan(loop_params, scan_like):
  """``loop_params`` in the scan layout: each layer leaf stacked over the L layers."""
  n = len(loop_params["layers"])
  stacked = [
    jnp.stack(xs) for xs in zip(*(jax.tree.leaves(loop_params["layers"][i]) for i in range(n)))
  ]
  leaves = []
  for key in sorted(scan_like.keys()):  # the order in which jax flattens the State
    leaves += stacked if key == "layers" else jax.tree.leaves(loop_params[key])
  return jax.tree.unflatten(jax.tree.structure(scan_like), leaves)


@pytest.fixture(scope="module")
def models():
  """(graphdef, params) of both layouts holding the same (perturbed) weights."""
  graphdef, params = model.create(LOOP, 0)
  params = _perturbed(params)
  scan_graphdef, scan_like = model.create(SCAN, 0)
  return {"loop": (graphdef, params), "scan": (scan_graphdef, _as_scan(params, scan_like))}


def _assert_trees_close(a, b, rtol, atol=None):
  """Leaf by leaf: max |x − y| ≤ rtol · max |y| (+ that leaf's ``atol``, a tree of floats)."""
  atols = jax.tree.leaves(atol) if atol is not None else [0.0] * len(jax.tree.leaves(a))
  for x, y, extra in zip(jax.tree.leaves(a), jax.tree.leaves(b), atols, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    scale = float(jnp.max(jnp.abs(y)))
    diff = float(jnp.max(jnp.abs(x - y)))
    assert diff <= rtol * scale + extra, (diff, scale, extra)


def test_same_seed_gives_the_same_weights():
  _, loop = model.create(LOOP, 0)
  _, scan = model.create(SCAN, 0)
  for x, y in zip(jax.tree.leaves(_as_scan(loop, scan)), jax.tree.leaves(scan), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The plan (abstract) has the params' shapes, and names the stacked axis of every layer leaf.
  _, plan = model.abstract(SCAN)
  assert [x.shape for x in jax.tree.leaves(plan)] == [x.shape for x in jax.tree.leaves(scan)]
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  for path, var in jax.tree_util.tree_flatten_with_path(plan, is_leaf=is_var)[0]:
    stacked = path[0].key == "layers"
    assert (var.get_metadata()["logical_axes"][0] == "layers") == stacked, path
    assert not stacked or var.shape[0] == LOOP.num_layers


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, ids, mask):
  hidden, lm_head, _ = model.forward(graphdef, params, ids, model.positions_from_mask(mask), mask)
  return jnp.einsum("btd,vd->btv", hidden, lm_head, preferred_element_type=jnp.float32)


def _full_sequences():
  return (
    np.concatenate([PROMPT_IDS, RESPONSE_IDS], 1),
    np.concatenate([PROMPT_MASK, RESPONSE_MASK], 1),
  )


def test_scan_forward_and_logprobs_equal_loop(models):
  ids, mask = _full_sequences()
  loop, scan = (np.asarray(_logits(*models[k], ids, mask))[mask] for k in ("loop", "scan"))
  assert np.std(loop) > 0.3
  # Each layer's sums in the scan body and in the unrolled loop may run in other orders.
  z_scale = float(np.max(np.abs(loop)))
  np.testing.assert_allclose(scan, loop, rtol=0, atol=2 * chain_terms(LOOP, P + N) * U * z_scale)

  score = jax.jit(scoring.logp_responses, static_argnums=(0, 7))
  outs = [
    score(
      models[k][0],
      models[k][1],
      PROMPT_IDS,
      PROMPT_MASK,
      RESPONSE_IDS,
      RESPONSE_MASK,
      jnp.float32(0.8),
      4,
    )
    for k in ("loop", "scan")
  ]
  (logp_loop, ent_loop), (logp_scan, ent_scan) = outs
  z_scale /= 0.8
  np.testing.assert_allclose(logp_scan, logp_loop, rtol=0, atol=logp_atol(LOOP, P + N, z_scale))
  np.testing.assert_allclose(ent_scan, ent_loop, rtol=0, atol=entropy_atol(LOOP, P + N, z_scale))


def test_scan_sampler_equals_loop(models):
  counts = np.array([2, 1, 3, 2])
  outs = [
    sampler.generate(
      models[k][0],
      models[k][1],
      PROMPT_IDS,
      PROMPT_MASK,
      counts,
      jax.random.key(3),
      1.0,
      0.95,
      num_rollouts=8,
      max_new_tokens=7,
      eos_id=1,
      pad_id=0,
      model_cfg=cfg,
    )
    for k, cfg in (("loop", LOOP), ("scan", SCAN))
  ]
  loop, scan = outs
  np.testing.assert_array_equal(np.asarray(scan.tokens_RxN), np.asarray(loop.tokens_RxN))
  np.testing.assert_array_equal(np.asarray(scan.mask_RxN), np.asarray(loop.mask_RxN))
  assert len(np.unique(np.asarray(loop.tokens_RxN))) > 5  # real samples, not one repeated token
  # The logits' scale (τ = 1), from the training forward over the sampled sequences.
  rows = np.repeat(np.arange(R), counts)
  ids = np.concatenate([PROMPT_IDS[rows], loop.tokens_RxN], 1)
  mask = np.concatenate([PROMPT_MASK[rows], loop.mask_RxN], 1)
  z_scale = float(np.max(np.abs(np.asarray(_logits(*models["loop"], ids, mask))[mask])))
  slots = P + 7
  for name, atol in (
    ("behaviour_logp_RxN", logp_atol(LOOP, slots, z_scale)),
    ("entropy_RxN", entropy_atol(LOOP, slots, z_scale)),
  ):
    np.testing.assert_allclose(
      np.asarray(getattr(scan, name)), np.asarray(getattr(loop, name)), rtol=0, atol=atol
    )


def test_scan_rl_update_equals_loop(models):
  batch = rollouts(
    prompt_ids_RxP=PROMPT_IDS,
    prompt_mask_RxP=PROMPT_MASK,
    tokens_RxN=RESPONSE_IDS,
    mask_RxN=RESPONSE_MASK,
    behaviour_logp_RxN=-np.linspace(0.5, 3, R * N, dtype=np.float32).reshape(R, N),
    rewards_R=np.array([1, 0, 0, 1], np.float32),
    group_ids_R=np.array([0, 0, 1, 1], np.int32),
  )
  hp = losses.LossHparams.create(
    eps_low=0.2, eps_high=0.28, kl_coef=0.0, entropy_coef=0.01, tau=0.9
  )
  cfg = losses.LossConfig(aggregation="seq-mean-token-mean", informative_only=False, num_groups=2)
  tx = optax.sgd(0.5)  # the update is the gradient itself, compared leaf by leaf
  out = {}
  for k in ("loop", "scan"):
    graphdef, params = models[k]
    update = jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))
    out[k] = update(step.init_state(params, tx), batch, hp)
  (loop_state, loop_m), (scan_state, scan_m) = out["loop"], out["scan"]
  assert float(loop_m["grad_norm"]) > 0.1
  for name in loop_m:
    # Means and sums over the tokens of per-token values of scale ~1 (ratios, advantages, log-probs
    # of a 64-token vocabulary), or the gradient's norm: the gradient's bound, of that scale.
    np.testing.assert_allclose(
      float(scan_m[name]), float(loop_m[name]), rtol=GRAD_RTOL, atol=GRAD_RTOL, err_msg=name
    )
  scan_delta = jax.tree.map(jnp.subtract, scan_state.params, models["scan"][1])
  loop_delta = jax.tree.map(jnp.subtract, loop_state.params, models["loop"][1])
  # A delta is fl(p − lr·g) − p: besides the gradients' own difference (GRAD_RTOL), each update
  # rounds to the float32 grid around p, so two updates from equal p and nearly equal g can land
  # one ulp(p) apart (0.5 ulp each way; the subtraction of p is then exact).
  ulp_p = jax.tree.map(
    lambda p: float(np.spacing(np.max(np.abs(np.asarray(p))))), models["scan"][1]
  )
  _assert_trees_close(scan_delta, _as_scan(loop_delta, models["scan"][1]), GRAD_RTOL, ulp_p)


def _loss(graphdef, params):
  """Next-token log-likelihood of the full sequences, through plain logits (small to compile)."""
  ids, mask = _full_sequences()
  logits = _logits.__wrapped__(graphdef, params, ids, mask)[:, :-1]
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(mask[:, 1:] & mask[:, :-1], logp, 0.0))


_value_and_grad = jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)


@pytest.mark.parametrize("layout", ["loop", "scan"])
def test_remat_gives_the_same_loss_and_grads(models, layout):
  graphdef, params = models[layout]
  base = LOOP if layout == "loop" else SCAN
  results = {}
  for remat in ("none", "full", "dots"):
    cfg = dataclasses.replace(base, remat=remat)
    graphdef = model.abstract(cfg)[0]
    # The forward alone: the fused log-prob path of rl_update has a remat of its own.
    forward = functools.partial(
      model.forward,
      graphdef,
      tokens_BxT=PROMPT_IDS,
      positions_BxT=model.positions_from_mask(PROMPT_MASK),
      kv_valid_BxS=PROMPT_MASK,
    )
    jaxpr = jax.make_jaxpr(lambda p: forward(params=p)[0])(params).jaxpr
    assert contains_primitive(jaxpr, _REMAT) == (remat != "none"), remat
    results[remat] = _value_and_grad(graphdef, params)
  loss, grads = results["none"]
  for remat in ("full", "dots"):
    # The loss is a sum of same-signed log-probs, the forward half of the gradient's chain.
    assert float(results[remat][0]) == pytest.approx(float(loss), rel=GRAD_RTOL)
    _assert_trees_close(results[remat][1], grads, GRAD_RTOL)


# Activations outweigh the weights here (8 rows × 288 tokens × FFN 512 per layer), so a remat
# that keeps only each layer's input shows in the compiled update's temporaries.
_WIDE = dataclasses.replace(LOOP, hidden_size=64, intermediate_size=512, num_layers=4, head_dim=16)


def _update_temp_bytes(cfg) -> int:
  """XLA's temp bytes of the run's GRPO update (``Programs.update``), compiled on abstract
  inputs: 8 rows × (32 + 256) tokens."""
  graphdef, params = model.abstract(cfg)
  programs = Programs(graphdef, params, sharding.make_mesh(1, 1, 1), optax.adamw(1e-3))
  n = 256
  batch = plan_compile.abstract_rollouts(8, 32, n)
  step_cfg = losses.LossConfig(informative_only=False, max_response_len=n, num_groups=1)
  hp = losses.LossHparams.create(tau=1.0)
  state = jax.eval_shape(programs.init_state, params)
  compiled = programs.update(step_cfg).lower(state, batch, hp, None).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_shrinks_the_compiled_update(scan_layers):
  """remat "full" keeps each layer's input, not its intermediates, in the program XLA runs: with
  the layers unrolled too (XLA CPU's early barrier removal used to let CSE merge the recomputation
  back into the forward, and remat then saved nothing)."""
  base = dataclasses.replace(_WIDE, scan_layers=scan_layers)
  temp = {r: _update_temp_bytes(dataclasses.replace(base, remat=r)) for r in ("none", "full")}
  assert temp["full"] < 0.5 * temp["none"], temp


def test_bfloat16_params_compute_like_their_float32_upcast(models):
  cfg16 = dataclasses.replace(LOOP, param_dtype="bfloat16")
  graphdef16, params16 = model.create(cfg16, 0)
  assert {x.dtype for x in jax.tree.leaves(params16)} == {jnp.dtype(jnp.bfloat16)}
  graphdef32, _ = models["loop"]
  params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params16)
  ids, mask = PROMPT_IDS, PROMPT_MASK
  np.testing.assert_array_equal(
    np.asarray(_logits(graphdef16, params16, ids, mask)),
    np.asarray(_logits(graphdef32, params32, ids, mask)),
  )


def test_bfloat16_forward_and_backward_run(models):
  """bf16 params and compute (scan layout; both layouts' bf16 forward are compared with
  transformers' in test_hf_parity): finite logits near the float32 ones, finite bf16 gradients."""
  cfg16 = dataclasses.replace(SCAN, param_dtype="bfloat16", dtype="bfloat16")
  graphdef16 = model.abstract(cfg16)[0]
  graphdef, params = models["scan"]
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  ids, mask = _full_sequences()
  logits16 = np.asarray(_logits(graphdef16, params16, ids, mask))[mask]
  logits32 = np.asarray(_logits(graphdef, params, ids, mask))[mask]
  assert np.all(np.isfinite(logits16))
  # bf16 rounds every weight and activation to 8 significant bits, u_b = 2⁻⁹ relative each. On
  # a value's way to the logits, per layer: the weights of its 4 matmul stages (q/k/v, out,
  # gate/up, down: u_b of Σ|a·w| each) and ~12 stored activations (norms, q/k/v, probabilities,
  # the mix, the out projection, residuals, gate/up, SiLU·up, down); then the final norm and the
  # head (3): to first order within that many u_b of the logits' scale (0.6 here), whatever order
  # the float32 sums before each rounding take. Measured 0.093, on every XLA kernel choice tried;
  # a wrong op moves logits of std ~1 by O(1) somewhere among these 1,792.
  roundings = 16 * cfg16.num_layers + 3
  bound = roundings * 2.0**-9 * float(np.max(np.abs(logits32)))
  assert np.max(np.abs(logits16 - logits32)) < bound
  loss, grads = _value_and_grad(graphdef16, params16)
  assert np.isfinite(float(loss))
  assert all(
    g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads)
  )


@pytest.mark.parametrize("micro", [2, 4])
def test_eepo_forget_micro_batches_equal_one_pass(models, micro):
  """θ' = θ + η∇L accumulated over strided row chunks equals the one-pass step; one row has no
  response, so a chunk's share of L is weighted by its rows with responses, not by its size."""
  graphdef, params = models["loop"]
  mask = RESPONSE_MASK.copy()
  mask[1] = False
  # A large η, so θ' - θ (~1e-3·η) is far above the rounding of θ + η∇L at |θ| ~ 1.
  forget = jax.jit(
    functools.partial(eepo_forget, graphdef, 4, lr=1000.0, eps_l=0.01, eps_r=1e-4),
    static_argnames="micro",
  )
  args = (params, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, mask, mask, jnp.float32(0.9))
  one_params, one_value = forget(*args, micro=1)
  micro_params, micro_value = forget(*args, micro=micro)
  assert float(one_value) < -0.01  # a non-trivial objective (a sum of log(1 - p) terms)
  # The objective is a mean of same-signed log(1 - p) terms: the forward half of the chain.
  np.testing.assert_allclose(float(micro_value), float(one_value), rtol=GRAD_RTOL)
  one_delta = jax.tree.map(jnp.subtract, one_params, params)
  micro_delta = jax.tree.map(jnp.subtract, micro_params, params)
  # Besides the gradients' difference, θ' = fl(θ + η·g) rounds to the grid around θ', so the two
  # deltas may also differ by one ulp of θ' (as in test_scan_rl_update_equals_loop).
  ulp = jax.tree.map(lambda p: float(np.spacing(np.max(np.abs(np.asarray(p))))), one_params)
  _assert_trees_close(micro_delta, one_delta, GRAD_RTOL, ulp)
