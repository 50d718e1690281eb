"""Math prompts from a checkpoint's own tokenizer: chat template, a \\boxed{} instruction, left padding.

The question is rendered with the template (``boxed``: the question and DeepSeek-R1's recommended
"Please reason step by step, and put your final answer within \\boxed{}."), wrapped in the
tokenizer's chat template with the generation prompt, and tokenised without added special tokens
(the chat template already carries any BOS; without one, BOS is prepended when the tokenizer has
it). Prompts longer than P are dropped, truncated inside the question (the chat frame and the
instruction stay whole) or refused, and counted.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_QUESTION = "{question}"
_TEMPLATES = {"boxed": "{question}\n\n" + BOXED_INSTRUCTION, "plain": "{question}"}
_MARK = "\x00QUESTION\x00"   # stands for the question while the frame is tokenised


def load_tokenizer(checkpoint_dir: str):
  """The checkpoint's tokenizer (local files only), left-padding, pad = eos when it has none."""
  import transformers

  tok = transformers.AutoTokenizer.from_pretrained(checkpoint_dir, local_files_only=True)
  if tok.pad_token_id is None:   # Llama 3: no pad token; padded positions are masked anyway
    tok.pad_token = tok.eos_token
  tok.padding_side = "left"
  return tok


def stop_token_ids(checkpoint_dir: str, tokenizer) -> tuple[int, ...]:
  """generation_config.json's eos_token_id (an int or a list), then the tokenizer's eos."""
  ids: list[int] = []
  path = os.path.join(checkpoint_dir, "generation_config.json")
  if os.path.exists(path):
    with open(path) as f:
      eos = json.load(f).get("eos_token_id")
    ids.extend([eos] if isinstance(eos, int) else list(eos or []))
  if tokenizer.eos_token_id is not None:
    ids.append(tokenizer.eos_token_id)
  out = tuple(dict.fromkeys(int(i) for i in ids))
  if not out:
    raise ValueError(f"{checkpoint_dir}: no eos token in generation_config.json or the tokenizer")
  return out


def _template(template: str) -> str:
  text = _TEMPLATES.get(template, template)
  if _QUESTION not in text:
    raise ValueError(f"data.template {template!r}: expected boxed, plain, or a string with "
                     "{question}")
  return text


def render_prompt(tokenizer, question: str, *, template: str = "boxed", system_prompt: str = "",
                  chat_template: bool = True) -> str:
  """The prompt text the model is conditioned on (chat template + generation prompt if any)."""
  user = _template(template).replace(_QUESTION, question)
  if not (chat_template and getattr(tokenizer, "chat_template", None)):
    return user
  messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
      {"role": "user", "content": user}]
  return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
  ids_QxP: np.ndarray     # i32 [kept, P], left-padded with the pad id
  mask_QxP: np.ndarray    # bool [kept, P]
  kept_Q: np.ndarray      # i64: which input questions these rows are (dropped ones absent)
  truncated: int
  dropped: int


def _ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
  return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []


def encode_math_prompts(tokenizer, questions: Sequence[str], max_len: int, *,
                        overlength: str = "drop", template: str = "boxed", system_prompt: str = "",
                        chat_template: bool = True) -> EncodedPrompts:
  """Left-padded prompt ids of every question that fits in ``max_len`` tokens (see module doc)."""
  if overlength not in ("drop", "truncate", "error"):
    raise ValueError(f"overlength {overlength!r}: expected drop, truncate or error")
  render = lambda q: render_prompt(tokenizer, q, template=template,  # noqa: E731
                                   system_prompt=system_prompt, chat_template=chat_template)
  bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
  frame = render(_MARK)
  if frame.count(_MARK) != 1:
    raise ValueError("the chat template must contain the user message exactly once")
  head_text, tail_text = frame.split(_MARK)
  # BOS only when the chat frame does not already start with it.
  lead = [] if bos and head_text.startswith(tokenizer.bos_token or "\x01") else bos
  texts = [render(q) for q in questions]
  seqs = [lead + ids for ids in _ids(tokenizer, texts)]
  kept, rows, truncated, dropped = [], [], 0, 0
  for i, ids in enumerate(seqs):
    if len(ids) <= max_len:
      kept.append(i)
      rows.append(ids)
    elif overlength == "error":
      raise ValueError(f"question {i} needs {len(ids)} prompt tokens, more than "
                       f"task.max_prompt_len={max_len} (data.overlength=error)")
    elif overlength == "drop":
      dropped += 1
    else:
      cut = _truncate(tokenizer, questions[i], head_text, tail_text, lead, max_len)
      if cut is None:
        dropped += 1
      else:
        kept.append(i)
        rows.append(cut)
        truncated += 1
  ids_QxP = np.full((len(rows), max_len), tokenizer.pad_token_id, np.int32)
  mask_QxP = np.zeros((len(rows), max_len), bool)
  for r, ids in enumerate(rows):
    if ids:
      ids_QxP[r, max_len - len(ids):] = ids
      mask_QxP[r, max_len - len(ids):] = True
  if truncated or dropped:
    log.info("%d of %d prompts longer than %d tokens: %d truncated, %d dropped", truncated + dropped,
             len(questions), max_len, truncated, dropped)
  return EncodedPrompts(ids_QxP, mask_QxP, np.asarray(kept, np.int64), truncated, dropped)


def _truncate(tokenizer, question: str, head_text: str, tail_text: str, lead: list[int],
              max_len: int) -> list[int] | None:
  """Frame head + the question's first tokens + frame tail, within max_len; None if no room.

  The frame (chat header, instruction, generation prompt) is tokenised on its own, so token merges
  at the two seams may differ from the untruncated text's; the question is cut, never the frame.
  """
  head, tail = _ids(tokenizer, [head_text])[0], _ids(tokenizer, [tail_text])[0]
  room = max_len - len(lead) - len(head) - len(tail)
  if room <= 0:
    return None
  q_ids = _ids(tokenizer, [question])[0][:room]
  return lead + head + q_ids + tail
