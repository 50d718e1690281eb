"""``jaxrl-eval`` (``python -m jaxrl.eval``): avg@n and unbiased pass@k of a checkpoint on
benchmark files.

  jaxrl-eval --config=qwen7b --checkpoint=runs/qwen7b \\
      --benchmarks=aime24=data/aime24.jsonl,math500=data/math500.jsonl [--num_samples=16 --ks=1,16]

``--checkpoint``: an HF directory (config.json + safetensors), a run directory (its newest
checkpoint that reads) or one of its ``checkpoints/N``. Each benchmark is a dataset file read with
the config's field mapping and prompt template (default: ``data.heldout``); n samples per question
at ``eval.temperature`` plus one greedy answer, scored by the config's verifier. Writes
``eval_results.json`` and ``eval_results.md`` into ``--out`` (default: ``RUN/eval/stepN`` for a
run's checkpoint N, ``CHECKPOINT/eval`` for an HF directory). Given the run, a damaged checkpoint
is logged in one line as a resume logs it and the one before evaluated; a damaged
``checkpoints/N`` asked for exits 2.

A built-in task (``tiny``, ``tiny:tools``, ``tiny:countdown``) has no benchmark files: its own
held-out split is evaluated, per level, by the trainer's held-out evaluation
(``heldout.evaluate_task``: the same engine, with the task's environment and multi-turn rollouts
where it has one, the same keys and chunks), so a checkpoint's numbers are those the run reported
at its step. With an
environment the results also give the mean model turns and tool calls per sample.

A run's checkpoints are read read-only: a run may be evaluated while it trains (and writes its next
checkpoint); nothing in its ``checkpoints/`` is created, changed or removed.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from jaxrl.config import from_configdict
from jaxrl.fields import ConfigError
from jaxrl.run import checkpoint_eval, cli
from jaxrl.workdir import run_log
from jaxrl.workdir.checkpoint import UnreadableCheckpoint

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "The run's config: a built-in name (qwen7b), a config file or a run's config.json "
  "(its architecture, tokenizer, prompt template, verifier and eval settings).",
)
_CHECKPOINT = flags.DEFINE_string(
  "checkpoint",
  None,
  "HF directory, run directory (its newest checkpoint that reads) or one run checkpoint "
  "(RUN/checkpoints/N: that one, or exit 2).",
)
_BENCHMARKS = flags.DEFINE_string(
  "benchmarks",
  "",
  "NAME=PATH,... (default: data.heldout); none for the built-in tasks (their held-out split).",
)
_OUT = flags.DEFINE_string(
  "out", "", "Where to write eval_results.{json,md} (default: RUN/eval/stepN, or HF_DIR/eval)."
)
_NUM_SAMPLES = flags.DEFINE_integer(
  "num_samples", 0, "n samples per question (0: eval.num_samples)."
)
_KS = flags.DEFINE_string(
  "ks", "", "k values of pass@k, or pow2: the powers of two up to n, and n (default: eval.ks)."
)


def main(argv):
  del argv
  run_log.setup()
  cli.end_on_sigterm("jaxrl.eval", "no results written (the run it read is untouched)")
  if _CONFIG.value is None or not _CHECKPOINT.value:
    cli.fail("jaxrl.eval", "--config and --checkpoint are required")
  try:
    cfg = cli.with_local_checkpoint(from_configdict(_CONFIG.value))
    out, summary = checkpoint_eval.evaluate_path(
      cfg,
      _CHECKPOINT.value,
      benchmarks=_BENCHMARKS.value,
      out=_OUT.value,
      num_samples=_NUM_SAMPLES.value,
      ks=_KS.value,
    )
  except (ConfigError, ValueError, FileNotFoundError, UnreadableCheckpoint) as e:
    cli.fail("jaxrl.eval", e)
  print(summary["table"])
  print(f"\nwritten: {out}/eval_results.json, eval_results.md")


def run():
  """``jaxrl-eval`` / ``python -m jaxrl.eval``."""
  if cli.wants_help(sys.argv):
    cli.print_help(__doc__, [__name__], with_configs=False)
    return
  try:
    sys.argv = cli.resolve_argv(sys.argv)
  except FileNotFoundError as e:
    cli.fail("jaxrl.eval", e)
  app.run(main, flags_parser=cli.flags_parser("jaxrl.eval"))
