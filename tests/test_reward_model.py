"""The reward model (jaxrl.nn.reward_model) against transformers' sequence classifiers.

Tiny random ``{Qwen2,Qwen3,Llama}ForSequenceClassification`` checkpoints (one label, pad id 0) are
saved with ``save_pretrained``; the JAX model loaded from them must give transformers' scores on a
right-padded batch, in float32 (to float32 rounding) and in bfloat16 (no worse than transformers'
own bfloat16), at the position transformers reads (the rightmost non-pad token).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hf_fixtures  # noqa: E402
import jax  # noqa: E402
import math_fixtures  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from rounding import logits_atol  # noqa: E402

from jaxrl.nn import reward_model  # noqa: E402
from jaxrl.parallel import sharding  # noqa: E402
from jaxrl.tasks.rewards.terms import ModelTerm  # noqa: E402

PAD = hf_fixtures.REWARD_PAD_ID


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
  base = tmp_path_factory.mktemp("rm")
  return {k: hf_fixtures.make_tiny_hf_reward_model(k, base / k) for k in hf_fixtures.KINDS}


def right_padded_batch(vocab, lengths_R=(11, 6, 1, 9)):
  """Rows of the given lengths right-padded to the longest with the pad id; no real token is the
  pad."""
  lengths_R = np.asarray(lengths_R)
  t = lengths_R.max()
  mask_RxT = np.arange(t)[None, :] < lengths_R[:, None]
  tokens_RxT = np.random.default_rng(1).integers(1, vocab, (len(lengths_R), t))
  return np.where(mask_RxT, tokens_RxT, PAD), mask_RxT


@torch.no_grad()
def hf_scores(path, tokens_RxT, mask_RxT, dtype=torch.float32):
  model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval()
  out = model(input_ids=torch.tensor(tokens_RxT), attention_mask=torch.tensor(mask_RxT).long())
  assert out.logits.shape == (len(tokens_RxT), 1)
  return out.logits[:, 0].float().numpy()


@pytest.mark.parametrize("kind", hf_fixtures.KINDS)
@pytest.mark.parametrize("layout", ("loop", "scan"))
def test_scores_match_transformers(rm_dirs, kind, layout):
  tokens, mask = right_padded_batch(160)
  ref = hf_scores(rm_dirs[kind], tokens, mask)
  rm = reward_model.load_reward_model(rm_dirs[kind], scan_layers=layout == "scan")
  ours = np.asarray(rm.scores(tokens, mask))
  assert np.std(ref) > 0.3  # the rows score differently, so the tolerance means something
  np.testing.assert_allclose(ours, ref, rtol=0, atol=logits_atol(rm.cfg, ref, tokens.shape[1]))


def test_scores_on_a_mesh_match_one_device(rm_dirs):
  """Sharded like the policy (params by logical axes, rows over the data axes): the same scores."""
  tokens, mask = right_padded_batch(160)
  single = np.asarray(reward_model.load_reward_model(rm_dirs["qwen2"]).scores(tokens, mask))
  mesh = sharding.make_mesh(len(jax.devices()), 1, 1)
  rm = reward_model.load_reward_model(rm_dirs["qwen2"], mesh=mesh)
  rows = sharding.shard_batch({"t": tokens, "m": mask}, mesh)
  ref = hf_scores(rm_dirs["qwen2"], tokens, mask)
  ours = np.asarray(rm.scores(rows["t"], rows["m"]))
  np.testing.assert_allclose(ours, single, rtol=0, atol=logits_atol(rm.cfg, ref, tokens.shape[1]))


def test_bfloat16_scores_are_as_close_as_transformers_bfloat16(rm_dirs):
  """bf16 params and compute: as far from the float32 scores as transformers' bf16 forward is."""
  path = rm_dirs["qwen2"]
  # 64 rows: a mean error over a handful of scores would be one rounding's luck.
  tokens, mask = right_padded_batch(160, np.random.default_rng(2).integers(1, 12, 64))
  reference = hf_scores(path, tokens, mask)
  hf_err = np.abs(hf_scores(path, tokens, mask, torch.bfloat16) - reference)
  ours = np.asarray(reward_model.load_reward_model(path, "bfloat16").scores(tokens, mask))
  err = np.abs(ours - reference)
  # Two bf16 forwards of the same weights round to errors of one size (test_hf_parity's
  # test_bfloat16_forward_matches_hf_bfloat16 says why 1.5).
  assert err.mean() <= 1.5 * hf_err.mean(), (err.mean(), hf_err.mean())
  assert err.max() <= 1.5 * hf_err.max(), (err.max(), hf_err.max())


