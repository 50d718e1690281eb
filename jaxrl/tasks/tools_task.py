"""The arithmetic task with the calculator (``task.environment = "calculator"``): its checks and
its SFT corpus as token arrays (``jaxrl.tasks.task.load_task`` builds the rest).

An SFT example is the trajectory a multi-turn rollout would produce, id for id: the model's call
``<calc>a*b</calc>``, the environment's observation (from ``ToolEnvironment.observation_ids``, the
ids the environment itself answers with), then the model's answer and EOS. In a chat template the
calling turn ends with the end-of-turn token, and the observation is the template's tool message
and next assistant header. The environment's ids are read (``sft_target_mask``) but not learned
(``sft_loss_mask``): only the model's tokens train, in SFT as in RL.
"""

from __future__ import annotations

import numpy as np

from jaxrl.fields import ConfigError
from jaxrl.tasks.data.prompts import encode_prompts
from jaxrl.tasks.data.tool_calls import ToolExample
from jaxrl.tasks.envs.calculator import CALL_CLOSE, CALL_OPEN, calculate
from jaxrl.tasks.envs.tool import ToolEnvironment
from jaxrl.tasks.sections import TaskSection


def check(task: TaskSection) -> None:
  """The numbers are written as usual, so that a result is copied as it is."""
  if task.digit_width:
    raise ConfigError(
      "task.digit_width", "the calculator task writes numbers as usual: set task.digit_width=0"
    )
  if task.reverse_answer:
    raise ConfigError(
      "task.reverse_answer",
      "the calculator answers most-significant digit first: set task.reverse_answer=False",
    )


def completions(tok, env: ToolEnvironment, examples: list[ToolExample]):
  """Each example's (completion ids, which of them the model wrote), EOS included; the texts are
  tokenized in batches, each piece apart, as a rollout's ids are."""

  def ids(texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=False)["input_ids"] if texts else []

  calls = [e for e in examples if e.call is not None]
  # A chat model ends its calling turn with its end-of-turn token (the EOS ends its last one).
  end_of_turn = [] if env.chat is None else [env.chat.end_of_turn_id]
  turns = iter(t + end_of_turn for t in ids([CALL_OPEN + e.call + CALL_CLOSE for e in calls]))
  results = iter(ids([calculate(e.call) for e in calls]))
  for example, answer in zip(examples, ids([e.answer for e in examples])):
    answer = answer + [tok.eos_token_id]
    if example.call is None:
      yield answer, [True] * len(answer)
      continue
    turn = next(turns)
    observation, _ = env.observation_of(next(results))
    yield (
      turn + observation + answer,
      [True] * len(turn) + [False] * len(observation) + [True] * len(answer),
    )


def sft_arrays(tok, env: ToolEnvironment, examples: list[ToolExample], p: int, n: int) -> dict:
  """The ``TaskData`` SFT fields: prompts left-padded to ``p``, completions right-padded to ``n``
  (``sft_target_mask``: the completion; ``sft_loss_mask``: its model tokens)."""
  prompt_ids, prompt_mask = encode_prompts(tok, [e.prompt for e in examples], p)
  target_ids = np.full((len(examples), n), tok.pad_token_id, np.int32)
  target_mask = np.zeros((len(examples), n), bool)
  loss_mask = np.zeros((len(examples), n), bool)
  for i, (example, (ids, by_model)) in enumerate(zip(examples, completions(tok, env, examples))):
    if len(ids) > n:
      raise ValueError(
        f"the SFT example {example} needs {len(ids)} tokens, more than rollout.max_new_tokens={n}"
      )
    target_ids[i, : len(ids)] = ids
    target_mask[i, : len(ids)] = True
    loss_mask[i, : len(ids)] = by_model
  return dict(
    sft_prompt_ids=prompt_ids,
    sft_prompt_mask=prompt_mask,
    sft_target_ids=target_ids,
    sft_target_mask=target_mask,
    sft_loss_mask=loss_mask,
  )
