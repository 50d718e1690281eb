"""Supervised warm start: teach the tiny model the task format and part of the skill, then stop.

The result is cached in ``WORKDIR/sft`` (orbax) with the config it was computed from
(``run_config.sft_key``), so a resumed or repeated run of that config reuses it; a run of another
config computes it again.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import numpy as np

from jaxrl.nn import lora
from jaxrl.parallel import distributed, sharding
from jaxrl.rl import optim
from jaxrl.rl.programs import Programs
from jaxrl.run import run_config
from jaxrl.workdir.checkpoint import Checkpointer, StaleLayout

log = logging.getLogger(__name__)
CACHE = "sft"  # the warm start's checkpoint directory in the run's workdir
KEY = "config"  # the metadata key of the config the cached warm start was computed from


def warm_start(
  graphdef,
  params,
  mesh,
  *,
  prompt_ids_QxP,
  prompt_mask_QxP,
  target_ids_QxT,
  target_mask_QxT,
  loss_mask_QxT=None,
  steps: int,
  batch_size: int,
  learning_rate: float,
  warmup_steps: int,
  weight_decay: float,
  chunk: int,
  workdir: str,
  target_loss: float = 0.0,
  progress=None,
  key: dict | None = None,
):
  """Params after SFT (loaded from ``workdir/sft`` if a previous run of the same ``key``, the
  fields the warm start is computed from, finished it).

  Runs ``steps`` steps, or with ``target_loss`` > 0 stops as soon as the running mean of the loss
  (EMA, 0.1) falls below it: "partly capable" is then a property of the model, not of a step count
  that would land differently for every seed. The learning rate is then constant after warmup.
  ``loss_mask_QxT`` (None: every target token) marks the target tokens that are learned: not an
  environment's observations.
  """
  cached = load_cached(workdir, params, key)
  if cached is not None:
    return cached
  # A phase's first line (tests/test_kill_resume.py waits for it to kill during the warm start).
  log.info("SFT warm start running: %d steps", steps)
  decay = 0 if target_loss > 0 else max(steps - warmup_steps, 1)
  tx = optim.adamw(learning_rate, warmup_steps, decay_steps=decay, weight_decay=weight_decay)
  # A LoRA model's adapters are added for RL: the warm start trains the base (B = 0 keeps the
  # adapters out of its function).
  programs = Programs(graphdef, params, mesh, tx, trainable="base")
  corpus = (prompt_ids_QxP, prompt_mask_QxP, target_ids_QxT, target_mask_QxT)
  if loss_mask_QxT is not None:
    corpus += (loss_mask_QxT,)
  t0 = time.time()
  state, done, ema = _train(
    programs, programs.init_state(params), corpus, chunk, steps, batch_size, warmup_steps,
    target_loss, progress,
  )  # fmt: skip
  meta = {"steps": done, "final_loss_ema": ema, "seconds": time.time() - t0}
  if key is not None:
    meta[KEY] = key
  log.info("SFT warm start done: %d steps, loss (ema) %.4f, %.0fs", done, ema, meta["seconds"])
  ckpt = Checkpointer(os.path.join(workdir, CACHE), keep=1, async_save=False)
  # The base alone (a LoRA model's fresh adapters are not the warm start's): the cache of a full
  # fine-tuning run and of a LoRA run of the same seed are the same files, interchangeable.
  ckpt.save(done, {"params": lora.partition(state.params, "base")[0]}, meta)
  ckpt.close()
  return state.params, meta


def load_cached(workdir: str, like, key: dict | None = None, read_only: bool = False):
  """(params, meta) of the warm start cached in ``workdir/sft`` onto ``like``'s structure and
  shardings (a LoRA model's adapters: ``like``'s), or None when there is none.

  With ``key`` (``run_config.sft_key``), a cache computed from another config counts as none.
  Such a cache, or one of another params layout, is removed (said in the log) so that the warm
  start runs again; with ``read_only`` (a reader of the run) nothing is removed, and either is an
  error (``ValueError``, ``StaleLayout``)."""
  base, adapters = lora.partition(like, "base")
  directory = os.path.join(workdir, CACHE)
  ckpt = Checkpointer.reader(directory)  # the writing checkpointer is opened to save, after SFT
  stale = None
  try:
    step = ckpt.latest_step()
    if step is None:
      return None
    why = None if key is None else run_config.cache_changes(ckpt.restore_meta(step).get(KEY), key)
    if why is not None:
      stale = f"the SFT warm start cached in {directory} does not match this run: {why}"
      if read_only:
        raise ValueError(stale)
    else:
      tree, meta = ckpt.restore(step, {"params": base})
  except StaleLayout as e:
    if read_only:
      raise
    stale = str(e)
  finally:
    ckpt.close()
  if stale is not None:
    log.warning("%s; the SFT warm start runs again", stale)
    if distributed.is_main():
      shutil.rmtree(directory)
    distributed.barrier("sft-cache-removed")
    return None
  log.info("SFT warm start loaded from %s (%d steps)", ckpt.directory, step)
  return lora.combine(tree["params"], adapters), meta


def _train(
  programs, state, corpus_Q, chunk, steps, batch_size, warmup_steps, target_loss, progress
):
  """The SFT steps over the (already shuffled) corpus, cycling through it in order; stops early
  at ``target_loss``. Returns (state, steps done, final loss EMA)."""
  update = programs.sft_update(chunk)
  num = corpus_Q[0].shape[0]
  ema, done = None, 0
  t0 = time.time()
  for i in range(steps):
    idx = np.arange(i * batch_size, (i + 1) * batch_size) % num
    state, metrics = update(
      state, *sharding.shard_batch(tuple(x[idx] for x in corpus_Q), programs.mesh)
    )
    loss = float(distributed.to_host(metrics["loss"]))
    ema = loss if ema is None else 0.9 * ema + 0.1 * loss
    done = i + 1
    if i % 50 == 0:
      log.info(
        "sft step %d/%d loss %.4f (ema %.4f, %.1fs)", done, steps, loss, ema, time.time() - t0
      )
    if progress is not None:
      progress(done, steps)
    if target_loss > 0 and i >= warmup_steps and ema < target_loss:
      break
  return state, done, ema
