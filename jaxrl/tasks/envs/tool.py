"""An environment whose model turns call one tool: ``OPEN call CLOSE`` is answered
``RESULT_OPEN value RESULT_CLOSE``, the call running in a bounded worker.

With a ``ChatFrame`` (``jaxrl.tasks.envs.chat``: the tokenizer's chat template) the model's turn
ends with its end-of-turn token instead, which is the turn's stop (sampled, trained); a turn that
holds ``CLOSE`` asks the tool (``call_ids``), one without it is the final answer. The value then
arrives as the template's tool message, the next assistant header after it, all of it the
environment's tokens.

The tool is a ``module:function`` spec, ``tool(call: str) -> str``: the text the model reads
(a tool reports its own errors the same way, e.g. ``"error: syntax"``). It runs in the pool of
``jaxrl.tasks.workers`` (time and memory limits, crashes contained); a call that hangs, crashes,
raises or returns something other than text is answered ``error: timeout`` / ``error: tool
failed``, and the other rows of the batch get their answers. The value is cut to
``MAX_RESULT_CHARS`` in the worker (``tool_text``) and its ids to ``max_observation_tokens``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from jaxrl.tasks.envs.chat import ChatFrame
from jaxrl.tasks.envs.environment import StepResult, TurnState, bounded_observation, token_ids
from jaxrl.tasks.worker_process import BadResult
from jaxrl.tasks.workers import WorkerPool

TOOL_CHECK = "jaxrl.tasks.envs.tool:tool_text"  # run by the worker on each value
MAX_RESULT_CHARS = 4096  # far above an observation's tokens, far below harm (a 1 MB answer)
MAX_CALL_CHARS = 4096  # what is sent to the tool of a longer call (a tool bounds its own input)
TIMEOUT, FAILED, NO_CALL = "error: timeout", "error: tool failed", "error: no call"


def tool_text(value) -> str:
  """A tool's value as the worker sends it back: text, at most ``MAX_RESULT_CHARS``."""
  if not isinstance(value, str):
    raise BadResult(f"returned {type(value).__name__}, not str")
  return value[:MAX_RESULT_CHARS]


class FrameTooLong(ValueError):
  """The chat template's frame of an answer does not fit ``max_observation_tokens``."""


@dataclasses.dataclass(frozen=True)
class ToolLimits:
  """How the tool's calls are bounded (``config.tool``)."""

  workers: int = 0  # 0 = min(4, CPUs)
  time_limit_s: float = 2.0
  memory_limit_mb: int = 1024
  kill_grace_s: float = 0.5
  batch_time_limit_s: float | None = None  # None: the pool's default (about one limit)


