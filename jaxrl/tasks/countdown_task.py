"""The countdown task (``task.name = "countdown"``): its config, prompt length and ``TaskData``
fields.

Its levels are ``jaxrl.tasks.data.countdown`` specs ("4n19"); its vocabulary is the tokenizer's
``countdown`` variant; its scorer checks each response's expression in process
(``jaxrl.tasks.rewards.countdown``); its SFT corpus shows one reference solution per problem.
"""

from __future__ import annotations

from jaxrl.fields import ConfigError
from jaxrl.tasks import builtin
from jaxrl.tasks.data import countdown
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.rewards.countdown import CountdownScorer
from jaxrl.tasks.sections import TaskSection, TaskSections

NAME = "countdown"


def task_config(task: TaskSection, seed: int) -> countdown.CountdownConfig:
  """The problems' config (``seed``: the run's)."""
  levels = builtin.task_levels(task, countdown.parse_levels)
  return countdown.CountdownConfig(
    levels=levels,
    num_train_per_level=task.num_train_per_level,
    num_heldout_per_level=task.num_heldout_per_level,
    seed=seed,
    sft_level_weights=builtin.sft_level_weights(task, levels, countdown.parse_levels),
  )


def check(task: TaskSection, levels: tuple, shortest: int) -> None:
  """Every phase's response (the shortest: ``shortest`` tokens) holds the longest expression a
  level can need, and EOS."""
  need = countdown.max_lengths(levels)[1] + 1
  if shortest < need:
    raise ConfigError(
      "rollout.max_new_tokens",
      f"the countdown levels {task.levels or '(default)'} need up to {need} tokens for an "
      f"expression and EOS; the shortest phase's response is {shortest}",
    )


def tokenizer_variant(task: TaskSection) -> str:
  """``jaxrl.tasks.data.tokenizer``'s variant: the default ids and ``, : ( )``."""
  return "countdown"


def prompt_len(task: TaskSection, levels: tuple | None = None) -> int:
  """P: task.max_prompt_len, or the longest prompt of the levels + BOS (``levels``: the task's
  when they are at hand)."""
  levels = levels or builtin.task_levels(task, countdown.parse_levels)
  return task.max_prompt_len or countdown.max_lengths(levels)[0] + 1


def load(s: TaskSections, tokenizer_dir: str) -> dict:
  """The fields of a ``TaskData`` (``jaxrl.tasks.task.load_task`` builds it); reads the task, sft
  and rollout sections (every phase's response length) and the seed."""
  tcfg = task_config(s.task, s.seed)
  check(s.task, tcfg.levels, s.rollout.shortest_response)
  tok = vocab.build_tokenizer(tokenizer_dir, tokenizer_variant(s.task))
  p, n = prompt_len(s.task, tcfg.levels), s.rollout.max_new_tokens
  num_sft, sft_seed = builtin.sft_draws(s.sft, s.seed)
  train, heldout = countdown.build_task(tcfg)
  pairs = countdown.sft_corpus(tcfg, num_sft, sft_seed)
  return dict(
    **builtin.fields(tok, [spec.name for spec in tcfg.levels], train, heldout, p),
    **builtin.sft_fields(tok, pairs, p, n),
    scorer=CountdownScorer(),
  )
