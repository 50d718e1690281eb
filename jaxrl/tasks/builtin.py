"""What the built-in tasks (arithmetic, countdown) share: a character vocabulary built in code,
problems as (prompt, answer, level) texts, and an SFT corpus drawn fresh for every step.

Each one's module gives ``load(sections, tokenizer_dir)`` the ``TaskData`` fields from these
helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxrl import rng
from jaxrl.fields import ConfigError
from jaxrl.tasks.data.prompts import encode_completions, encode_prompts
from jaxrl.tasks.mixture import parse_mixture
from jaxrl.tasks.sections import SFTSection, TaskSection


def sft_draws(sft: SFTSection, seed: int) -> tuple[int, int]:
  """(examples, seed) of the SFT corpus (``seed``: the run's): fresh examples for every step
  (drawing is cheap), so the warm start never repeats one."""
  return max(sft.steps, 1) * sft.batch_size, rng.numpy_seed(seed, rng.SFT)


def task_levels(task: TaskSection, parse: Callable[[str], tuple]) -> tuple:
  """The task's levels from ``task.levels`` (``parse``: the task's reader), a ConfigError naming
  the field for a bad or repeated one."""
  try:
    levels = parse(task.levels)
  except ValueError as e:
    raise ConfigError("task.levels", str(e)) from None
  repeated = sorted({s.name for s in levels if levels.count(s) > 1})
  if repeated:
    raise ConfigError("task.levels", f"{', '.join(repeated)} named twice")
  return levels


def sft_level_weights(
  task: TaskSection, levels: Sequence, parse: Callable[[str], tuple]
) -> tuple[float, ...] | None:
  """Per level of the task, its relative weight in the SFT corpus from ``task.sft_levels``, a
  mixture of level names ("2x2+,5x1+,5x3*:0.1"; ``parse`` reads one name to its level): the named
  levels at their weights (default 1), the others 0; None (every level alike) for ''."""
  field = "task.sft_levels"
  if not task.sft_levels.strip():
    return None
  weight_of: dict = {}
  for name, weight in parse_mixture(task.sft_levels, field):
    try:
      (level,) = parse(name)
    except ValueError as e:
      raise ConfigError(field, str(e)) from None
    if level in weight_of:
      raise ConfigError(field, f"{level.name} named twice")
    weight_of[level] = weight
  unknown = set(weight_of) - set(levels)
  if unknown:
    raise ConfigError(
      field,
      f"{', '.join(sorted(s.name for s in unknown))} not among the levels "
      f"{', '.join(s.name for s in levels)}",
    )
  return tuple(weight_of.get(s, 0.0) for s in levels)


def fields(tok, level_names: Sequence[str], train, heldout, p: int) -> dict:
  """The tokenizer's and both splits' ``TaskData`` fields; prompts left-padded to ``p``."""
  return dict(
    tokenizer=tok,
    vocab_size=len(tok),
    pad_id=tok.pad_token_id,
    eos_id=tok.eos_token_id,
    level_names=tuple(level_names),
    **_split("train", tok, train, p),
    **_split("heldout", tok, heldout, p),
  )


def _split(name: str, tok, problems, p: int) -> dict:
  ids, mask = encode_prompts(tok, [q.prompt for q in problems], p)
  return {
    f"{name}_prompt_ids": ids,
    f"{name}_prompt_mask": mask,
    f"{name}_answers": np.asarray([q.answer for q in problems], dtype=object),
    f"{name}_levels": np.asarray([q.level for q in problems], np.int32),
  }


def sft_fields(tok, pairs: list[tuple[str, str]], p: int, n: int) -> dict:
  """The SFT fields of (prompt, completion) pairs: every completion token is learned."""
  sft_ids, sft_mask = encode_prompts(tok, [a for a, _ in pairs], p)
  tgt_ids, tgt_mask = encode_completions(tok, [b for _, b in pairs], n)
  return dict(
    sft_prompt_ids=sft_ids,
    sft_prompt_mask=sft_mask,
    sft_target_ids=tgt_ids,
    sft_target_mask=tgt_mask,
  )
