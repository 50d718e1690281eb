"""DynaMO's variance argument, measured (docs/algorithms.md §12): the policy-gradient estimator's
variance under an allocation against uniform allocation of the same budget, at fixed params.

DynaMO (§4.2.1, Appendix C) allocates n_i rollouts to question i to minimise the total variance
Σ_i σ_i²/n_i of the batch gradient under Σ_i n_i = R; its optimum n_i ∝ σ_i gives the ratio
(Σ σ_i)² / (B·Σ σ_i²) ≤ 1 against uniform n_i = R/B. The diagnostic measures that ratio rather than
trusting the proxy: draw M batches of rollouts under each allocation (the same questions, the same
params, fresh sampling keys), take each batch's flattened policy gradient ĝ_m ∈ R^D, and compare

    tr Var̂[ĝ] = (1/M) Σ_m ‖ĝ_m − ḡ‖²,   ḡ = (1/M) Σ_m ĝ_m

(the trace of the gradient's sample covariance, the expected squared distance of one batch's
gradient from the mean gradient). The ratio tr Var̂(A) / tr Var̂(uniform) is < 1 when A is the
better estimator. Both sides take the same M, so the 1/M against 1/(M − 1) normalisation cancels;
with M draws the ratio's relative standard error is about 2/√M for Gaussian gradients (M = 4:
a rough sign, M ≥ 32: a measurement).

How a caller measures it, at step t with params θ, the step's questions and allocation counts_B
(the bench, or a trainer hook):

    sample = lambda counts_B, key: <rollouts of the step's questions with counts_B, sampled by θ
                                    with ``key``, rewards verified>
    grad = lambda batch: <the gradient of the update's loss at θ on batch (a pytree)>
    ratio = allocation_grad_variance_ratio(grad, sample, counts_B, variance_key(seed, t), M)

``variance_key`` is the run's ``rng.GRAD_VARIANCE`` stream: no key of training is drawn, and
nothing here updates params, so measuring changes no step of the run.
"""

from __future__ import annotations

from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import rng


def trace_variance(grads) -> float:
  """(1/M) Σ_m ‖g_m − ḡ‖² over an iterable of M ≥ 2 gradients, each a pytree of arrays (a flat
  f32[D] is one). Accumulated one at a time (Welford: the running mean, and Σ ⟨g − ḡ_old, g − ḡ⟩),
  in f32 on the gradients' devices: a model's M gradients are never held at once."""
  mean, m2, m = None, 0.0, 0
  for g in grads:
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
    m += 1
    if mean is None:
      mean = g
      continue
    delta = jax.tree.map(jnp.subtract, g, mean)
    mean = jax.tree.map(lambda mu, d: mu + d / m, mean, delta)
    after = jax.tree.map(jnp.subtract, g, mean)
    m2 += sum(float(jnp.vdot(d, a)) for d, a in zip(jax.tree.leaves(delta), jax.tree.leaves(after)))
  if m < 2:
    raise ValueError(f"need M >= 2 draws of the gradient, got {m}")
  return m2 / m


def grad_variance_ratio(
  grad_fn: Callable[[object], object], batches_a: Iterable, batches_uniform: Iterable
) -> float:
  """tr Var̂(A) / tr Var̂(uniform): ``grad_fn(batch)`` → the gradient of one batch (a pytree, or
  flattened f32[D]); the iterables yield M batches each, sampled under allocation A and under
  uniform allocation with the same total rollouts (a generator samples each batch when its
  gradient is due). NaN when the uniform draws do not vary (no signal to compare)."""
  var_a = trace_variance(grad_fn(b) for b in batches_a)
  var_u = trace_variance(grad_fn(b) for b in batches_uniform)
  return var_a / var_u if var_u > 0 else float("nan")


def uniform_counts(counts_B) -> np.ndarray:
  """The same budget R = Σ counts spread evenly over the B questions: ⌊R/B⌋ each, and one more for
  the first R mod B (i32[B])."""
  counts_B = np.asarray(counts_B)
  num_b, total = counts_B.shape[0], int(counts_B.sum())
  return (total // num_b + (np.arange(num_b) < total % num_b)).astype(np.int32)


def variance_key(seed: int, step: int) -> jax.Array:
  """The diagnostic's key at ``step``: its own stream, so training's keys are never drawn."""
  return rng.key(seed, rng.GRAD_VARIANCE, step)


def allocation_grad_variance_ratio(
  grad_fn: Callable[[object], object],
  sample_fn: Callable[[np.ndarray, jax.Array], object],
  counts_B,
  key: jax.Array,
  draws: int,
) -> float:
  """The ratio for allocation ``counts_B`` against ``uniform_counts(counts_B)``: ``draws`` batches
  of each from ``sample_fn(counts_B, key)``, under keys folded from ``key`` (0: A's, 1: uniform's)."""
  key_a, key_u = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
  counts_B = np.asarray(counts_B, np.int32)
  flat_B = uniform_counts(counts_B)
  batches_a = (sample_fn(counts_B, jax.random.fold_in(key_a, m)) for m in range(draws))
  batches_u = (sample_fn(flat_B, jax.random.fold_in(key_u, m)) for m in range(draws))
  return grad_variance_ratio(grad_fn, batches_a, batches_u)
