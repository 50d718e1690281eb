"""The built-in arithmetic task (re-exported here), its tokenizer and token-array encoding.

Only the numpy-only task module is re-exported: importing ``jaxrl.tasks.data.tokenizer`` (transformers)
or ``jaxrl.tasks.data.prompts`` (jax) stays explicit, so light users such as ``jaxrl.tasks.data.cursor`` do not
pay for those imports.
"""

from jaxrl.tasks.data.arithmetic import (
  DEFAULT_LEVELS,
  LevelSpec,
  Problem,
  TaskConfig,
  build_task,
  format_problem,
  is_heldout,
  max_lengths,
  parse_levels,
  sft_corpus,
)

__all__ = [
  "DEFAULT_LEVELS",
  "LevelSpec",
  "Problem",
  "TaskConfig",
  "build_task",
  "format_problem",
  "is_heldout",
  "max_lengths",
  "parse_levels",
  "sft_corpus",
]
