"""``jaxrl-export`` (``python -m jaxrl.export``): any checkpoint of a run in HF layout.

  jaxrl-export --checkpoint=runs/tiny --out=exported/tiny                 the latest checkpoint
  jaxrl-export --checkpoint=runs/tiny/checkpoints/100 --out=DIR --dtype=bfloat16

Reads the run's ``config.json`` (the architecture; ``--config`` to use another), writes
``config.json`` + safetensors, the tokenizer and ``generation_config.json`` into ``--out``: what
transformers, vLLM and ``jaxrl-eval`` load. The run's ``WORKDIR/hf`` is the same export of its
final params.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags

from jaxrl.run import cli, weights

_CHECKPOINT = flags.DEFINE_string(
  "checkpoint", None, "A run directory (its latest checkpoint) or RUN/checkpoints/N."
)
_OUT = flags.DEFINE_string("out", None, "Directory to write the HF checkpoint into.")
_DTYPE = flags.DEFINE_enum(
  "dtype", "", ["", "float32", "bfloat16", "float16"], "Weights dtype (default: model.dtype)."
)
_CONFIG = flags.DEFINE_string(
  "config", "", "The run's config (default: RUN/config.json): a name, a file or a JSON config."
)

COMMAND = "jaxrl-export"


def _run_dir(checkpoint: str) -> str:
  run = weights.run_checkpoint(checkpoint)
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
  params = weights.load_params(cfg, checkpoint, (abstract_params, shardings))
  return weights.write_hf(cfg, model_cfg, params, out, tokenizer, dtype)


def main(argv):
  del argv
  from jaxrl.config import ConfigError

  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for name in ("absl", "jax", "orbax"):
    logging.getLogger(name).setLevel(logging.WARNING)
  if not _CHECKPOINT.value or not _OUT.value:
    cli.fail(COMMAND, "--checkpoint and --out are required")
  try:
    out = export(_CHECKPOINT.value, _OUT.value, _DTYPE.value, _CONFIG.value)
  except (ConfigError, ValueError, FileNotFoundError) as e:
    cli.fail(COMMAND, e)
  print(f"written: {out}")


def run():
  """``jaxrl-export`` / ``python -m jaxrl.export``."""
  if cli.wants_help(sys.argv):
    cli.print_help(__doc__, [__name__], with_configs=False)
    return
  app.run(main)
