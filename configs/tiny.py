"""The embedded default: a tiny Qwen2-style model learns graded arithmetic by GRPO on a laptop CPU.

  python -m jaxrl.main --config=configs/tiny.py --workdir=runs/tiny

Builds a tokenizer and the task in code (no downloads), warm-starts the model by SFT, evaluates
held-out pass@1 / pass@8 / greedy accuracy per difficulty level, runs GRPO, evaluates again and
prints the before/after table. About 10 minutes on 2 CPU cores.

Variants (``configs/tiny.py:ARG``): ``quick`` (a few steps, for smoke tests).
"""
from jaxrl.config import default_configdict


def get_config(arg: str = ""):
  c = default_configdict()
  c.seed = 0
  c.steps = 200
  c.batch_questions = 16
  c.rollout.group_size = 8
  if arg == "quick":
    c.steps = 4
    c.sft.steps = 20
    c.task.num_heldout_per_level = 4
    c.checkpoint.every = 2
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/tiny.py (known: quick)")
  return c
