"""Params in and out of a run: read from an HF directory or a run's checkpoint, written in HF layout
(what transformers, vLLM and ``jaxrl-eval`` load) — at the end of a run (``WORKDIR/hf``) and from
any checkpoint by ``jaxrl-export``.

Reading a run (its checkpoints, its SFT cache, its tokenizer) writes nothing into its directory:
the run may be training, and writing a checkpoint, at the same time (``Checkpointer.reader``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import rng
from jaxrl.config import from_configdict
from jaxrl.nn import arch, hf, hf_load, lora, model, peft
from jaxrl.parallel import distributed, sharding
from jaxrl.run import cli, sft
from jaxrl.tasks.data import math_prompts
from jaxrl.tasks.task import tokenizer_variant
from jaxrl.workdir.checkpoint import Checkpointer

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


def checkpoint_step(directory: str, step: int) -> int:
  """``step`` of a run's checkpoints ``directory`` (-1: its latest), read-only; a
  ``FileNotFoundError`` when there is no such checkpoint."""
  reader = Checkpointer.reader(directory)
  try:
    return _existing(reader, step)
  finally:
    reader.close()


def _existing(ckpt, step: int) -> int:
  found = ckpt.latest_step() if step < 0 else step
  if found is None or found not in ckpt.all_steps():
    missing = "" if found is None else f" {found}"
    raise FileNotFoundError(f"{ckpt.directory}: no checkpoint{missing}")
  return found


def eval_dir(directory: str, step: int) -> str:
  """Where ``jaxrl-eval`` writes its results for checkpoint ``step`` of a run's checkpoints
  ``directory`` by default: ``RUN/eval/stepN``, beside the checkpoints (a step's own directory is
  deleted when it rotates out)."""
  return os.path.join(os.path.dirname(os.path.abspath(directory)), "eval", f"step{step}")


def _hf_params(cfg, model_cfg, path: str, shardings):
  """An HF directory's weights on ``shardings``; a LoRA model's adapters start fresh (B = 0)."""
  m = cfg.model
  params = hf_load.load_hf_checkpoint(
    path,
    dtype=np.dtype(m.param_dtype),
    shardings=shardings,
    scan_layers=m.scan_layers,
    remat=m.remat,
    compute_dtype=m.dtype,
  )[2]
  if model_cfg.lora_rank:
    seed = rng.numpy_seed(cfg.seed, rng.INIT)
    params = lora.combine(lora.fresh_adapters(model_cfg, seed, shardings), params)
  return params


def initial_params(cfg, model_cfg, shardings):
  """A run's params before any training: ``model.checkpoint``'s weights streamed onto their
  shardings, or the seeded random init (a LoRA model's adapters: fresh, B = 0, the same for a
  seed either way)."""
  m = cfg.model
  if m.checkpoint:
    log.info("loading %s (params %s, compute %s)", m.checkpoint, m.param_dtype, m.dtype)
    return _hf_params(cfg, model_cfg, m.checkpoint, shardings)
  seed = rng.numpy_seed(cfg.seed, rng.INIT)
  return jax.jit(lambda: model.create(model_cfg, seed)[1], out_shardings=shardings)()


def run_base(cfg, model_cfg, run_dir: str, shardings):
  """The params a run's RL started from, rebuilt as its trainer built them: the initial params,
  or its cached SFT warm start (``run_dir/sft``). A LoRA checkpoint's adapters go on its base."""
  params = initial_params(cfg, model_cfg, shardings)
  cached = sft.load_cached(run_dir, params, read_only=True)
  return params if cached is None else cached[0]


