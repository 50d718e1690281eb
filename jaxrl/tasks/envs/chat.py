"""A tool's answer framed as a chat model expects it, read off the tokenizer's own chat template.

An instruct model (Qwen2.5/3's ChatML, Llama 3's headers) ends each of its turns with an
end-of-turn token (``<|im_end|>``, ``<|eot_id|>``); a tool's answer arrives as a message of the
tool role, and a new assistant header opens the model's next turn. ``chat_frame`` renders a short
conversation with the template and cuts it at the model's end-of-turn token and around the tool
message's content, so an observation is

  ``before_tool`` + the tool's text + ``after_tool``      (e.g. ``\\n<|im_start|>tool\\n`` … ``<|im_end|>\\n<|im_start|>assistant\\n``)

all of it the environment's tokens (read, never trained), while the end-of-turn token is the
model's: the turn's stop, sampled and trained (as verl and SkyRL train it). The same cut gives the
assistant header, after whose last occurrence a response's final answer lies.
"""

from __future__ import annotations

import dataclasses

# Stand-ins rendered by the template and found again in its text; no template rewrites them.
_QUESTION, _REPLY, _TOOL = "QUESTIONq7", "REPLYr7", "TOOLt7"


@dataclasses.dataclass(frozen=True)
class ChatFrame:
  """The chat template's text around a model turn and a tool message (``chat_frame``)."""

  end_of_turn: str  # the token that ends the model's turn: its stop, sampled and trained
  end_of_turn_id: int
  before_tool: str  # after the end-of-turn token up to the tool message's content
  after_tool: str  # after the tool message's content through the next assistant header
  assistant_header: str  # what opens an assistant turn (the generation prompt)


class ChatTemplateError(ValueError):
  """The tokenizer's chat template cannot frame a tool's answer (which part, and why)."""


def render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
  return tokenizer.apply_chat_template(
    messages, tokenize=False, add_generation_prompt=generation_prompt
  )


def user_prompt(tokenizer, question: str) -> str:
  """The template's text of a conversation of one user message, the assistant header last."""
  return render(tokenizer, [{"role": "user", "content": question}], generation_prompt=True)


def _special_tokens(tokenizer) -> list[str]:
  added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
  return sorted(set(tokenizer.all_special_tokens) | set(added), key=len, reverse=True)


def chat_frame(tokenizer, tool_role: str = "tool") -> ChatFrame:
  """The ``ChatFrame`` of ``tokenizer``'s chat template, the tool's answer in role ``tool_role``
  ("tool" for ChatML and Llama 3.1's own templates, which map it to their ``ipython`` role)."""
  if not getattr(tokenizer, "chat_template", None):
    raise ChatTemplateError("the tokenizer has no chat template")
  user = {"role": "user", "content": _QUESTION}
  bare = render(tokenizer, [user], generation_prompt=False)
  prompt = render(tokenizer, [user], generation_prompt=True)
  if not prompt.startswith(bare) or prompt == bare:
    raise ChatTemplateError("its generation prompt is not an assistant header after the messages")
  header = prompt[len(bare) :]
  turn = render(
    tokenizer, [user, {"role": "assistant", "content": _REPLY}], generation_prompt=False
  )
  end = turn.find(_REPLY) + len(_REPLY)
  if end < len(_REPLY):
    raise ChatTemplateError("it drops the assistant message's content")
  eot = next((t for t in _special_tokens(tokenizer) if turn.startswith(t, end)), None)
  if eot is None:
    raise ChatTemplateError(
      f"no special token ends the assistant's turn (it is followed by {turn[end : end + 20]!r})"
    )
  full = render(
    tokenizer,
    [user, {"role": "assistant", "content": _REPLY}, {"role": tool_role, "content": _TOOL}],
    generation_prompt=True,
  )
  cut = end + len(eot)
  if not full.startswith(turn[:cut]):
    raise ChatTemplateError("it renders the model's turn otherwise once a tool message follows")
  before, found, after = full[cut:].partition(_TOOL)
  if not found:
    raise ChatTemplateError(f"it drops the content of a {tool_role!r} message")
  if not after.endswith(header):
    raise ChatTemplateError("no assistant header follows the tool message")
  return ChatFrame(
    end_of_turn=eot,
    end_of_turn_id=int(tokenizer.convert_tokens_to_ids(eot)),
    before_tool=before,
    after_tool=after,
    assistant_header=header,
  )
