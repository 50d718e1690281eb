"""Supervised warm start: teach the tiny model the task format and part of the skill, then stop.

The result is cached in ``WORKDIR/sft`` (orbax) with the config it was computed from
(``run_config.sft_key``), so a resumed or repeated run of that config reuses it; a run of another
config computes it again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

import jax
import numpy as np

from jaxrl.nn import lora
from jaxrl.parallel import distributed, sharding
from jaxrl.rl import optim
from jaxrl.rl.programs import Programs
from jaxrl.run import run_config
from jaxrl.workdir.checkpoint import Checkpointer, StaleLayout, UnreadableCheckpoint

log = logging.getLogger(__name__)
CACHE = "sft"  # the warm start's checkpoint directory in the run's workdir
PROGRESS = "sft_progress"  # a stopped warm start's state, resumed by the next run, then removed
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
  stop=None,
):
  """Params after SFT (loaded from ``workdir/sft`` if a previous run of the same ``key``, the
  fields the warm start is computed from, finished it).

  Runs ``steps`` steps, or with ``target_loss`` > 0 stops as soon as the running mean of the loss
  (EMA, 0.1) falls below it: "partly capable" is then a property of the model, not of a step count
  that would land differently for every seed. The learning rate is then constant after warmup.
  ``loss_mask_QxT`` (None: every target token) marks the target tokens that are learned: not an
  environment's observations. ``stop`` (a ``stops.StopFlag``): a stop requested during the warm
  start ends it after the step, its state saved in ``WORKDIR/sft_progress`` for the next run to
  resume (``stops.Stopped``).
  """
  cached = load_cached(workdir, params, key)
  if cached is not None:
    return cached
  decay = 0 if target_loss > 0 else max(steps - warmup_steps, 1)
  tx = optim.adamw(learning_rate, warmup_steps, decay_steps=decay, weight_decay=weight_decay)
  # A LoRA model's adapters are added for RL: the warm start trains the base (B = 0 keeps the
  # adapters out of its function).
  programs = Programs(graphdef, params, mesh, tx, trainable="base")
  corpus = (prompt_ids_QxP, prompt_mask_QxP, target_ids_QxT, target_mask_QxT)
  if loss_mask_QxT is not None:
    corpus += (loss_mask_QxT,)
  t0 = time.time()
  begun = _begin(workdir, programs, programs.init_state(params), key, steps)
  state, done, ema = _train(
    programs, begun, corpus, chunk, steps, batch_size, warmup_steps, target_loss, progress, stop
  )
  _stop_if_requested(workdir, stop, _Progress(state, done, ema), steps, key)
  meta = {"steps": done, "final_loss_ema": ema, "seconds": time.time() - t0}
  if key is not None:
    meta[KEY] = key
  log.info("SFT warm start done: %d steps, loss (ema) %.4f, %.0fs", done, ema, meta["seconds"])
  _save_finished(workdir, state, done, meta)
  return state.params, meta


def _stop_if_requested(workdir: str, stop, at: _Progress, steps: int, key: dict | None) -> None:
  """A stop requested before the last step: the warm start's progress saved in
  ``WORKDIR/sft_progress`` for the next run to resume, then ``stops.Stopped`` raised."""
  if stop is None or not stop.requested or at.done >= steps:
    return
  _save_progress(workdir, at, key)
  stop.check(
    f"SFT warm start stopped at step {at.done}; its progress is saved in "
    f"{os.path.join(workdir, PROGRESS)}: run the same command again to resume it"
  )


def _begin(workdir: str, programs, fresh, key: dict | None, steps: int) -> _Progress:
  """Where the warm start begins: a stopped one's saved progress, or ``fresh`` at step 0."""
  if (saved := _load_progress(workdir, programs, fresh, key)) is not None:
    log.info("SFT warm start resumed at step %d of %d", saved.done, steps)
    return saved
  # A phase's first line (tests/test_kill_resume.py waits for it to kill during the warm start).
  log.info("SFT warm start running: %d steps", steps)
  return _Progress(fresh, 0, None)


def _save_finished(workdir: str, state, done: int, meta: dict) -> None:
  """The finished warm start in ``WORKDIR/sft``; a stopped one's progress, superseded, removed."""
  ckpt = Checkpointer(os.path.join(workdir, CACHE), keep=1, async_save=False)
  # The base alone (a LoRA model's fresh adapters are not the warm start's): the cache of a full
  # fine-tuning run and of a LoRA run of the same seed are the same files, interchangeable.
  ckpt.save(done, {"params": lora.partition(state.params, "base")[0]}, meta)
  ckpt.close()
  if distributed.is_main():
    shutil.rmtree(os.path.join(workdir, PROGRESS), ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _Progress:
  """Where the warm start stands: its train state (params, moments, step), steps done, loss EMA."""

  state: object
  done: int
  ema: float | None


def _save_progress(workdir: str, at: _Progress, key: dict | None) -> None:
  """A stopped warm start's state in ``WORKDIR/sft_progress``, with what it was computed from."""
  ckpt = Checkpointer(os.path.join(workdir, PROGRESS), keep=1, async_save=False)
  try:
    ckpt.save(at.done, {"state": at.state}, {"steps": at.done, "ema": at.ema, KEY: key})
    ckpt.wait()
  finally:
    ckpt.close()


def _load_progress(workdir: str, programs, like, key: dict | None) -> _Progress | None:
  """A stopped warm start of the same ``key`` to resume (None: none, or another config's)."""
  ckpt = Checkpointer.reader(os.path.join(workdir, PROGRESS))
  try:
    if ckpt.latest_step() is None:
      return None

    def read(step):
      meta = ckpt.restore_meta(step)
      if key is not None and run_config.cache_changes(meta.get(KEY), key) is not None:
        return None  # another config's progress: the warm start starts over
      target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        like,
        programs.state_shardings,
      )
      return _Progress(
        ckpt.restore(step, {"state": target})[0]["state"], meta["steps"], meta["ema"]
      )

    return ckpt.newest_readable(read)[1]
  except UnreadableCheckpoint:
    return None  # logged: the warm start starts over
  finally:
    ckpt.close()


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
  programs, begun: _Progress, corpus_Q, chunk, steps, batch_size, warmup_steps, target_loss,
  progress, stop=None,
):  # fmt: skip
  """The SFT steps from ``begun`` over the (already shuffled) corpus, cycling through it in order
  (step i's batch depends on i alone, so a resumed warm start ends as an uninterrupted one);
  stops early at ``target_loss``, or after the step a stop was requested in. Returns (state,
  steps done, final loss EMA)."""
  update = programs.sft_update(chunk)
  num = corpus_Q[0].shape[0]
  state, done, ema = begun.state, begun.done, begun.ema
  t0 = time.time()
  for i in range(begun.done, steps):
    if stop is not None and stop.requested:
      break
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
