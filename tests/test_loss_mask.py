"""Multi-turn rollouts: only the model's own tokens train (docs/algorithms.md §11).

A multi-turn response interleaves the model's tokens (loss mask on) with an environment's (response
mask on, loss mask off). Checked here: §11's worked example through `grpo_loss`; that what an
environment position holds (logits, log-probs under every policy, entropies, the behaviour
log-prob) changes no loss, metric, gradient or updated parameter, bit for bit, and that its own
gradient is exactly 0, for every term and aggregation, through the reference functions and the
trainer's update; the single-turn worked examples of §4 (DynaMO), §5 (EEPO) and §9 (behaviour
weights) with environment tokens spliced in; the rollout entropy, the metrics row, and a
checkpoint written before the loss mask existed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rounding import sum_tol
from run_helpers import SMALL_MODEL as MCFG
from run_helpers import rollouts, tiny_config

from jaxrl import losses
from jaxrl.nn import model
from jaxrl.rl import step
from jaxrl.rl.forget import eepo_forget
from jaxrl.rl.losses import LossConfig, LossHparams, grpo_loss, loss_denominator
from jaxrl.rollout.collect import token_mean_entropy
from jaxrl.run import loop as loop_module
from jaxrl.run import loop_state, records
from jaxrl.workdir.checkpoint import Checkpointer

# ------------------------------------------------------------------ §11's worked example

# One group of two rows, A = [+1, −1], ε = 0.2. Row 0: [model, model, env, env, model]; row 1:
# [model, env, model, pad, pad]. ρ = 9 on the environment tokens: it must never enter.
EXAMPLE_LOSS_MASK = np.array([[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]], bool)
EXAMPLE_RESPONSE_MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
EXAMPLE_RHO = np.array([[1.5, 1.0, 9.0, 9.0, 1.0], [0.5, 9.0, 1.0, 1.0, 1.0]])
EXAMPLE_J = [[1.2, 1.0, 1.0], [-0.8, -1.0]]  # the per-token objective on each row's model tokens


def _example_loss(aggregation, mask):
  cfg = LossConfig(aggregation=aggregation, num_groups=1, max_response_len=5)
  hp = LossHparams.create(eps_low=0.2, eps_high=0.2, kl_coef=0.0, entropy_coef=0.0)
  informative = np.ones(2, bool)
  logp = np.log(EXAMPLE_RHO).astype(np.float32)  # ℓ_old = 0, so ρ = exp(ℓ)
  denom = loss_denominator(mask, informative, cfg)
  return grpo_loss(
    logp, np.zeros_like(logp), np.array([1.0, -1.0], np.float32), mask, None, None,
    informative, denom, hp, cfg,
  )  # fmt: skip


def _aggregated(aggregation, per_row):
  """The aggregation of per-row token values in float64 (N = 5)."""
  if aggregation == "token-mean":
    return sum(map(sum, per_row)) / sum(map(len, per_row))
  if aggregation == "seq-mean-token-mean":
    return sum(sum(r) / len(r) for r in per_row) / len(per_row)
  return sum(sum(r) / 5 for r in per_row) / len(per_row)


@pytest.mark.parametrize(
  "aggregation,objective",
  [("token-mean", 0.28), ("seq-mean-token-mean", 1 / 12), ("seq-mean-token-sum-norm", 0.14)],
)
def test_worked_example(aggregation, objective):
  """(3.2 − 1.8)/5 = 0.28; (3.2/3 − 1.8/2)/2 = 1/12 (0.08333); (3.2/5 − 1.8/5)/2 = 0.14."""
  assert _aggregated(aggregation, EXAMPLE_J) == pytest.approx(objective, rel=1e-15)
  loss, metrics = _example_loss(aggregation, EXAMPLE_LOSS_MASK)
  # Five float32 terms (ρ = exp(ℓ), the clip at 1 ± ε, each ≤ a few u of its value), summed and
  # divided: `sum_tol` of the aggregated |J| (1.0, 0.98, 0.5: within 9e-7 of the value).
  magnitude = _aggregated(aggregation, [[abs(j) for j in r] for r in EXAMPLE_J])
  assert abs(float(loss) - (-objective)) <= sum_tol(5, magnitude), float(loss)
  assert float(metrics.token_count) == 5  # Σ m: the model's tokens, not the 8 response tokens
  # The response mask in its place would train on the environment's ρ = 9 (clipped to 1.2).
  wrong, _ = _example_loss(aggregation, EXAMPLE_RESPONSE_MASK)
  assert abs(float(wrong) - float(loss)) > 0.01


# ------------------------------------------------------------------ the reference functions

# Rows of 6 positions: a multi-turn row, one with an environment turn in the middle, a single-turn
# row, and a row holding an environment's tokens only (no model token: out of every mean).
RESPONSE_MASK = np.array(
  [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], bool
)
LOSS_MASK = np.array(
  [[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool
)
ENV = RESPONSE_MASK & ~LOSS_MASK
R, T, V = 4, 6, 7


def _inputs(seed):
  rng = np.random.default_rng(seed)
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  return dict(
    logits=f32(rng.normal(0.0, 2.0, (R, T, V))),
    tokens=rng.integers(0, V, (R, T)).astype(np.int32),
    old=f32(np.where(RESPONSE_MASK, -rng.random((R, T)) * 2 - 0.5, 0.0)),
    behaviour=f32(np.where(LOSS_MASK, -rng.random((R, T)) * 2 - 0.5, 0.0)),  # 0 off the loss mask
    ref=f32(-rng.random((R, T)) * 2 - 0.5),
    adv=f32([1.2, -0.7, 0.4, 0.9]),
  )


def _at_env(x, value):
  """``x`` with every environment position set to ``value`` (an array broadcast, or a number)."""
  env = ENV.reshape(ENV.shape + (1,) * (np.ndim(x) - 2))
  return np.where(env, value, x).astype(np.float32)


def _objective(cfg: LossConfig, mode: str):
  """Loss(logits) with every term on: DynaMO's advantages, §9's weights, KL, entropy bonus."""
  hp = LossHparams.create(eps_low=0.2, eps_high=0.28, kl_coef=0.1, entropy_coef=0.05, tau=1.0)
  informative = np.ones(R, bool)

  def loss(logits, tokens, old, behaviour, ref, adv):
    logp_RxTxV = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_RxTxV, tokens[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_RxTxV) * logp_RxTxV, axis=-1)
    adv_RxT = losses.dynamo_modulate(adv, logp, old, ent, LOSS_MASK, hp.eps_low, hp.eps_high)
    weights = losses.behaviour_weights(old, behaviour, LOSS_MASK, mode)
    denom = loss_denominator(LOSS_MASK, informative, cfg)
    return grpo_loss(
      logp, old, adv, LOSS_MASK, ent, ref, informative, denom, hp, cfg,
      adv_RxT=adv_RxT, behaviour_w_RxT=weights,
    )  # fmt: skip

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  return lambda x: grad_fn(x["logits"], x["tokens"], x["old"], x["behaviour"], x["ref"], x["adv"])


@pytest.mark.parametrize(
  "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("mode", ["tis", "seq-mis"])
def test_environment_positions_change_nothing_and_get_no_gradient(aggregation, mode):
  cfg = LossConfig(
    aggregation=aggregation, dual_clip=3.0, use_kl=True, informative_only=True,
    behaviour_correction=mode, modulation=True, num_groups=1, max_response_len=T,
  )  # fmt: skip
  fn = _objective(cfg, mode)
  x = _inputs(0)
  (loss, metrics), grad = fn(x)
  grad = np.asarray(grad)
  assert np.all(grad[ENV] == 0.0)  # exactly: the environment's logits get no gradient at all
  assert np.any(grad[LOSS_MASK] != 0.0) and float(metrics.token_count) == LOSS_MASK.sum()
  rng = np.random.default_rng(1)
  extremes = [  # logits off by ±60, ρ = e^30 (ℓ_old = −30), a behaviour log-prob of −1e4, ...
    dict(x, logits=_at_env(x["logits"], x["logits"] + rng.normal(0, 60, (R, T, V))),
         old=_at_env(x["old"], -30.0), behaviour=_at_env(x["behaviour"], -1e4),
         ref=_at_env(x["ref"], 25.0)),
    # ... and values that exist nowhere: NaN and ∞ where nothing may read them
    dict(x, old=_at_env(x["old"], np.nan), behaviour=_at_env(x["behaviour"], np.inf),
         ref=_at_env(x["ref"], -np.inf)),
  ]  # fmt: skip
  for changed in extremes:
    (loss2, metrics2), grad2 = fn(changed)
    assert np.asarray(loss2).tobytes() == np.asarray(loss).tobytes()
    np.testing.assert_array_equal(np.asarray(grad2), grad, strict=True)
    for a, b in zip(jax.tree.leaves(metrics2), jax.tree.leaves(metrics)):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_behaviour_weights_and_mismatch_read_the_model_tokens_only():
  """§9's worked example with environment tokens spliced in (their ℓ_μ stored as 0, their ℓ_prox
  whatever the rescoring gave): the same weights, the same mismatch_kl = 0.40918."""
  env = np.array([[0, 1, 0, 0, 1, 0, 0]], bool)  # positions 1 and 4; position 6 is padding
  loss_mask = np.array([[1, 0, 1, 1, 0, 1, 0]], bool)
  diff = np.array([[0.0, 0.0, 0.5, -1.0, 0.0, 1.2, 0.0]], np.float32)
  behaviour = np.where(loss_mask, np.float32(-1.5), 0.0).astype(np.float32)
  for env_prox in (-7.0, 30.0):
    prox = np.where(env, np.float32(env_prox), behaviour + diff).astype(np.float32)
    # The tolerances of tests/test_behaviour_correction.py's worked example (printed decimals).
    assert float(losses.mismatch_kl(prox, behaviour, loss_mask)) == pytest.approx(0.40918, abs=1e-5)
    w = np.asarray(losses.behaviour_weights(prox, behaviour, loss_mask, "tis"))
    np.testing.assert_allclose(w[loss_mask], [1, 1.6487, 0.3679, 2], atol=1e-4)
    assert np.all(w[~loss_mask] == 0)
    m = losses.behaviour_metrics(prox, behaviour, loss_mask, "tis")
    assert float(m["behaviour_logp_diff_max"]) == pytest.approx(1.2, abs=1e-6)
    assert float(m["behaviour_logp_diff_mean"]) == pytest.approx(0.675, abs=1e-6)
  # seq-mis: model differences [0.9, 1.1] give s = e > 2, both dropped; counted with the
  # environment token's −1.0, the mean would be 1/3 and s = 1.40 would keep them.
  loss_mask = np.array([[1, 0, 1]], bool)
  behaviour = np.array([[-1.0, 0.0, -2.0]], np.float32)
  prox = np.array([[-0.1, -1.0, -0.9]], np.float32)
  np.testing.assert_array_equal(losses.behaviour_weights(prox, behaviour, loss_mask, "seq-mis"), 0)
  kept = losses.behaviour_weights(prox, behaviour, np.ones((1, 3), bool), "seq-mis")
  np.testing.assert_array_equal(kept, 1)  # what the response mask would have done


def test_dynamo_modulation_reads_the_model_tokens_only():
  """§4's M1 with environment tokens at positions 1 and 3 of each row whose values would set
  max Ξ (ρ = e^5), H_max (9) and each row's mean E_i: the same modulated advantages."""
  model_cols = [0, 2, 4]

  def spread(m1, env_value):
    out = np.full((2, 5), env_value, np.float32)
    out[:, model_cols] = m1
    return out

  logp_m1 = [[-0.1, -1.0, -0.05], [-0.2, -2.0, 0.0]]
  old_m1 = [[-0.1, -1.2, -0.05], [-0.25, -2.0, 0.0]]
  ent_m1 = [[0.3, 1.5, 0.2], [0.6, 2.0, 0.0]]
  loss_mask = spread([[1, 1, 1], [1, 1, 0]], 0).astype(bool)
  outs = []
  for env_logp, env_old, env_ent in ((-0.001, -5.0, 9.0), (-3.0, 2.0, 0.0)):
    out = losses.dynamo_modulate(
      np.array([1.0, -0.5], np.float32), spread(logp_m1, env_logp), spread(old_m1, env_old),
      spread(ent_m1, env_ent), loss_mask, 0.2, 0.28,
    )  # fmt: skip
    outs.append(np.asarray(out))
  expected = [[1.377778, 1.111111, 1.4], [-0.301339, -0.314332, 0.0]]
  # tests/test_modulation.py's tolerance for M1 (printed to 6 decimals, a few float32 operations)
  np.testing.assert_allclose(outs[0][:, model_cols], expected, rtol=0, atol=1e-5)
  assert np.all(outs[0][:, [1, 3]] == 0)
  np.testing.assert_array_equal(outs[0], outs[1], strict=True)


