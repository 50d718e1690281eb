"""The countdown task (``task.name = "countdown"``): its config, prompt length and ``TaskData``
fields.

Its levels are ``jaxrl.tasks.data.countdown`` specs ("4n19"); its vocabulary is the tokenizer's
``countdown`` variant; its scorer checks each response's expression in process
(``jaxrl.tasks.rewards.countdown``); its SFT corpus shows one reference solution per problem.
"""

from __future__ import annotations

from jaxrl.config import Config, ConfigError
from jaxrl.config.anneal_phase import shortest_response
from jaxrl.tasks import builtin
from jaxrl.tasks.data import countdown
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.rewards.countdown import CountdownScorer

NAME = "countdown"


def task_config(cfg: Config) -> countdown.CountdownConfig:
  levels = builtin.task_levels(cfg, countdown.parse_levels)
  return countdown.CountdownConfig(
    levels=levels,
    num_train_per_level=cfg.task.num_train_per_level,
    num_heldout_per_level=cfg.task.num_heldout_per_level,
    seed=cfg.seed,
    sft_level_weights=builtin.sft_level_weights(cfg, levels, countdown.parse_levels),
  )


def check(cfg: Config, tcfg: countdown.CountdownConfig | None = None) -> None:
  """Every phase's response holds the longest expression a level can need, and EOS (``tcfg``:
  the task's config when it is at hand)."""
  need = countdown.max_lengths((tcfg or task_config(cfg)).levels)[1] + 1
  n = shortest_response(cfg)
  if n < need:
    raise ConfigError(
      "rollout.max_new_tokens",
      f"the countdown levels {cfg.task.levels or '(default)'} need up to {need} tokens for an "
      f"expression and EOS; the shortest phase's response is {n}",
    )


def tokenizer_variant(cfg: Config) -> str:
  """``jaxrl.tasks.data.tokenizer``'s variant: the default ids and ``, : ( )``."""
  return "countdown"


def prompt_len(cfg: Config, tcfg: countdown.CountdownConfig | None = None) -> int:
  """P: task.max_prompt_len, or the longest prompt of the levels + BOS (``tcfg``: the task's
  config when it is at hand)."""
  return cfg.task.max_prompt_len or countdown.max_lengths((tcfg or task_config(cfg)).levels)[0] + 1


def load(cfg: Config, tokenizer_dir: str) -> dict:
  tcfg = task_config(cfg)
  check(cfg, tcfg)
  tok = vocab.build_tokenizer(tokenizer_dir, tokenizer_variant(cfg))
  p, n = prompt_len(cfg, tcfg), cfg.rollout.max_new_tokens
  num_sft, sft_seed = builtin.sft_draws(cfg)
  train, heldout = countdown.build_task(tcfg)
  pairs = countdown.sft_corpus(tcfg, num_sft, sft_seed)
  return dict(
    **builtin.fields(tok, [s.name for s in tcfg.levels], train, heldout, p),
    **builtin.sft_fields(tok, pairs, p, n),
    scorer=CountdownScorer(),
  )
