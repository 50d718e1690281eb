"""Supervised warm start: teach the tiny model the task format and part of the skill, then stop.

The result is cached in ``WORKDIR/sft`` (orbax), so a resumed or repeated run reuses it.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import jax
import numpy as np

from jaxrl import optim, sharding, step
from jaxrl.checkpoint import Checkpointer

log = logging.getLogger(__name__)


def warm_start(graphdef, params, mesh, *, prompt_ids_NxP, prompt_mask_NxP, target_ids_NxT,
               target_mask_NxT, steps: int, batch_size: int, learning_rate: float,
               warmup_steps: int, weight_decay: float, chunk: int, workdir: str,
               progress=None):
  """Params after ``steps`` SFT steps on the given examples (loaded from the cache if present)."""
  ckpt = Checkpointer(os.path.join(workdir, "sft"), keep=1, async_save=False)
  if ckpt.latest_step() == steps:
    tree, _ = ckpt.restore(steps, {"params": params})
    ckpt.close()
    log.info("SFT warm start loaded from %s", ckpt.directory)
    return tree["params"], None
  tx = optim.adamw(learning_rate, warmup_steps, decay_steps=max(steps - warmup_steps, 1),
                   weight_decay=weight_decay)
  state_shardings = step.TrainState(
      step=sharding.replicated(mesh), params=sharding.tree_shardings(params, mesh),
      opt_state=sharding.tree_shardings(jax.eval_shape(tx.init, params), mesh))
  state = jax.jit(functools.partial(step.init_state, tx=tx), out_shardings=state_shardings)(params)
  update = jax.jit(functools.partial(step.sft_update, graphdef, tx, chunk), donate_argnums=(0,),
                   out_shardings=(state_shardings, None))
  num = prompt_ids_NxP.shape[0]
  losses = []
  t0 = time.time()
  for i in range(steps):
    idx = np.arange(i * batch_size, (i + 1) * batch_size) % num  # the corpus is already shuffled
    batch = sharding.shard_batch((prompt_ids_NxP[idx], prompt_mask_NxP[idx], target_ids_NxT[idx],
                                  target_mask_NxT[idx]), mesh)
    state, metrics = update(state, *batch)
    if i % 50 == 0 or i == steps - 1:
      losses.append((i, float(metrics["loss"])))
      log.info("sft step %d/%d loss %.4f (%.1fs)", i + 1, steps, losses[-1][1], time.time() - t0)
    if progress is not None:
      progress(i + 1, steps)
  ckpt.save(steps, {"params": state.params}, {"losses": losses})
  ckpt.close()
  return state.params, losses