def test_eepo_unlearning_reads_the_model_tokens_only():
  """§5's E3 with environment tokens (a dominant p = 0.999, which would count and hit the floor)
  spliced in: L = −1.5712121, and the environment's logits get no gradient."""
  tiny = 1e-12
  env_p = [0.999, 0.001 - tiny, tiny]
  probs = np.array(
    [
      [[0.9, 0.1, tiny], env_p, [0.5, 0.5, tiny], [1 / 3, 1 / 3, 1 / 3]],  # last: padding
      [[0.99, 0.01, tiny], [0.2, 0.8, tiny], env_p, [0.1, 0.9, tiny]],
    ]
  )
  loss_mask = jnp.array([[1, 0, 1, 0], [1, 1, 0, 1]])
  value, grad = jax.value_and_grad(losses.eepo_unlearning_loss)(
    jnp.asarray(np.log(probs), jnp.float32), jnp.zeros((2, 4), jnp.int32), loss_mask, 1e-3, 1e-2
  )
  np.testing.assert_allclose(float(value), -1.5712121, rtol=0, atol=1e-5)  # test_eepo_loss's
  assert np.all(np.asarray(grad)[[0, 1], [1, 2]] == 0.0)


def test_rollout_entropy_and_response_metrics():
  """H (E3's, ES's, EEPO's gate) is the model tokens' mean; the response length counts every
  token of the response, ``model_tokens_mean`` the model's."""
  batch = rollouts(
    prompt_ids_RxP=np.ones((R, 2), np.int32),
    prompt_mask_RxP=np.ones((R, 2), bool),
    tokens_RxN=np.ones((R, T), np.int32),
    mask_RxN=RESPONSE_MASK,
    loss_mask_RxN=LOSS_MASK,
    behaviour_logp_RxN=np.zeros((R, T), np.float32),
    rewards_R=np.array([1, 0, 1, 0], np.float32),
    group_ids_R=np.zeros(R, np.int32),
  )
  entropy = np.where(LOSS_MASK, np.arange(R * T).reshape(R, T) % 3, 1e6).astype(np.float32)
  batch = dataclasses.replace(batch, entropy_RxN=entropy)
  assert token_mean_entropy(batch) == pytest.approx(entropy[LOSS_MASK].mean(), rel=1e-6)
  row = records.step_record(
    update={}, rollouts=batch, rewards_R=batch.rewards_R, entropy=0.0, num_groups=1, decisions={},
    counts_B=np.array([R]), times=(0.0, 1.0, 2.0, 3.0), context={}, verified={}, extra={},
  )  # fmt: skip
  assert row["response_len"] == RESPONSE_MASK.sum() / R
  assert row["model_tokens_mean"] == LOSS_MASK.sum() / R


