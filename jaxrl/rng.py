"""Every random stream of a run, derived from ``config.seed`` alone: no RNG state, exact resume.

A stream is a constant; ``key(seed, stream, step)`` is ``fold_in(fold_in(PRNGKey(seed), stream),
step)``. Numpy-seeded streams (the model's init, the SFT corpus) take ``numpy_seed``.
"""

from __future__ import annotations

import jax

INIT = 1  # the model's random init (numpy_seed)
RL = 2  # rollouts of RL step i: key(seed, RL, i)
EVAL = 3  # held-out and benchmark evaluation: key(seed, EVAL)
ROUND = 4  # dynamic sampling's extra rounds of step i: fold_in(key(seed, ROUND, i), round)
SFT = 7  # the SFT corpus (numpy_seed)
GRAD_VARIANCE = (
  8  # the gradient-variance diagnostic's resampled batches at step i (rl/grad_variance)
)


def key(seed: int, stream: int, step: int | None = None) -> jax.Array:
  """The key of ``stream`` (at ``step``, when the stream has one per step)."""
  k = jax.random.fold_in(jax.random.PRNGKey(seed), stream)
  return k if step is None else jax.random.fold_in(k, step)


def numpy_seed(seed: int, stream: int) -> int:
  """An integer seed for code that seeds numpy or flax with an int."""
  return seed * 1000 + stream
