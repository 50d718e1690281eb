"""Params in and out of a run: read from an HF directory or a run's checkpoint, written in HF layout
(what transformers, vLLM and ``jaxrl-eval`` load) — at the end of a run (``WORKDIR/hf``) and from
any checkpoint by ``jaxrl-export``."""

from __future__ import annotations

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.parallel import distributed

log = logging.getLogger(__name__)


def run_checkpoint(path: str) -> tuple[str, int] | None:
  """(checkpoints dir, step; -1 = the latest) when ``path`` is a run directory or one of its
  ``checkpoints/N``; None for anything else (an HF directory)."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), -1
  parent, step = os.path.split(path)
  if step.isdigit() and os.path.basename(parent) == "checkpoints":
    return parent, int(step)
  return None


def load_params(cfg, path: str, graphdef_and_shardings):
  """Params of an HF directory or a jaxrl run checkpoint, on the given shardings."""
  from jaxrl.nn import hf
  from jaxrl.run.checkpoint import Checkpointer

  abstract_params, shardings = graphdef_and_shardings
  run = run_checkpoint(path)
  if run is None:
    m = cfg.model
    return hf.load_hf_checkpoint(
      path,
      dtype=np.dtype(m.param_dtype),
      shardings=shardings,
      scan_layers=m.scan_layers,
      remat=m.remat,
      compute_dtype=m.dtype,
    )[2]
  directory, step = run
  ckpt = Checkpointer(directory, keep=1, async_save=False)
  try:
    step = ckpt.latest_step() if step < 0 else step
    if step is None or step not in ckpt.all_steps():
      raise FileNotFoundError(f"{directory}: no checkpoint {'' if step is None else step}".strip())
    target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params, shardings
    )
    log.info("restoring params of %s step %d", directory, step)
    return ckpt.restore_params(step, target)
  finally:
    ckpt.close()


def write_hf(cfg, model_cfg, params, out: str, tokenizer, dtype: str = "") -> str:
  """``params`` in HF layout in ``out``, cast to ``dtype`` (default ``model.dtype``), with the
  tokenizer and a generation config (the checkpoint's, else the tokenizer's bos/eos/pad ids)."""
  from jaxrl.nn import hf

  dtype = jnp.dtype(dtype or cfg.model.dtype)
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  if jax.process_count() > 1:
    params = distributed.to_host(params)  # a collective: every process gathers, process 0 writes
    if not distributed.is_main():
      return out
  hf.save_hf_checkpoint(model_cfg, params, out, tokenizer=tokenizer)
  source = os.path.join(cfg.model.checkpoint, "generation_config.json")
  if cfg.model.checkpoint and os.path.exists(source):
    shutil.copy(source, out)
  else:
    _write_generation_config(tokenizer, out)
  log.info("policy exported to %s (%s)", out, dtype.name)
  return out


def _write_generation_config(tokenizer, out: str) -> None:
  """The ids HF's ``generate`` (and vLLM) stop and pad with."""
  import transformers

  transformers.GenerationConfig(
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id,
  ).save_pretrained(out)