# ------------------------------------------------------------------ the trainer's update

ENV_TOKEN = 31  # a token id only environment positions hold, so a wrapper can find them


def _update_batch(rng, n=8):
  response = np.array([[1] * 8, [1] * 5 + [0] * 3, [1] * 3 + [0] * 5, [1] * 4 + [0] * 4] * 2, bool)
  loss = np.array(
    [[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [0] * 8] * 2,
    bool,
  )
  r = len(response)
  tokens = np.where(response & ~loss, ENV_TOKEN, rng.integers(0, ENV_TOKEN, (r, n)))
  return rollouts(
    prompt_ids_RxP=rng.integers(0, 32, (r, 4)).astype(np.int32),
    prompt_mask_RxP=np.ones((r, 4), bool),
    tokens_RxN=tokens.astype(np.int32),
    mask_RxN=response,
    loss_mask_RxN=loss,
    behaviour_logp_RxN=np.where(loss, -rng.random((r, n)) * 3 - 0.5, 0.0),  # 0 off the loss mask
    prox_logp_RxN=np.where(response, -rng.random((r, n)) * 3 - 0.5, 0.0),
    rewards_R=np.array([1, 0, 0, 1, 1, 1, 0, 1], np.float32),
    group_ids_R=np.repeat(np.arange(2), 4).astype(np.int32),
  )


def _env_changed(original):
  """``step.logp_responses`` whose log-probs and entropies at environment tokens are other values,
  with 31× their gradient: if the update read them, its loss and parameters would move."""

  def logp_responses(graphdef, params, prompt_ids, prompt_mask, response_ids, response_mask, *a):
    logp, ent = original(graphdef, params, prompt_ids, prompt_mask, response_ids, response_mask, *a)
    env = response_ids == ENV_TOKEN
    return jnp.where(env, 31.0 * logp + 40.0, logp), jnp.where(env, 100.0 * ent + 7.0, ent)

  return logp_responses


UPDATE_CONFIGS = [
  dict(aggregation="token-mean", use_kl=True, modulation=True, behaviour_correction="tis",
       dual_clip=3.0, mini_batches=2, micro_batches=2),
  dict(aggregation="seq-mean-token-mean", behaviour_correction="seq-mis", informative_only=True,
       micro_batches=2),
  dict(aggregation="seq-mean-token-sum-norm", behaviour_correction="mis", modulation=True,
       max_response_len=8),
]  # fmt: skip
UPDATE_IDS = [kw["aggregation"] for kw in UPDATE_CONFIGS]


@pytest.mark.parametrize("kw", UPDATE_CONFIGS, ids=UPDATE_IDS)
def test_update_ignores_environment_positions_bit_for_bit(kw, monkeypatch):
  """``rl_update`` with every stored environment value changed (ℓ_prox, ℓ_μ, entropies) and the
  model's own log-probs and entropies there replaced: the same parameters, optimizer state and
  metrics, bit for bit."""
  graphdef, params = model.create(MCFG, 0)
  tx = optax.adam(1e-2)
  cfg = LossConfig(num_groups=2, **kw)
  hp = LossHparams.create(eps_low=0.2, eps_high=0.28, kl_coef=0.1, entropy_coef=0.01, tau=0.9)
  batch = _update_batch(np.random.default_rng(0))
  env = np.asarray(batch.mask_RxN & ~batch.loss_mask_RxN)
  changed = dataclasses.replace(
    batch,
    prox_logp_RxN=np.where(env, -30.0, batch.prox_logp_RxN).astype(np.float32),
    behaviour_logp_RxN=np.where(env, 1e4, batch.behaviour_logp_RxN).astype(np.float32),
    entropy_RxN=np.where(env, 1e6, batch.entropy_RxN).astype(np.float32),
  )

  def run(b):
    update = jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))
    return update(step.init_state(params, tx), b, hp, params)

  state, metrics = run(batch)
  monkeypatch.setattr(step, "logp_responses", _env_changed(step.logp_responses))
  state2, metrics2 = run(changed)
  assert int(state.step) == cfg.mini_batches and float(metrics["grad_norm"]) > 0
  for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
  assert metrics2.keys() == metrics.keys()
  for k in metrics:
    assert np.asarray(metrics2[k]).tobytes() == np.asarray(metrics[k]).tobytes(), k
  if cfg.mini_batches == 1:
    assert float(metrics["token_count"]) == batch.loss_mask_RxN.sum()  # every row informative


