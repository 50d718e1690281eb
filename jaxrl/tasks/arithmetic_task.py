"""The arithmetic task (``task.name = "arithmetic"``, the embedded default): its config, prompt
length and ``TaskData`` fields.

Its levels are ``jaxrl.tasks.data.arithmetic`` specs ("5x3*"); answers are scored by exact match
in process. With ``task.environment = "calculator"`` it is its tools form
(``jaxrl.tasks.tools_task``): the tools vocabulary, an SFT corpus of calls whose environment
tokens are not learned, the final answer after the last result scored; with
``task.chat_template`` all of it in its vocabulary's ChatML template (``jaxrl.tasks.envs.chat``).
"""

from __future__ import annotations

import dataclasses

from jaxrl.tasks import builtin, tools_task
from jaxrl.tasks.data import arithmetic, tool_calls
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.envs import calculator
from jaxrl.tasks.envs.chat import user_prompt
from jaxrl.tasks.envs.registry import build_environment, run_chat_frame
from jaxrl.tasks.rewards.arithmetic import FinalAnswerScorer
from jaxrl.tasks.sections import TaskSection, TaskSections

NAME = "arithmetic"


def task_config(task: TaskSection, seed: int) -> arithmetic.TaskConfig:
  """The problems' config (``seed``: the run's); tasks/rewards/train_rm.py builds the same one."""
  levels = builtin.task_levels(task, arithmetic.parse_levels)
  return arithmetic.TaskConfig(
    levels=levels,
    sft_level_weights=builtin.sft_level_weights(task, levels, arithmetic.parse_levels),
    num_train_per_level=task.num_train_per_level,
    num_heldout_per_level=task.num_heldout_per_level,
    seed=seed,
    reverse_answer=task.reverse_answer,
    digit_width=task.digit_width,
  )


def tokenizer_variant(task: TaskSection) -> str:
  """``jaxrl.tasks.data.tokenizer``'s variant: the tools vocabulary with the calculator (in its
  chat form with ``task.chat_template``)."""
  if task.environment != calculator.NAME:
    return ""
  return "tools_chat" if task.chat_template else "tools"


def prompt_len(task: TaskSection, levels: tuple | None = None) -> int:
  """P: task.max_prompt_len, or the longest prompt of the levels + BOS (+ the chat template's
  frame) (``levels``: the task's when they are at hand)."""
  levels = levels or builtin.task_levels(task, arithmetic.parse_levels)
  frame = vocab.CHAT_PROMPT_TOKENS if task.chat_template else 0
  longest = arithmetic.max_lengths(levels, task.digit_width)[0]
  return task.max_prompt_len or longest + 1 + frame


def _in_chat(tok, chat, problems: list) -> list:
  """Each problem (or SFT example) with its prompt as the chat template's user turn."""
  if chat is None:
    return problems
  return [dataclasses.replace(q, prompt=user_prompt(tok, q.prompt)) for q in problems]


def load(s: TaskSections, tokenizer_dir: str) -> dict:
  """The fields of a ``TaskData`` (``jaxrl.tasks.task.load_task`` builds it); reads the task, data,
  sft, rollout and tool sections and the seed."""
  tools = s.task.environment == calculator.NAME
  if tools:
    tools_task.check(s.task)
  tcfg = task_config(s.task, s.seed)
  tok = vocab.build_tokenizer(tokenizer_dir, tokenizer_variant(s.task))
  p, n = prompt_len(s.task, tcfg.levels), s.rollout.max_new_tokens
  num_sft, sft_seed = builtin.sft_draws(s.sft, s.seed)
  environment = build_environment(tok, task=s.task, data=s.data, tool=s.tool, rollout=s.rollout)
  chat = run_chat_frame(tok, task=s.task, data=s.data, tool=s.tool) if tools else None
  train, heldout = (_in_chat(tok, chat, split) for split in arithmetic.build_task(tcfg))
  if tools:
    examples = _in_chat(tok, chat, tool_calls.sft_examples(tcfg, num_sft, sft_seed))
    sft = tools_task.sft_arrays(tok, environment, examples, p, n)
    # The final answer follows the last observation: its closing tag, or in a chat the header of
    # the model's last turn.
    scorer = FinalAnswerScorer(calculator.RESULT_CLOSE if chat is None else chat.assistant_header)
  else:
    sft = builtin.sft_fields(tok, arithmetic.sft_corpus(tcfg, num_sft, seed=sft_seed), p, n)
    scorer = None
  return dict(
    **builtin.fields(tok, [spec.name for spec in tcfg.levels], train, heldout, p),
    **sft,
    scorer=scorer,
    environment=environment,
  )
