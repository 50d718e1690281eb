"""The GRPO update: mini-batches are sequential optimizer steps, micro-batches accumulate exactly."""

import dataclasses
import functools

import jax
import numpy as np
import optax
from rounding import grad_rtol
from run_helpers import SMALL_MODEL, assert_same_update, random_batch, update_hparams

from jaxrl.nn import model
from jaxrl.rl import losses, step


def test_mini_batches_are_sequential_updates_on_strided_rows():
  """Mini-batch j holds rows j, j+m, j+2m, ... (each stays spread over the data shards)."""
  graphdef, params = model.create(SMALL_MODEL, 0)
  tx = optax.adam(1e-2)
  batch = random_batch(np.random.default_rng(0))
  # Dr.GRPO advantages (r - group mean): the rewards [1, 0, 0, 1] of each group have the same mean
  # on even and odd rows, so each half's own advantages equal the whole batch's.
  one = losses.LossConfig(
    aggregation="token-mean", informative_only=False, num_groups=2, scale_by_std=False
  )
  two = dataclasses.replace(one, mini_batches=2)
  state = step.init_state(params, tx)
  s_two, m_two = jax.jit(functools.partial(step.rl_update, graphdef, tx, two))(
    state, batch, update_hparams()
  )
  even, odd = (
    jax.tree.map(lambda x, sl=sl: x[sl], batch) for sl in (slice(0, None, 2), slice(1, None, 2))
  )
  update = jax.jit(functools.partial(step.rl_update, graphdef, tx, one))
  s_seq, m1 = update(step.init_state(params, tx), even, update_hparams())
  s_seq, m2 = update(s_seq, odd, update_hparams())
  assert int(s_two.step) == 2
  # No rounding bound can be derived through Adam's first step, lr·g/(|g| + ε): a last-bit
  # difference in a near-zero gradient entry moves that weight by up to 2·lr. Nor is one needed:
  # each of ``two``'s mini-batches is the arithmetic ``one`` runs on the same rows (a ``lax.scan``
  # body of the same shapes, so the same kernels on any CPU), and the two agree bit for bit
  # (measured: equal, here and under other XLA kernel and vector-width choices); the tolerance
  # only leaves room for that.
  for a, b in zip(jax.tree.leaves(s_two.params), jax.tree.leaves(s_seq.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(
    float(m_two["loss"]), (float(m1["loss"]) + float(m2["loss"])) / 2, rtol=1e-5
  )


def _updates_by_micro_batches(params, batch, hp, **loss_fields):
  """``rl_update`` (SGD, lr 0.1) with ``loss.micro_batches`` 1 and 4: [(state, metrics)] each."""
  graphdef = model.create(SMALL_MODEL, 0)[0]
  tx = optax.sgd(0.1)
  out = []
  for micro in (1, 4):
    cfg = losses.LossConfig(micro_batches=micro, **loss_fields)
    out.append(
      jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))(
        step.init_state(params, tx), batch, hp
      )
    )
  return out


def test_micro_batches_give_the_same_update():
  params = model.create(SMALL_MODEL, 1)[1]
  batch = random_batch(np.random.default_rng(1))
  out = _updates_by_micro_batches(
    params, batch, update_hparams(),
    aggregation="seq-mean-token-mean", informative_only=False, num_groups=2,
  )  # fmt: skip
  # Four micro-batches sum the gradient over the rows in another order than one pass. SGD: each
  # weight is fl(p − lr·g), so the two differ by lr times the gradients' gap (``grad_rtol`` of a
  # leaf's largest lr·|g| = |Δp|, over the 8 rows of P + N = 9 slots) and by the rounding of the
  # subtraction (one ulp of the new weights: 0.5 each way). The loss: the forward half of the same
  # chain, over terms of scale ~1.
  assert_same_update(out, params, grad_rtol(SMALL_MODEL, 9, 8 * 9))


def test_dynamo_modulation_does_not_depend_on_the_micro_batches():
  """docs/algorithms.md §4.3: DynaMO normalises by the mini-batch's max Ξ and entropy range, so
  splitting a mini-batch into micro-batches changes the update by rounding only. Two mini-batches:
  the first on-policy, the second's ℓ and H under the params the first moved (ρ ≠ 1, the clip
  indicator acts). With each micro-batch's own statistics the two differed by as much as the
  update itself (measured: 1.05× a leaf's largest step, loss 0.279 vs 0.259)."""
  params = model.create(SMALL_MODEL, 2)[1]
  batch = random_batch(np.random.default_rng(2), R=16)
  hp = update_hparams()
  out = _updates_by_micro_batches(
    params, batch, hp,
    aggregation="token-mean", informative_only=False, num_groups=2, modulation=True,
    mini_batches=2,
  )  # fmt: skip
  # As ``test_micro_batches_give_the_same_update`` (SGD, 8 rows of P + N = 9 slots per
  # mini-batch), and the modulation's f amplifies the forward's rounding of x = Ξ/max Ξ by its
  # slope, at most α·γ/4 = 5, relative to f ≥ 1 − α: a factor 1 + α·γ/(4·(1 − α)) on the bound.
  # (Measured: 2.4e-5 of a leaf's largest step; the bound is 1.5e-3.)
  alpha, gamma = float(hp.modulation_alpha), float(hp.modulation_gamma)
  assert_same_update(
    out, params, grad_rtol(SMALL_MODEL, 9, 8 * 9) * (1 + alpha * gamma / (4 * (1 - alpha)))
  )