@pytest.mark.parametrize("kw", UPDATE_CONFIGS, ids=UPDATE_IDS)
def test_trailing_environment_tokens_train_as_padding(kw):
  """Environment tokens after a row's last model token (a tool's answer the model never read) are
  invisible to its tokens (causal attention) and, §11 says, to every count: the update equals
  the one where those positions are padding, bit for bit. A row of environment tokens only then
  becomes an empty row. (A denominator that counted response tokens would tell them apart.)"""
  graphdef, params = model.create(MCFG, 0)
  tx = optax.adam(1e-2)
  cfg = LossConfig(num_groups=2, **kw)
  hp = LossHparams.create(eps_low=0.2, eps_high=0.28, kl_coef=0.1, entropy_coef=0.01, tau=0.9)
  batch = _update_batch(np.random.default_rng(0))
  loss_mask = np.asarray(batch.loss_mask_RxN)
  last_model_R = np.where(
    loss_mask.any(1), loss_mask.shape[1] - np.argmax(loss_mask[:, ::-1], 1), 0
  )
  trailing = np.asarray(batch.mask_RxN) & (np.arange(loss_mask.shape[1]) >= last_model_R[:, None])
  assert trailing.sum() >= 5 and not (trailing & loss_mask).any()
  padded = dataclasses.replace(
    batch,
    mask_RxN=batch.mask_RxN & ~trailing,
    prox_logp_RxN=np.where(trailing, 0.0, batch.prox_logp_RxN).astype(np.float32),
  )
  update = jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))
  state, metrics = update(step.init_state(params, tx), batch, hp, params)
  state2, metrics2 = update(step.init_state(params, tx), padded, hp, params)
  for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
  for k in metrics:
    assert np.asarray(metrics2[k]).tobytes() == np.asarray(metrics[k]).tobytes(), k