def test_score_is_read_at_the_rightmost_non_pad_token():
  """transformers' rule: the last token that is not the pad id, left or right padding alike; a
  real token equal to the pad id at the end is skipped; without a pad id, the last valid one."""
  tokens = np.array([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [5, 0, 6, 0, 0], [5, 6, 0, 0, 0]])
  mask = np.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], bool)
  np.testing.assert_array_equal(reward_model.score_positions(tokens, mask, 0), [2, 4, 2, 1])
  np.testing.assert_array_equal(reward_model.score_positions(tokens, mask, None), [2, 4, 2, 3])


def test_a_causal_lm_is_refused_by_name(rm_dirs, tmp_path):
  path = hf_fixtures.make_tiny_hf("qwen2", False, tmp_path / "lm")
  with pytest.raises(ValueError, match="ForSequenceClassification"):
    reward_model.load_reward_model(path)


def test_more_than_one_label_is_refused(rm_dirs, tmp_path):
  config = json.loads((rm_dirs["llama"] / "config.json").read_text())
  config["id2label"] = {"0": "a", "1": "b"}
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="one label, config.json has 2"):
    reward_model.reward_model_config(tmp_path)


# --- the reward model as a reward term ------------------------------------------------------------


@pytest.fixture(scope="module")
def rm_with_tokenizer(tmp_path_factory):
  """A tiny Qwen2 reward model saved with a ChatML tokenizer (its pad token is id 0)."""
  tok = math_fixtures.make_tokenizer("chatml")
  assert tok.pad_token_id == PAD
  path = hf_fixtures.make_tiny_hf_reward_model(
    "qwen2", tmp_path_factory.mktemp("rm_tok"), vocab_size=len(tok)
  )
  tok.save_pretrained(path)
  return path, transformers.AutoTokenizer.from_pretrained(path)  # the tokenizer as a run reads it


PROMPTS = [q for q, _ in math_fixtures.PROBLEMS[:6]]
COMPLETIONS = ["5", "The answer is \\boxed{42}.", "", "x = 6", "-3", "0.75 " * 8]


def test_model_term_scores_the_chat_as_transformers_does(rm_with_tokenizer):
  """Prompt as the user's turn, response as the assistant's, through the chat template; scored in
  chunks of 4 rows (the last padded): each as transformers scores that text alone."""
  path, tok = rm_with_tokenizer
  term = ModelTerm(str(path), None, "float32", max_tokens=512, rows=4)
  ours = term(PROMPTS, COMPLETIONS, [""] * 6)
  assert term.truncated == 0
  ref = []
  for p, c in zip(PROMPTS, COMPLETIONS):
    chat = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    ids = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[:1] == [tok.convert_tokens_to_ids("<|im_start|>")]
    ref.append(hf_scores(path, np.array([ids]), np.ones((1, len(ids)), bool))[0])
  ref = np.array(ref)
  assert np.std(ref) > 0.1
  np.testing.assert_allclose(ours, ref, rtol=0, atol=logits_atol(term.model.cfg, ref, 64))


def test_model_term_keeps_the_last_tokens_of_a_long_input(rm_with_tokenizer):
  path, tok = rm_with_tokenizer
  term = ModelTerm(str(path), None, "float32", max_tokens=8, rows=4)
  ours = term(PROMPTS[:2], COMPLETIONS[:2], [""] * 2)
  assert term.truncated == 2
  ref = []
  for p, c in zip(PROMPTS[:2], COMPLETIONS[:2]):
    ids = term.token_ids(p, c)[-8:]
    ref.append(hf_scores(path, np.array([ids]), np.ones((1, 8), bool))[0])
  np.testing.assert_allclose(ours, ref, rtol=0, atol=logits_atol(term.model.cfg, np.array(ref), 8))


def test_model_term_on_the_mesh_scores_as_on_one_device(rm_with_tokenizer):
  """Rows over the mesh's data axes (3 rows per forward rounded up to the split), params sharded
  like the policy: the scores of the unsharded term. On the test process's devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=2`` gives two: 4 rows a forward)."""
  path, _ = rm_with_tokenizer
  single = ModelTerm(str(path), None, "float32", max_tokens=512, rows=3)(PROMPTS, COMPLETIONS, [])
  mesh = sharding.make_mesh(len(jax.devices()), 1, 1)
  term = ModelTerm(str(path), mesh, "float32", max_tokens=512, rows=3)
  assert term.rows % len(jax.devices()) == 0 and term.rows >= 3
  ours = term(PROMPTS, COMPLETIONS, [])
  np.testing.assert_allclose(ours, single, rtol=0, atol=logits_atol(term.model.cfg, single, 64))