def load_params(cfg, path: str, graphdef_and_shardings, model_cfg=None):
  """Params of an HF directory or a jaxrl run checkpoint, on the given shardings (a LoRA run's:
  its adapters on its rebuilt base, ``run_base``)."""
  abstract_params, shardings = graphdef_and_shardings
  model_cfg = model_cfg or arch.model_config(cfg.model)
  run = run_checkpoint(path)
  if run is None:
    return _hf_params(cfg, model_cfg, path, shardings)
  directory, step = run
  ckpt = Checkpointer.reader(directory)
  try:
    if step >= 0:
      _existing(ckpt, step)
    target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params, shardings
    )
    if not lora.has_adapters(abstract_params):
      # The latest (-1) falls back past a damaged checkpoint, logging it; a step asked for does not.
      step, params = ckpt.newest_readable(lambda s: ckpt.restore_params(s, target), step)
      log.info("restored params of %s step %d", directory, step)
      return params
    base = run_base(cfg, model_cfg, os.path.dirname(directory), shardings)

    step, trained = ckpt.newest_readable(
      lambda s: (
        ckpt.restore_meta(s),
        ckpt.restore_params(s, lora.partition(target, "adapters")[0]),
      ),
      step,
    )
    meta, trained = trained
    lora.check_base(meta.get(lora.FINGERPRINT), base, directory)  # another base: not damage
    log.info("restored adapters of %s step %d", directory, step)
    return lora.combine(trained, lora.partition(base, "adapters")[1])
  finally:
    ckpt.close()


class ExportError(RuntimeError):
  """Writing an export failed; the directory it was to replace is as it was."""


def write_hf(cfg, model_cfg, params, out: str, tokenizer, dtype: str = "") -> str:
  """``params`` in HF layout in ``out``, cast to ``dtype`` (default ``model.dtype``), with the
  tokenizer and a generation config (the checkpoint's, else the tokenizer's bos/eos/pad ids).

  A LoRA model is written merged (W + (alpha / r) A B: a plain HF model) and its adapters also in
  PEFT layout in ``out/lora`` (float32), for ``PeftModel.from_pretrained`` on the base: the
  ``model.checkpoint`` it was trained on, or (a model built from scratch, or an SFT warm start)
  the base written in HF layout in ``out/lora/base``.

  The export is written into a fresh directory beside ``out`` and renamed into place once whole:
  a write that fails midway (a full disk) leaves the previous export as it was."""
  final = os.path.abspath(out)
  os.makedirs(os.path.dirname(final), exist_ok=True)
  # Process 0 writes (every process takes part in the gathers); the others write nothing.
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=os.path.dirname(final))
  try:
    if lora.has_adapters(params):
      _write_peft(cfg, model_cfg, params, (tmp, final), "lora", tokenizer, dtype)
      params = lora.merged(params, model_cfg.lora_alpha, model_cfg.lora_rank)
      model_cfg = dataclasses.replace(model_cfg, lora_rank=0)
    _write_plain_hf(cfg, model_cfg, params, tmp, tokenizer, dtype)
    if distributed.is_main():
      _replace_dir(tmp, final)
  except Exception as e:  # a full disk, EFBIG (safetensors raises its own error type)
    kept = "the previous export there is as it was" if os.path.exists(final) else "none written"
    raise ExportError(f"{final}: writing the export failed ({e}); {kept}") from e
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  log.info("policy exported to %s", final)
  return final


def _replace_dir(new: str, final: str) -> None:
  """``new`` renamed to ``final``; an earlier ``final`` is renamed away first and removed once
  ``new`` is in place (a crash in between leaves it beside, whole, as ``.NAME.old-*``)."""
  old = None
  if os.path.lexists(final):
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old-", dir=os.path.dirname(final))
    os.rename(final, os.path.join(old, "export"))
  os.rename(new, final)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def _write_peft(cfg, model_cfg, params, roots: tuple[str, str], sub: str, tokenizer, dtype):
  """The adapters in PEFT layout in ``roots[0]/sub``, which will be ``roots[1]/sub``: the base they
  name is where it will lie."""
  final, out = roots[1], os.path.join(roots[0], sub)
  base_model = cfg.model.checkpoint
  if not base_model or cfg.sft.steps:  # the base is not the checkpoint as it lies: written
    base_model = os.path.join(final, sub, "base")
    base = lora.partition(params, "adapters")[1]
    base_cfg = dataclasses.replace(model_cfg, lora_rank=0)
    _write_plain_hf(cfg, base_cfg, base, os.path.join(out, "base"), tokenizer, dtype)
  peft.save_adapter(model_cfg, params, out, base_model)
  log.info(
    "LoRA adapter (PEFT layout) written to %s, base %s", os.path.join(final, sub), base_model
  )