def test_eepo_forgetting_treats_trailing_environment_tokens_as_padding():
  """EEPO's θ' over rows whose trailing environment tokens are padding instead: bit for bit
  (T_k counts model tokens; a row of environment tokens only is out of the mean, also when the
  step runs in two chunks, each weighted by its rows with a model token)."""
  graphdef, params = model.create(MCFG, 0)
  batch = _update_batch(np.random.default_rng(0))
  loss_mask = np.asarray(batch.loss_mask_RxN)
  kept = np.asarray(batch.mask_RxN) & (np.cumsum(loss_mask[:, ::-1], 1)[:, ::-1] > 0)
  forget = jax.jit(
    functools.partial(eepo_forget, graphdef, 4, lr=1.0, eps_l=1e-3, eps_r=1e-2),
    static_argnames="micro",
  )
  rows = (batch.prompt_ids_RxP, batch.prompt_mask_RxP, batch.tokens_RxN)
  one = forget(params, *rows, batch.mask_RxN, loss_mask, jnp.float32(0.9), micro=2)
  two = forget(params, *rows, kept, loss_mask, jnp.float32(0.9), micro=2)
  assert float(one[1]) < 0
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


# ------------------------------------------------------------------ checkpoints


def test_a_checkpoint_without_the_loss_mask_restores_it_as_the_response_mask(tmp_path, monkeypatch):
  """Pending batches saved by a writer that knew no loss mask (single-turn rows) come back with
  loss mask = response mask, every other field as saved."""
  from run_helpers import step_context

  cfg = tiny_config("test", steps=2, **{"rollout.max_staleness": 1, "sft.steps": 0})
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop = loop_module.initial_loop(ctx, ctx.programs.init_state(params))
  loop, _ = loop_module.rl_step(ctx, loop, 0)
  saved = loop.pending[0].result().rollouts
  write = loop_state._pending_tree

  def without_loss_mask(batch):
    tree = write(batch)
    del tree["rollouts"]["loss_mask_RxN"]
    return tree

  monkeypatch.setattr(loop_state, "_pending_tree", without_loss_mask)
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=1, async_save=False)
  try:
    assert loop_state.save_loop(ckpt, 1, loop, ctx.programs.mesh)
    assert "loss_mask_RxN" not in ckpt.restore_meta(1)["pending"][0]["fields"]
    like = loop_module.initial_loop(ctx, ctx.programs.init_state(params))
    resumed = loop_state.restore_loop(
      ckpt, 1, like, ctx.programs.state_shardings, ctx.programs.mesh
    )
  finally:
    ckpt.close()
  back = resumed.pending[0].result().rollouts
  np.testing.assert_array_equal(back.loss_mask_RxN, np.asarray(saved.mask_RxN), strict=True)
  for f in dataclasses.fields(back):
    if getattr(saved, f.name) is not None:
      np.testing.assert_array_equal(getattr(back, f.name), np.asarray(getattr(saved, f.name)))
