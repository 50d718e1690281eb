"""``jaxrl-export`` (``python -m jaxrl.export``): any checkpoint of a run in HF layout.

  jaxrl-export --checkpoint=runs/tiny --out=exported/tiny                 the latest checkpoint
  jaxrl-export --checkpoint=runs/tiny/checkpoints/100 --out=DIR --dtype=bfloat16

Reads the run's ``config.json`` (the architecture; ``--config`` to use another), writes
``config.json`` + safetensors, the tokenizer and ``generation_config.json`` into ``--out``: what
transformers, vLLM and ``jaxrl-eval`` load. The run's ``WORKDIR/hf`` is the same export of its
final params. The run is only read (it may be training, and writing a checkpoint, meanwhile):
nothing in its directory is created, changed or removed.
"""

from __future__ import annotations

import sys

from absl import app, flags

from jaxrl.fields import ConfigError
from jaxrl.run import cli, weights
from jaxrl.workdir import run_log
from jaxrl.workdir.checkpoint import UnreadableCheckpoint

_CHECKPOINT = flags.DEFINE_string(
  "checkpoint", None, "A run directory (its latest checkpoint) or RUN/checkpoints/N."
)
_OUT = flags.DEFINE_string(
  "out",
  None,
  "Directory to write the HF checkpoint into (replaced whole once written; not inside a run "
  "directory: one holding checkpoints/, or config.json and log.txt).",
)
_DTYPE = flags.DEFINE_enum(
  "dtype", "", ["", "float32", "bfloat16", "float16"], "Weights dtype (default: model.dtype)."
)
_CONFIG = flags.DEFINE_string(
  "config", "", "The run's config (default: RUN/config.json): a name, a file or a JSON config."
)

COMMAND = "jaxrl-export"


def main(argv):
  del argv
  run_log.setup()
  cli.end_on_sigterm(COMMAND, "nothing written (an earlier export in --out is as it was)")
  if not _CHECKPOINT.value or not _OUT.value:
    cli.fail(COMMAND, "--checkpoint and --out are required")
  try:
    out = weights.export(_CHECKPOINT.value, _OUT.value, _DTYPE.value, _CONFIG.value)
  except (ConfigError, ValueError, FileNotFoundError, UnreadableCheckpoint) as e:
    cli.fail(COMMAND, e)
  except weights.ExportError as e:  # not the input's fault (a full disk): exit 1, one line
    print(f"{COMMAND}: error: {e}", file=sys.stderr)
    sys.exit(1)
  print(f"written: {out}")


def run():
  """``jaxrl-export`` / ``python -m jaxrl.export``."""
  if cli.wants_help(sys.argv):
    cli.print_help(__doc__, [__name__], with_configs=False)
    return
  app.run(main)
