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
from jaxrl.run import cli

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


def _run_dir(checkpoint: str) -> str:
  run = run_checkpoint(checkpoint)
  if run is None:
    raise FileNotFoundError(
      f"--checkpoint={checkpoint}: not a run directory (with checkpoints/) or RUN/checkpoints/N"
    )
  return os.path.dirname(run[0])


def _config(run_dir: str, spec: str):
  """The run's config: ``spec`` (a ``--config`` value) when given, else its ``config.json``."""
  from jaxrl.config import from_configdict

  return from_configdict(cli.load_config(spec or os.path.join(run_dir, "config.json")))


def _tokenizer(cfg, run_dir: str):
  if cfg.model.checkpoint:
    from jaxrl.tasks.data import math_prompts

    return math_prompts.load_tokenizer(cfg.model.checkpoint)
  from jaxrl.tasks.data.tokenizer import build_tokenizer

  return build_tokenizer(os.path.join(run_dir, "tokenizer"))


def export(checkpoint: str, out: str, dtype: str = "", config: str = "") -> str:
  """Write ``checkpoint`` (a run or one of its checkpoints) in HF layout into ``out``;
  ``config``: a ``--config`` value (default: the run's own)."""
  from jaxrl.nn import arch, model
  from jaxrl.parallel import sharding

  run_dir = _run_dir(checkpoint)
  cfg = _config(run_dir, config)
  tokenizer = _tokenizer(cfg, run_dir)
  model_cfg = arch.model_config(cfg, len(tokenizer))
  mesh = sharding.make_mesh(1, 1, 1)  # one device: the export gathers the params anyway
  _, abstract_params = model.abstract(model_cfg)
  shardings = sharding.tree_shardings(abstract_params, mesh)
  params = load_params(cfg, checkpoint, (abstract_params, shardings))
  return write_hf(cfg, model_cfg, params, out, tokenizer, dtype)