class ToolEnvironment:
  """``Environment`` (``jaxrl.tasks.envs.environment``) for one tool called with tags.

  A turn that ends with ``call_close`` is a call: the text after its last ``call_open``. Each row
  gets at most ``max_turns`` model turns: the turn that reaches it ends the trajectory unanswered.
  Worker processes start at the first call, not before; one caller at a time (the pool is not
  thread-safe); ``close`` stops them.
  """

  def __init__(
    self,
    tokenizer,
    *,
    tool: str,
    call_open: str,
    call_close: str,
    result_open: str,
    result_close: str,
    max_turns: int,
    max_observation_tokens: int,
    limits: ToolLimits = ToolLimits(),
    marker: str = "...",
    chat: ChatFrame | None = None,
  ):
    if max_turns < 1 or max_observation_tokens < 1:
      raise ValueError(
        f"need max_turns, max_observation_tokens >= 1, got {max_turns}, {max_observation_tokens}"
      )
    self.tokenizer = tokenizer
    self.tool = tool
    self.call_open, self.call_close = call_open, call_close
    self.max_turns = max_turns
    self.max_observation_tokens = max_observation_tokens
    self.limits = limits
    self.chat = chat
    self._marker = token_ids(tokenizer, marker)
    if chat is None:
      self.stop_strings = (call_close,)
      self.stop_sequences = (tuple(token_ids(tokenizer, call_close)),)
      self.call_ids: tuple[int, ...] = ()
      self._head = token_ids(tokenizer, result_open)
      self._tail = token_ids(tokenizer, result_close)
    else:
      self.stop_strings = (chat.end_of_turn,)
      self.stop_sequences = ((chat.end_of_turn_id,),)
      self.call_ids = tuple(token_ids(tokenizer, call_close))
      if len(self.call_ids) != 1:  # a sampler marks a call by one id
        raise ValueError(f"with a chat template {call_close!r} must be one token")
      self._head = token_ids(tokenizer, chat.before_tool + result_open)
      self._tail = token_ids(tokenizer, result_close + chat.after_tool)
      framing = len(self._head) + len(self._tail) + len(self._marker) + 1
      if framing > max_observation_tokens:  # a cut frame would lose the next assistant header
        raise FrameTooLong(
          f"the chat template's tool message and assistant header take {framing - 1} tokens "
          f"with the cut marker: max_observation_tokens={max_observation_tokens} leaves no room"
        )
    self._pool: WorkerPool | None = None

  # -- the protocol ---------------------------------------------------------------------------

  def reset(self, question_ids: Sequence[int]) -> list[TurnState]:
    return [TurnState(int(q)) for q in question_ids]

  def step(
    self, states: Sequence[TurnState], turn_ids: Sequence[Sequence[int]], rows: Sequence[int]
  ) -> StepResult:
    if len(turn_ids) != len(rows):
      raise ValueError(f"{len(turn_ids)} turns for {len(rows)} rows")
    states = list(states)
    observations: list[list[int]] = [[] for _ in rows]
    done = np.zeros(len(rows), bool)
    info: list[dict] = [{} for _ in rows]
    calls: dict[int, str] = {}  # index into rows -> the call's text
    for k, (row, ids) in enumerate(zip(rows, turn_ids)):
      state = states[row]
      if state.done:
        raise ValueError(f"row {row} is done: its trajectory has ended")
      state = dataclasses.replace(state, turns=state.turns + 1)
      if state.turns >= self.max_turns:  # no turn would follow the answer
        states[row] = dataclasses.replace(state, done=True)
        done[k], info[k] = True, {"status": "turn_limit"}
        continue
      states[row] = state
      call = self.parse_call(self.tokenizer.decode(list(ids), skip_special_tokens=False))
      if call is None:
        self._answer(states, row, k, NO_CALL, "no_call", observations, info)
      else:
        calls[k] = call
    for k, (status, text, error) in zip(calls, self._run(list(calls.values()))):
      self._answer(states, rows[k], k, text, status, observations, info, call=calls[k])
      if error:
        info[k]["error"] = error
    return StepResult(states, observations, done, info)

  def trajectory_reward(self, states: Sequence[TurnState]) -> np.ndarray | None:
    return None

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None

  # -- parts ----------------------------------------------------------------------------------

  def parse_call(self, turn_text: str) -> str | None:
    """The call of a turn: the text between its last ``call_open`` and the ``call_close`` that
    ends it; None without both."""
    end = turn_text.rfind(self.call_close)
    start = turn_text.rfind(self.call_open, 0, max(end, 0))
    if end < 0 or start < 0:
      return None
    return turn_text[start + len(self.call_open) : end]

  def observation_ids(self, text: str) -> tuple[list[int], bool]:
    """(the ids of ``RESULT_OPEN text RESULT_CLOSE`` within ``max_observation_tokens``, cut?)."""
    return self.observation_of(token_ids(self.tokenizer, text))

  def observation_of(self, body_ids: Sequence[int]) -> tuple[list[int], bool]:
    """``observation_ids`` of a text already tokenized (``token_ids``)."""
    return bounded_observation(
      self._head, body_ids, self._tail, self.max_observation_tokens, self._marker
    )

  def _answer(self, states, row, k, text, status, observations, info, call=None) -> None:
    """Row ``row`` (``rows[k]``) reads ``text``; its state counts the call."""
    observations[k], cut = self.observation_ids(text)
    info[k] = {"status": status, "truncated": cut}
    if call is not None:
      info[k]["call"] = call[:MAX_CALL_CHARS]
    state = states[row]
    states[row] = dataclasses.replace(
      state, calls=state.calls + 1, failures=state.failures + (status != "ok")
    )

  def _run(self, calls: list[str]) -> list[tuple[str, str, str | None]]:
    """(status, the text the model reads, the error for the log) of each call, in the bounded
    pool."""
    if not calls:
      return []
    if self._pool is None:
      lim = self.limits
      self._pool = WorkerPool(
        self.tool,
        check=TOOL_CHECK,
        kind="tool",
        num_workers=lim.workers or min(4, os.cpu_count() or 1),
        time_limit_s=lim.time_limit_s,
        kill_grace_s=lim.kill_grace_s,
        batch_time_limit_s=lim.batch_time_limit_s,
        memory_limit_mb=lim.memory_limit_mb,
      )
    out = self._pool.run([(c[:MAX_CALL_CHARS],) for c in calls])
    answers = {"ok": None, "timeout": TIMEOUT, "skipped": TIMEOUT, "error": FAILED}
    return [
      (status, value if status == "ok" else answers[status], out.errors.get(i))
      for i, (status, value) in enumerate(zip(out.status, out.values))
    ]