def _write_plain_hf(cfg, model_cfg, params, out: str, tokenizer, dtype: str) -> str:
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
  log.info("HF layout written to %s (%s)", out, dtype.name)
  return out


def _write_generation_config(tokenizer, out: str) -> None:
  """The ids HF's ``generate`` (and vLLM) stop and pad with."""
  import transformers  # lazy: heavy, needed only when an export writes its files

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
  return from_configdict(cli.load_config(spec or os.path.join(run_dir, "config.json")))


def _tokenizer(cfg, run_dir: str):
  """The run's tokenizer, read: the checkpoint's, or the task's as the run cached it (one built
  in a temporary directory when the run has none yet)."""
  if cfg.model.checkpoint:
    return math_prompts.load_tokenizer(cfg.model.checkpoint)
  import transformers  # lazy: heavy, and only a built-in task's tokenizer needs it here

  from jaxrl.tasks.data.tokenizer import build_tokenizer  # imports transformers at its top

  cached = os.path.join(run_dir, "tokenizer")
  if os.path.isfile(os.path.join(cached, "tokenizer.json")):
    return transformers.AutoTokenizer.from_pretrained(cached)
  with tempfile.TemporaryDirectory() as tmp:
    return build_tokenizer(tmp, tokenizer_variant(cfg.task))


def _is_run_dir(path: str) -> bool:
  """A training run's directory: its checkpoints, or its config and log."""
  has = lambda name: os.path.exists(os.path.join(path, name))  # noqa: E731
  return os.path.isdir(os.path.join(path, "checkpoints")) or (has("config.json") and has("log.txt"))


def _check_out(out: str) -> None:
  """An export goes outside every run directory: there it would overwrite the run's own files
  (its config.json) or be taken for part of it (the trainer writes its own export to RUN/hf). An
  existing ``out`` is replaced whole, so it must be an earlier export (an HF checkpoint: its
  config.json) or an empty directory; a file or someone's other files are never deleted."""
  if os.path.lexists(out):
    if not os.path.isdir(out):
      raise ValueError(f"--out={out}: is a file; export into a new directory or an earlier export")
    if os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
      raise ValueError(
        f"--out={out}: holds no HF checkpoint (no config.json), and the export replaces it whole; "
        "export into a new directory or an earlier export"
      )
  path = os.path.abspath(out)
  while True:
    if _is_run_dir(path):
      raise ValueError(
        f"--out={out}: {'is' if path == os.path.abspath(out) else 'is inside'} the run directory "
        f"{path}; export elsewhere (the run's own export is {os.path.join(path, 'hf')})"
      )
    parent = os.path.dirname(path)
    if parent == path:
      return
    path = parent


def export(checkpoint: str, out: str, dtype: str = "", config: str = "") -> str:
  """Write ``checkpoint`` (a run or one of its checkpoints) in HF layout into ``out``;
  ``config``: a ``--config`` value (default: the run's own)."""
  _check_out(out)
  run_dir = _run_dir(checkpoint)
  cfg = _config(run_dir, config)
  tokenizer = _tokenizer(cfg, run_dir)
  model_cfg = arch.model_config(cfg.model, len(tokenizer))
  mesh = sharding.make_mesh(1, 1, 1)  # one device: the export gathers the params anyway
  _, abstract_params = model.abstract(model_cfg)
  shardings = sharding.tree_shardings(abstract_params, mesh)
  params = load_params(cfg, checkpoint, (abstract_params, shardings), model_cfg)
  return write_hf(cfg, model_cfg, params, out, tokenizer, dtype)
