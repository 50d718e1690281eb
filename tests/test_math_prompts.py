"""Math prompts with real (offline-built) tokenizers: chat template applied once, one BOS, the
\\boxed{} instruction, left padding, the over-length policies; stop ids from generation_config."""

from __future__ import annotations

import json

import math_fixtures
import numpy as np
import pytest

from jaxrl.tasks.data import math_prompts

LONG = "Find x such that " + " + ".join(f"{i} x" for i in range(60)) + " = 1."


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tok_dir(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  math_fixtures.make_tokenizer(request.param).save_pretrained(path)
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
  return path


def test_a_tokenizer_without_its_vocabulary_is_refused(tok_dir, tmp_path):
  """Without tokenizer.json, transformers builds a tokenizer from the config alone that encodes
  any text to no ids: a run would train on empty prompts. It is refused, naming the directory."""
  import shutil

  broken = tmp_path / "broken"
  shutil.copytree(tok_dir, broken)
  (broken / "tokenizer.json").unlink()
  with pytest.raises(math_prompts.TokenizerError, match="its tokenizer does not load"):
    math_prompts.load_tokenizer(str(broken))
  # A Qwen checkpoint names its class: transformers then builds an empty one without a word.
  config = json.loads((broken / "tokenizer_config.json").read_text())
  config["tokenizer_class"] = "Qwen2Tokenizer"
  (broken / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(math_prompts.TokenizerError, match="does not encode and decode"):
    math_prompts.load_tokenizer(str(broken))


def _text(tok, enc, row):
  return tok.decode(enc.ids_QxP[row][enc.mask_QxP[row]])


def test_tokenizer_stop_ids_and_padding(tok_dir):
  tok = math_prompts.load_tokenizer(str(tok_dir))
  assert tok.pad_token_id is not None and tok.padding_side == "left"
  assert math_prompts.stop_token_ids(str(tok_dir), tok) == tuple(
    dict.fromkeys([3, 4, tok.eos_token_id])
  )


def test_chat_template_once_single_bos_instruction_left_padded(tok_dir):
  tok = math_prompts.load_tokenizer(str(tok_dir))
  questions = ["What is 2 + 3?", "Compute 7 * 6."]
  enc = math_prompts.encode_math_prompts(tok, questions, 64)
  assert enc.ids_QxP.shape == (2, 64) and list(enc.kept_Q) == [0, 1]
  for row, q in enumerate(questions):
    mask = enc.mask_QxP[row]
    assert not mask[0] and mask[-1] and mask[np.argmax(mask) :].all()  # left padding
    text = _text(tok, enc, row)
    assert text == math_prompts.render_prompt(tok, q)  # the exact frame
    assert text.count(q) == 1 and text.count(math_prompts.BOXED_INSTRUCTION) == 1
    bos = tok.bos_token_id
    ids = enc.ids_QxP[row][mask]
    assert (bos is None and ids[0] != tok.pad_token_id) or (ids == bos).sum() == 1


def test_ids_match_a_per_question_oracle(tok_dir):
  """The batched, vectorised encoding against one tokenizer call and one padded row per question."""
  tok = math_prompts.load_tokenizer(str(tok_dir))
  questions = [q for q, _ in math_fixtures.PROBLEMS] * 3
  for chat in (True, False):
    enc = math_prompts.encode_math_prompts(
      tok, questions, 72, chat_template=chat, system_prompt="Be brief."
    )
    for row, q in enumerate(questions):
      text = math_prompts.render_prompt(tok, q, chat_template=chat, system_prompt="Be brief.")
      ids = tok(text, add_special_tokens=False)["input_ids"]
      if not chat and tok.bos_token_id is not None:
        ids = [tok.bos_token_id] + ids  # plain text: the tokenizer's BOS, once
      expected = [tok.pad_token_id] * (72 - len(ids)) + ids
      assert enc.ids_QxP[row].tolist() == expected
      assert enc.mask_QxP[row].tolist() == [False] * (72 - len(ids)) + [True] * len(ids)
    assert enc.ids_QxP.dtype == np.int32 and enc.mask_QxP.dtype == bool
    assert enc.kept_Q.dtype == np.int64


def test_plain_custom_templates_and_system_prompt(tok_dir):
  tok = math_prompts.load_tokenizer(str(tok_dir))
  text = math_prompts.render_prompt(
    tok, "Q?", template="Solve: {question} Answer:", system_prompt="Be brief.", chat_template=True
  )
  assert "Solve: Q? Answer:" in text and "Be brief." in text
  assert math_prompts.render_prompt(tok, "Q?", template="plain", chat_template=False) == "Q?"
  with pytest.raises(ValueError, match="data.template"):
    math_prompts.render_prompt(tok, "Q?", template="no placeholder")


def test_overlength_drop_truncate_error(tok_dir):
  tok = math_prompts.load_tokenizer(str(tok_dir))
  questions = ["What is 2 + 3?", LONG, "What is 9 - 9?"]
  full = len(tok(math_prompts.render_prompt(tok, LONG), add_special_tokens=False)["input_ids"])
  p = 64
  assert full > p
  dropped = math_prompts.encode_math_prompts(tok, questions, p, overlength="drop")
  assert list(dropped.kept_Q) == [0, 2] and dropped.dropped == 1 and dropped.truncated == 0
  cut = math_prompts.encode_math_prompts(tok, questions, p, overlength="truncate")
  assert list(cut.kept_Q) == [0, 1, 2] and cut.truncated == 1 and cut.mask_QxP[1].all()
  text = _text(tok, cut, 1)
  frame = math_prompts.render_prompt(tok, "\x00").split("\x00")
  assert text.startswith(frame[0]) and text.endswith(frame[1])  # the chat frame is whole
  assert math_prompts.BOXED_INSTRUCTION in text and "Find x such that" in text
  with pytest.raises(ValueError, match="question 1 needs"):
    math_prompts.encode_math_prompts(tok, questions, p, overlength="error")
  # No room for any of the question inside the frame: truncation drops it instead.
  frame_len = len(tok(math_prompts.render_prompt(tok, ""), add_special_tokens=False)["input_ids"])
  tight = math_prompts.encode_math_prompts(tok, [LONG], frame_len, overlength="truncate")
  assert (tight.truncated, tight.dropped, len(tight.kept_Q)) == (0, 1, 0)
  assert tight.ids_QxP.shape == (0, frame_len)
