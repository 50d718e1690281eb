"""Task tokenizer (one token per character, cached offline) and the prompt / SFT array layouts.

Expected arrays are built by Python loops from the fixed vocabulary table (``VOCAB``), not from the
tokenizer, so the layouts are checked against an independent oracle.
"""

import numpy as np
import pytest

from jaxrl.tasks.data import tokenizer as tokmod
from jaxrl.tasks.data.arithmetic import TaskConfig, build_task
from jaxrl.tasks.data.prompts import (
  decode_responses,
  encode_completions,
  encode_prompts,
  encode_sft,
  prompt_ids,
)
from jaxrl.tasks.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB, build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return build_tokenizer(tmp_path_factory.mktemp("tok"))


def char_ids(text):
  return [VOCAB[c] for c in text]


def test_special_ids_and_small_vocab(tok):
  assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)
  assert len({PAD_ID, EOS_ID, BOS_ID, tok.unk_token_id}) == 4
  assert len(tok) == len(VOCAB) <= 64


def test_each_char_is_one_token(tok):
  for c in "0123456789+-*=":
    assert tok(c, add_special_tokens=False)["input_ids"] == [VOCAB[c]]
  assert tok("9876543210", add_special_tokens=False)["input_ids"] == char_ids("9876543210")
  assert tok("12+345=", add_special_tokens=False)["input_ids"] == char_ids("12+345=")
  # Characters outside the task become <unk>, never silently dropped.
  assert tok("1 2", add_special_tokens=False)["input_ids"] == [
    VOCAB["1"],
    tok.unk_token_id,
    VOCAB["2"],
  ]


def test_round_trip_on_task_text(tok):
  train, heldout = build_task(TaskConfig(num_train_per_level=30, num_heldout_per_level=5))
  texts = [p.prompt for p in train + heldout] + [p.answer for p in train + heldout]
  ids = tok(texts, add_special_tokens=False)["input_ids"]
  assert all(i == char_ids(t) for i, t in zip(ids, texts))
  assert tok.batch_decode(ids) == texts


def test_cache_is_reused_not_rebuilt(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  first = build_tokenizer(tmp_path)
  stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
  assert "tokenizer.json" in stamps

  def no_rebuild():
    raise AssertionError("tokenizer rebuilt although cached")

  monkeypatch.setattr(tokmod, "_raw_tokenizer", no_rebuild)
  second = build_tokenizer(str(tmp_path))
  assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps
  assert second("12+3=")["input_ids"] == first("12+3=")["input_ids"]


def test_stale_cache_is_rebuilt(tmp_path):
  build_tokenizer(tmp_path)
  (tmp_path / tokmod._MARKER).write_text("some-older-version")
  tok = build_tokenizer(tmp_path)
  assert (tmp_path / tokmod._MARKER).read_text() == tokmod._VERSION
  assert tok("7=", add_special_tokens=False)["input_ids"] == char_ids("7=")


def test_encode_prompts_left_padded(tok):
  prompts = ["1+2=", "12345+67890=", "9*9="]
  ids, mask = encode_prompts(tok, prompts, max_len=16)
  assert ids.dtype == np.int32 and ids.shape == mask.shape == (3, 16) and mask.dtype == bool
  for row, m, text in zip(ids, mask, prompts):
    seq = [BOS_ID] + char_ids(text)
    expected = [PAD_ID] * (16 - len(seq)) + seq
    assert row.tolist() == expected
    assert m.tolist() == [False] * (16 - len(seq)) + [True] * len(seq)
  assert [list(r) for r in prompt_ids(tok, prompts)] == [[BOS_ID] + char_ids(p) for p in prompts]
  empty_ids, empty_mask = encode_prompts(tok, [], max_len=8)
  assert empty_ids.shape == empty_mask.shape == (0, 8)


def test_encode_prompts_too_long_names_prompt(tok):
  encode_prompts(tok, ["1234+5678="], max_len=11)  # BOS + 10 chars fits exactly
  with pytest.raises(ValueError, match=r"1234\+5678="):
    encode_prompts(tok, ["1+1=", "1234+5678="], max_len=10)


def test_encode_sft_layout(tok):
  prompts, completions = ["1+2=", "99+99=", "5-5="], ["3", "891", "0"]
  L = 10
  out = encode_sft(tok, prompts, completions, max_len=L)
  for arr in (out.inputs_BxL, out.targets_BxL, out.target_mask_BxL, out.attn_mask_BxL):
    assert arr.shape == (3, L)
  assert out.inputs_BxL.dtype == out.targets_BxL.dtype == np.int32
  for i, (p, c) in enumerate(zip(prompts, completions)):
    seq = [BOS_ID] + char_ids(p) + char_ids(c) + [EOS_ID]
    n = len(seq) - 1
    pad = [PAD_ID] * (L - n)
    assert out.inputs_BxL[i].tolist() == seq[:-1] + pad
    assert out.targets_BxL[i].tolist() == seq[1:] + pad
    assert out.attn_mask_BxL[i].tolist() == [True] * n + [False] * (L - n)
    # Exactly the completion tokens and the EOS are learned, wherever they sit.
    expected_mask = [t >= 1 + len(p) for t in range(1, len(seq))] + [False] * (L - n)
    assert out.target_mask_BxL[i].tolist() == expected_mask
    assert out.targets_BxL[i][out.target_mask_BxL[i]].tolist() == char_ids(c) + [EOS_ID]
  # The SFT prefix is exactly what the sampler conditions on.
  ids, mask = encode_prompts(tok, prompts, max_len=8)
  for i, p in enumerate(prompts):
    k = len(p) + 1
    assert out.inputs_BxL[i, :k].tolist() == ids[i][mask[i]].tolist()


def test_encode_sft_length_limit(tok):
  encode_sft(tok, ["1+2="], ["3"], max_len=6)  # BOS 1 + 2 = 3 EOS: 7 tokens, 6 inputs
  with pytest.raises(ValueError, match=r"1\+2="):
    encode_sft(tok, ["1+2="], ["3"], max_len=5)
  with pytest.raises(ValueError):
    encode_sft(tok, ["1+2="], [], max_len=6)


def test_encode_completions_layout(tok):
  ids, mask = encode_completions(tok, ["521", "9"], max_len=6)
  assert ids.tolist() == [
    char_ids("521") + [EOS_ID, PAD_ID, PAD_ID],
    char_ids("9") + [EOS_ID] + [PAD_ID] * 4,
  ]
  assert mask.tolist() == [[True] * 4 + [False] * 2, [True] * 2 + [False] * 4]
  with pytest.raises(ValueError, match="123456"):
    encode_completions(tok, ["123456"], max_len=6)


def test_decode_responses(tok):
  rows = np.array(
    [
      char_ids("521") + [EOS_ID, PAD_ID, PAD_ID],
      char_ids("12") + [EOS_ID] + char_ids("999"),  # tokens after EOS are ignored
      char_ids("123456"),  # no EOS: length decides
      char_ids("7") + [PAD_ID, EOS_ID, PAD_ID, PAD_ID, PAD_ID],
    ],
    dtype=np.int32,
  )
  out = decode_responses(tok, rows, [4, 6, 4, 6])
  assert out == ["521", "12", "1234", "7<pad>"]
  assert decode_responses(tok, rows, np.array([0, 99, 6, 1])) == ["", "12", "123456", "7"]
  assert decode_responses(tok, np.zeros((0, 6), np.int32), []) == []
