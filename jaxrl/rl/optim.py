"""The optimizer: AdamW with linear warmup, optional cosine decay, global-norm gradient clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def _decay_mask(params):
  """Weight decay on matrices only: norms and biases (1-D params) are not decayed."""
  return jax.tree.map(lambda x: x.ndim > 1, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def learning_rate_schedule(peak: float, warmup_steps: int, decay_steps: int = 0) -> optax.Schedule:
  """Linear warmup to ``peak`` (none if warmup_steps = 0), then constant (decay_steps=0) or cosine
  to 10% over decay_steps."""
  if decay_steps <= 0:
    after = optax.constant_schedule(peak)
  else:
    after = optax.cosine_decay_schedule(peak, max(decay_steps, 1), alpha=0.1)
  if warmup_steps <= 0:
    return after
  warmup = optax.linear_schedule(0.0, peak, warmup_steps)
  return optax.join_schedules([warmup, after], [warmup_steps])


def adamw(
  peak_lr: float,
  warmup_steps: int,
  *,
  decay_steps: int = 0,
  weight_decay: float = 0.0,
  grad_clip: float = 1.0,
  b1: float = 0.9,
  b2: float = 0.99,
  state_dtype=jnp.float32,
) -> optax.GradientTransformation:
  """AdamW with global-norm clipping; its moments are kept in ``state_dtype`` (float32 by default,
  also for bfloat16 params: updates and moments are computed in it, the update cast to the params')."""
  parts = []
  if grad_clip > 0:
    parts.append(optax.clip_by_global_norm(grad_clip))
  parts.append(
    optax.adamw(
      learning_rate_schedule(peak_lr, warmup_steps, decay_steps),
      b1=b1,
      b2=b2,
      weight_decay=weight_decay,
      mask=_decay_mask,
    )
  )
  inner = optax.chain(*parts)

  def init(params):
    return inner.init(_cast(params, state_dtype))

  def update(grads, state, params=None):
    wide = None if params is None else _cast(params, state_dtype)
    updates, state = inner.update(_cast(grads, state_dtype), state, wide)
    return jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads), state

  return optax.GradientTransformation(init, update)


def from_config(o) -> optax.GradientTransformation:
  """The RL optimizer of a config's ``optim`` section (the trainer's and ``--plan``'s)."""
  return adamw(
    o.learning_rate,
    o.warmup_steps,
    weight_decay=o.weight_decay,
    grad_clip=o.grad_clip,
    b1=o.b1,
    b2=o.b2,
    state_dtype=jnp.dtype(o.state_dtype),
  )


def _cast(tree, dtype):
  return jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )
