"""A multi-turn trajectory as text, part by part, each with who wrote it: for samples.jsonl.

The loss mask of a multi-turn response says who wrote each token: True for the model's tokens
(sampled, trained), False for the environment's (observations, never trained). Consecutive tokens
of one author are one part, decoded together, exactly as the ids lie in the response.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl.tasks.data.prompts import decode_responses

MODEL, ENVIRONMENT = "model", "environment"


def response_texts(tokenizer, rollouts, *, multi_turn: bool, eos_id=None) -> list[str]:
  """The text the verifier reads of each response of ``rollouts``: a multi-turn one without the
  gaps between its turns; cut at the first EOS the model wrote (``eos_id``, default the
  tokenizer's), never at one an environment wrote (an observation may hold any id)."""
  tokens_RxN, model_RxN = np.asarray(rollouts.tokens_RxN), np.asarray(rollouts.loss_mask_RxN)
  if multi_turn:
    mask_RxN = np.asarray(rollouts.mask_RxN)
    tokens_RxN, model_RxN = compact(tokens_RxN, mask_RxN), compact(model_RxN, mask_RxN)
  lengths_R = np.asarray(rollouts.lengths_R)
  return decode_responses(tokenizer, tokens_RxN, lengths_R, model_RxN, eos_id)


def compact(x_RxN, mask_RxN) -> np.ndarray:
  """Each row's values at its real response positions first, in order (a multi-turn response
  holds masked gaps between turns; a single-turn one is returned as it is)."""
  order = np.argsort(~np.asarray(mask_RxN, bool), axis=1, kind="stable")
  return np.take_along_axis(np.asarray(x_RxN), order, axis=1)


def trajectory_parts(
  tokenizer,
  ids_N: Sequence[int],
  model_mask_N: Sequence[bool],
  length: int | None = None,
  eos_id: int | Sequence[int] | None = None,
) -> list[dict]:
  """``[{"by": "model" | "environment", "text": ...}, ...]`` of one response.

  ``length``: the response's tokens (default all of ``ids_N``); the model's first EOS that no
  environment token follows (``eos_id``, default the tokenizer's; a task's list of stop ids)
  ends it, not shown, as in ``decode_responses`` (a chat model's end-of-turn id ends its turns
  too: those stay, shown); other special tokens keep their text.
  """
  ids = np.asarray(ids_N).tolist()
  mask = np.asarray(model_mask_N, bool).tolist()
  if len(ids) != len(mask):
    raise ValueError(f"{len(ids)} ids but {len(mask)} mask entries")
  n = len(ids) if length is None else max(0, min(int(length), len(ids)))
  eos = tokenizer.eos_token_id if eos_id is None else eos_id
  eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
  last_env = max((k for k in range(n) if not mask[k]), default=-1)
  parts: list[dict] = []
  run: list[int] = []
  by = None
  for k, (token, is_model) in enumerate(zip(ids[:n], mask[:n])):
    if is_model and token in eos_ids and k > last_env:
      break
    author = MODEL if is_model else ENVIRONMENT
    if author != by and run:
      parts.append({"by": by, "text": tokenizer.decode(run, skip_special_tokens=False)})
      run = []
    by = author
    run.append(token)
  if run:
    parts.append({"by": by, "text": tokenizer.decode(run, skip_special_tokens=False)})
  return parts


def trajectory_text(parts: Sequence[dict]) -> str:
  """One line of a trajectory, the environment's parts in brackets:
  ``<calc>2*3</calc>[<result>6</result>]6``."""
  return "".join(p["text"] if p["by"] == MODEL else f"[{p['text']}]" for p in parts)
