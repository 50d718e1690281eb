"""Text <-> fixed-shape token arrays for sampling (left-padded prompts) and SFT (right-padded).

Prompts and completions are tokenized separately and concatenated as ids, exactly as the sampler
sees them: [BOS] + prompt, then the completion + [EOS]. SFT and RL therefore condition on identical
prefixes. BOS is prepended only when the tokenizer has one (the task tokenizer does), so the same
code serves pretrained tokenizers without a BOS. Arrays are padded to the requested length, not to
the batch's longest, so jitted consumers see one shape and never recompile.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl.types import pytree_dataclass


@pytree_dataclass
class SFTArrays:
  """Next-token training data: the model reads ``inputs`` and predicts ``targets`` at each position.

  ``targets_BxL[:, t]`` is token t+1 of the sequence [BOS] + prompt + completion + [EOS];
  ``target_mask_BxL`` is True where that target is a completion token or the EOS (the prompt is not
  learned). Everything is right-padded: valid inputs come first, so positions are 0..len-1.
  """

  inputs_BxL: np.ndarray  # i32, pad_id after the sequence
  targets_BxL: np.ndarray  # i32, inputs shifted left by one, pad_id after the EOS
  target_mask_BxL: np.ndarray  # bool, True on completion + EOS targets
  attn_mask_BxL: np.ndarray  # bool, True on real input tokens


def _ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
  """Token ids of each text without any special tokens."""
  return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []


def prompt_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
  """Unpadded ids the model is conditioned on: [BOS] + prompt (BOS if the tokenizer has one)."""
  bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
  return [bos + ids for ids in _ids(tokenizer, prompts)]


def _check_len(kind: str, text: str, n: int, max_len: int):
  """Clear error for an example that does not fit (never truncate: it would change the task)."""
  if n > max_len:
    raise ValueError(f"{kind} {text!r} needs {n} tokens, more than max_len={max_len}")


def encode_prompts(
  tokenizer, prompts: Sequence[str], max_len: int
) -> tuple[np.ndarray, np.ndarray]:
  """(ids_BxP, mask_BxP) with P = max_len, LEFT-padded with pad_id so every prompt ends at P-1."""
  ids_BxP = np.full((len(prompts), max_len), tokenizer.pad_token_id, np.int32)
  mask_BxP = np.zeros((len(prompts), max_len), bool)
  for i, (text, ids) in enumerate(zip(prompts, prompt_ids(tokenizer, prompts))):
    _check_len("prompt", text, len(ids), max_len)
    if ids:
      ids_BxP[i, max_len - len(ids) :] = ids
      mask_BxP[i, max_len - len(ids) :] = True
  return ids_BxP, mask_BxP


def encode_completions(
  tokenizer, completions: Sequence[str], max_len: int
) -> tuple[np.ndarray, np.ndarray]:
  """(ids_BxN, mask_BxN): completion + EOS, RIGHT-padded with pad_id; mask True up to the EOS."""
  ids_BxN = np.full((len(completions), max_len), tokenizer.pad_token_id, np.int32)
  mask_BxN = np.zeros((len(completions), max_len), bool)
  for i, (text, ids) in enumerate(zip(completions, _ids(tokenizer, completions))):
    ids = ids + [tokenizer.eos_token_id]
    _check_len("completion (with EOS)", text, len(ids), max_len)
    ids_BxN[i, : len(ids)] = ids
    mask_BxN[i, : len(ids)] = True
  return ids_BxN, mask_BxN


def encode_sft(
  tokenizer, prompts: Sequence[str], completions: Sequence[str], max_len: int
) -> SFTArrays:
  """Shifted, right-padded SFT arrays of length L = max_len (the sequence may hold L+1 tokens)."""
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
  b = len(prompts)
  inputs_BxL = np.full((b, max_len), tokenizer.pad_token_id, np.int32)
  targets_BxL = np.full((b, max_len), tokenizer.pad_token_id, np.int32)
  target_mask_BxL = np.zeros((b, max_len), bool)
  attn_mask_BxL = np.zeros((b, max_len), bool)
  rows = zip(prompts, completions, prompt_ids(tokenizer, prompts), _ids(tokenizer, completions))
  for i, (p_text, c_text, p_ids, c_ids) in enumerate(rows):
    seq = p_ids + c_ids + [tokenizer.eos_token_id]
    # Inputs drop the final EOS (nothing is predicted after it), so L+1 tokens fit in length L.
    _check_len("prompt+completion (with EOS)", p_text + c_text, len(seq) - 1, max_len)
    n = len(seq) - 1
    inputs_BxL[i, :n] = seq[:-1]
    targets_BxL[i, :n] = seq[1:]
    attn_mask_BxL[i, :n] = True
    # Target t is seq[t+1]; completion tokens start at seq[len(p_ids)], i.e. target len(p_ids)-1.
    # (An empty prefix cannot predict its first token, so that one is not learned.)
    target_mask_BxL[i, max(len(p_ids) - 1, 0) : n] = True
  return SFTArrays(inputs_BxL, targets_BxL, target_mask_BxL, attn_mask_BxL)


def decode_responses(
  tokenizer, ids_BxN, lengths_B, model_mask_BxN=None, eos_id: int | Sequence[int] | None = None
) -> list[str]:
  """Text of each response: its first ``lengths_B[i]`` tokens, cut before the first EOS the model
  wrote that no environment token follows (``model_mask_BxN``: its tokens, the others an
  environment's, whose EOS ids end nothing; None: every token is the model's). A chat model ends
  each turn with its end-of-turn id, often its EOS: one that an observation answered ended a
  turn, not the response. ``eos_id``: the ids that end a response (default the tokenizer's EOS).

  Other special tokens (pad, bos, unk) are kept as their text, so a response containing them can
  never be scored as a clean number.
  """
  ids_BxN = np.asarray(ids_BxN)
  eos = tokenizer.eos_token_id if eos_id is None else eos_id
  eos_ids = np.asarray(list(eos) if isinstance(eos, (list, tuple)) else [eos])
  n = ids_BxN.shape[1]
  lengths_B = np.clip(np.asarray(lengths_B), 0, n)
  by_model_BxN = np.ones(ids_BxN.shape, bool) if model_mask_BxN is None else model_mask_BxN
  by_model_BxN = np.asarray(by_model_BxN, bool)
  env_BxN = (np.arange(n)[None, :] < np.reshape(lengths_B, (-1, 1))) & ~by_model_BxN
  env_later_BxN = np.flip(np.cumsum(np.flip(env_BxN, 1), 1), 1) > env_BxN  # one at a later n
  ends_BxN = np.isin(ids_BxN, eos_ids) & by_model_BxN & ~env_later_BxN
  first_eos_B = np.where(ends_BxN.any(1), ends_BxN.argmax(1), n)
  lengths_B = np.minimum(lengths_B, first_eos_B)
  rows = [ids[:n] for ids, n in zip(ids_BxN.tolist(), lengths_B.tolist())]
  return tokenizer.batch_decode(rows, skip_special_tokens=False) if rows else []
