"""Name → factory for every environment ``task.environment`` can choose.

A factory takes the task's tokenizer and, by keyword, the sections an environment reads (``task``,
``data``, ``tool``, ``rollout``; one signature for every environment) and returns an
``Environment`` (``jaxrl.tasks.envs.environment``). Adding one is its factory plus one line in ``ENVIRONMENTS``;
``check`` raises the one-line ``ConfigError`` for a name that is not registered.
"""

from __future__ import annotations

from typing import Callable

from jaxrl.fields import ConfigError
from jaxrl.tasks.envs import calculator
from jaxrl.tasks.envs.chat import ChatFrame, ChatTemplateError, chat_frame
from jaxrl.tasks.envs.environment import Environment
from jaxrl.tasks.envs.tool import FrameTooLong, ToolEnvironment, ToolLimits
from jaxrl.tasks.sections import DataSection, RolloutLimits, TaskSection, ToolSection


def tool_limits(t: ToolSection) -> ToolLimits:
  """The bounds of tool calls (``config.tool``)."""
  return ToolLimits(workers=t.workers, time_limit_s=t.time_limit, memory_limit_mb=t.memory_limit_mb)


def uses_chat_template(task: TaskSection, data: DataSection) -> bool:
  """Are the run's prompts, and so its observations, in the tokenizer's chat template? The built-in
  task's ``task.chat_template``; the math task's ``data.chat_template`` (where its tokenizer has
  one: ``run_chat_frame``)."""
  return task.chat_template if task.name != "math" else data.chat_template


def run_chat_frame(
  tokenizer, *, task: TaskSection, data: DataSection, tool: ToolSection
) -> ChatFrame | None:
  """The ``ChatFrame`` a tool environment of this run frames its answers with (None: raw ids after
  the model's turn); a ConfigError naming the field for a template that cannot frame them."""
  if not uses_chat_template(task, data) or not getattr(tokenizer, "chat_template", None):
    if task.chat_template:
      raise ConfigError("task.chat_template", "the task's tokenizer has no chat template")
    return None
  try:
    return chat_frame(tokenizer, tool.chat_role)
  except ChatTemplateError as e:
    field = "task.chat_template" if task.name != "math" else "data.chat_template"
    raise ConfigError(field, f"the tokenizer's chat template cannot frame a tool's answer: {e}")


def calculator_environment(
  tokenizer, *, task: TaskSection, data: DataSection, tool: ToolSection, rollout: RolloutLimits
) -> ToolEnvironment:
  """``<calc>EXPR</calc>`` answered ``<result>VALUE</result>`` (``calculator.calculate``), framed
  by the chat template where the run uses one."""
  try:
    return ToolEnvironment(
      tokenizer,
      tool=calculator.TOOL,
      call_open=calculator.CALL_OPEN,
      call_close=calculator.CALL_CLOSE,
      result_open=calculator.RESULT_OPEN,
      result_close=calculator.RESULT_CLOSE,
      max_turns=rollout.max_turns,
      max_observation_tokens=rollout.max_observation_tokens,
      limits=tool_limits(tool),
      chat=run_chat_frame(tokenizer, task=task, data=data, tool=tool),
    )
  except FrameTooLong as e:
    raise ConfigError("rollout.max_observation_tokens", str(e)) from None


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
  calculator.NAME: calculator_environment,
}


def check(task: TaskSection) -> None:
  """``task.environment`` is "" or registered (one-line ``ConfigError`` naming the field)."""
  name = task.environment
  if name and name not in ENVIRONMENTS:
    raise ConfigError("task.environment", f"{name!r} is not one of {('', *ENVIRONMENTS)}")


def build_environment(
  tokenizer, *, task: TaskSection, data: DataSection, tool: ToolSection, rollout: RolloutLimits
) -> Environment | None:
  """The run's environment, ``task.environment`` (None: single-turn); close it when the run ends."""
  check(task)
  name = task.environment
  if not name:
    return None
  return ENVIRONMENTS[name](tokenizer, task=task, data=data, tool=tool, rollout=rollout)
