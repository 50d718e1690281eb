"""The arithmetic task with the calculator (tiny:tools): its vocabulary extends the default one,
which stays as it was (as do the default task's problems and SFT corpus); its SFT corpus is the
trajectory a rollout would produce, with the environment's tokens read but not learned; its
verifier scores the final answer."""

from __future__ import annotations

import hashlib
import json
import os
import types

import jax
import numpy as np
import optax
import pytest
from run_helpers import SMALL_MODEL as MCFG
from run_helpers import tiny_config

from jaxrl.config import ConfigError
from jaxrl.nn import model
from jaxrl.rl import scoring, step
from jaxrl.run.components import task_sections
from jaxrl.tasks import builtin
from jaxrl.tasks.data import arithmetic, tool_calls
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.envs.environment import token_ids
from jaxrl.tasks.envs.trajectory import trajectory_parts
from jaxrl.tasks.task import load_task

# The default vocabulary, fixed forever: checkpoints of the default task depend on these ids.
DEFAULT_VOCAB = {
  "<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "0": 4, "1": 5, "2": 6, "3": 7, "4": 8, "5": 9,
  "6": 10, "7": 11, "8": 12, "9": 13, "+": 14, "-": 15, "*": 16, "=": 17,
}  # fmt: skip


def digest(*arrays) -> str:
  """A short hash of arrays' dtypes, shapes and bytes (object arrays: their strings)."""
  h = hashlib.sha256()
  for a in map(np.asarray, arrays):
    if a.dtype == object:
      h.update("\n".join(a.tolist()).encode())
    else:
      h.update(f"{a.dtype}{a.shape}".encode() + np.ascontiguousarray(a).tobytes())
  return h.hexdigest()[:16]


def test_the_default_vocabulary_is_unchanged(tmp_path):
  assert vocab.VOCAB == DEFAULT_VOCAB
  assert vocab._VERSION == "arith-char-v2:<pad><eos><bos><unk>0123456789+-*="
  tok = vocab.build_tokenizer(tmp_path)
  assert len(tok) == 18 and tok("12+345=", add_special_tokens=False)["input_ids"] == [
    5, 6, 14, 7, 8, 9, 17,
  ]  # fmt: skip
  with open(tmp_path / "tokenizer.json") as f:
    saved = json.load(f)
  assert saved["pre_tokenizer"] == {
    "type": "Sequence",
    "pretokenizers": [
      {"type": "Digits", "individual_digits": True},
      {"type": "Punctuation", "behavior": "Isolated"},
    ],
  }


def test_the_default_task_and_its_sft_corpus_are_unchanged(tmp_path):
  """configs/tiny.py as `make run` loads it: every array as it was before environments existed."""
  task = load_task(task_sections(tiny_config("")), str(tmp_path))
  assert task.environment is None and task.sft_loss_mask is None and task.stop_sequences == ()
  assert task.scorer is None
  assert digest(task.train_prompt_ids, task.train_prompt_mask, task.train_answers,
                task.train_levels) == "f03dcc88eb734253"  # fmt: skip
  assert digest(task.heldout_prompt_ids, task.heldout_prompt_mask, task.heldout_answers,
                task.heldout_levels) == "8fc60344df4f3703"  # fmt: skip
  assert digest(task.sft_prompt_ids, task.sft_prompt_mask, task.sft_target_ids,
                task.sft_target_mask) == "f450eeeb05b00723"  # fmt: skip


def test_the_tools_vocabulary_extends_the_default(tmp_path):
  tok = vocab.build_tokenizer(tmp_path, "tools")
  assert {t: i for t, i in vocab.TOOLS_VOCAB.items() if i < len(DEFAULT_VOCAB)} == DEFAULT_VOCAB
  assert len(tok) == len(vocab.TOOLS_VOCAB) == 54
  assert vocab._TOOLS_VERSION != vocab._VERSION
  for tag in vocab.TOOL_TOKENS:  # one token each, at its fixed id
    assert token_ids(tok, tag) == [vocab.TOOLS_VOCAB[tag]]
  text = "<calc>12*(3+4)</calc><result>error: too large</result>84"
  assert tok.decode(token_ids(tok, text)) == text
  assert vocab.UNK_ID not in token_ids(tok, text)
  # One directory holds one variant: switching rebuilds it.
  assert len(vocab.build_tokenizer(tmp_path)) == 18
  assert len(vocab.build_tokenizer(tmp_path, "tools")) == 54
  with pytest.raises(ValueError, match="variant 'chat' is not one of"):
    vocab.build_tokenizer(tmp_path, "chat")


@pytest.fixture(scope="module")
def tools_task(tmp_path_factory):
  task = load_task(
    task_sections(tiny_config("tools,test")), str(tmp_path_factory.mktemp("tokenizer"))
  )
  yield task
  task.close()


def test_the_sft_corpus_is_what_the_environment_answers(tools_task):
  t, tok = tools_task, tools_task.tokenizer
  assert t.vocab_size == 54 and t.stop_sequences == ((vocab.TOOLS_VOCAB["</calc>"],),)
  calls = 0
  checked = []
  for i in range(len(t.sft_target_ids)):
    ids, read, learned = t.sft_target_ids[i], t.sft_target_mask[i], t.sft_loss_mask[i]
    assert not (learned & ~read).any()  # only the completion's tokens are learned
    parts = trajectory_parts(tok, ids, learned, length=read.sum())
    prompt = tok.decode(t.sft_prompt_ids[i][t.sft_prompt_mask[i]], skip_special_tokens=True)
    if len(parts) == 1:  # a direct answer
      assert parts[0]["by"] == "model" and parts[0]["text"] == tool_answer(prompt)
      continue
    calls += 1
    call, observation, answer = parts
    assert call == {"by": "model", "text": f"<calc>{prompt[:-1]}</calc>"}
    assert observation["by"] == "environment" and answer["by"] == "model"
    assert observation["text"] == f"<result>{tool_answer(prompt)}</result>"
    assert answer["text"] == tool_answer(prompt)
    if len(checked) < 4:
      checked.append((i, prompt[:-1], ids[~learned & read].tolist()))
  assert 0.3 < calls / len(t.sft_target_ids) < 0.7  # SFT_TOOL_FRACTION of the examples
  # The environment, calls in its workers, answers those calls with the corpus's very ids.
  env = t.environment
  states = env.reset(range(len(checked)))
  turns = [token_ids(tok, f"<calc>{c}</calc>") for _, c, _ in checked]
  res = env.step(states, turns, range(len(checked)))
  assert res.observation_ids == [obs for _, _, obs in checked]


def tool_answer(prompt: str) -> str:
  """The exact answer of a natural-layout prompt "a op b="."""
  for op in "+-*":
    if op in prompt:
      a, b = prompt[:-1].split(op)
      return str(
        int(a) + int(b) if op == "+" else int(a) - int(b) if op == "-" else int(a) * int(b)
      )
  raise ValueError(prompt)


def sft_weights(levels, text: str):
  cfg = tiny_config("tools,test", **{"task.sft_levels": text})
  return builtin.sft_level_weights(cfg.task, levels, arithmetic.parse_levels)


def test_the_sft_corpus_shows_the_sft_levels_of_the_train_split_only():
  levels = arithmetic.parse_levels("2x1+,2x2*,5x3*,8x8+")
  weights = sft_weights(levels, "2x2*, 2x1+")
  assert weights == (1.0, 1.0, 0.0, 0.0) and sft_weights(levels, "") is None
  with pytest.raises(ConfigError, match=r"^config\.task\.sft_levels: 3\+3 not among the levels"):
    sft_weights(levels, "3x3+")
  tcfg = arithmetic.TaskConfig(levels=levels, reverse_answer=False, sft_level_weights=weights)
  examples = tool_calls.sft_examples(tcfg, 500, seed=3)
  assert examples == tool_calls.sft_examples(tcfg, 500, seed=3)  # deterministic
  for e in examples:
    op = "+" if "+" in e.prompt else "*"
    a, b = map(int, e.prompt[:-1].split(op))
    assert (len(str(a)), len(str(b)), op) in ((2, 1, "+"), (2, 2, "*"))
    assert not arithmetic.is_heldout(op, np.array([a]), np.array([b]), tcfg.heldout_modulus)[0]
    assert e.call in (None, e.prompt[:-1])


def test_sft_levels_take_relative_weights():
  levels = arithmetic.parse_levels("2x1+,2x2*,5x3*,8x8+")
  weights = sft_weights(levels, "2x1+, 2x2*, 5x3*:0.1")
  assert weights == (1.0, 1.0, 0.1, 0.0)
  tcfg = arithmetic.TaskConfig(levels=levels, reverse_answer=False, sft_level_weights=weights)
  examples = tool_calls.sft_examples(tcfg, 4200, seed=0)
  products = sum("*" in e.prompt and len(e.prompt.split("*")[0]) == 5 for e in examples)
  assert 200 - 45 < products < 200 + 45  # 4200 * 0.1 / 2.1 = 200, binomial sd 14
  for bad, says in (
    ("2x1+:0", "WEIGHT > 0"),
    ("2x1+:-1", "WEIGHT > 0"),
    ("2x1+:x", "WEIGHT > 0"),
    (":2", "WEIGHT > 0"),
    ("2x1+,2x1+:2", "2\\+1 named twice"),
    ("2x1+,2y1+", "2y1\\+"),
  ):
    with pytest.raises(ConfigError, match=r"^config\.task\.sft_levels: .*" + says):
      sft_weights(levels, bad)


@pytest.mark.parametrize(
  "levels,says", [("2x1+,3x3", "bad level '3x3'"), ("2x1+, 2x1+", "2\\+1 named twice")]
)
def test_a_bad_level_names_the_field(tmp_path, levels, says):
  with pytest.raises(ConfigError, match=r"^config\.task\.levels: .*" + says):
    load_task(task_sections(tiny_config("test", **{"task.levels": levels})), str(tmp_path))


def test_sft_levels_must_be_levels_of_the_task(tmp_path):
  with pytest.raises(ConfigError, match=r"^config\.task\.sft_levels: 9\+9 not among the levels"):
    load_task(
      task_sections(tiny_config("tools,test", **{"task.sft_levels": "9x9+"})), str(tmp_path)
    )


def test_the_verifier_scores_the_final_answer(tools_task):
  responses = [
    "<calc>12345*678</calc><result>8369910</result>8369910",
    "8369910",  # no call: the whole response
    "<calc>12345*678</calc><result>8369910</result>836991",
    "<calc>12345*678</calc><result>8369910</result>",  # the turns ran out before an answer
    "<calc>1+1</calc><result>2</result><calc>12345*678</calc><result>8369910</result>8369910",
  ]
  res = tools_task.verify(responses, ["8369910"] * len(responses))
  assert res.rewards_R.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0] and res.scored.all()


def test_an_eos_the_environment_wrote_ends_nothing(tools_task):
  """Only the model's EOS ends the text the verifier reads: an observation holding the EOS id
  (any id may come back from an environment) leaves the answer after it scored."""
  tok, eos = tools_task.tokenizer, tools_task.eos_id
  call, answer = token_ids(tok, "<calc>2*3</calc>"), token_ids(tok, "6")
  observation = token_ids(tok, "<result>") + [eos] + token_ids(tok, "6</result>")
  ids = call + observation + answer + [eos]
  by_model = [True] * len(call) + [False] * len(observation) + [True] * (len(answer) + 1)
  n = len(ids) + 3
  rollouts = types.SimpleNamespace(
    tokens_RxN=np.array([ids + [0] * 3]),
    mask_RxN=np.array([[True] * len(ids) + [False] * 3]),
    loss_mask_RxN=np.array([by_model + [False] * 3]),
    lengths_R=np.array([len(ids)]),
  )
  assert rollouts.tokens_RxN.shape == (1, n)
  (text,) = tools_task.decode(rollouts)
  assert text.endswith("6</result>6") and tools_task.score([text], ["6"]).tolist() == [1.0]


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"task.digit_width": 5}, "task.digit_width"),
    ({"task.reverse_answer": True}, "task.reverse_answer"),
  ],
)
def test_the_tool_task_writes_numbers_as_usual(tmp_path, overrides, field):
  with pytest.raises(ConfigError) as e:
    load_task(task_sections(tiny_config("tools,test", **overrides)), str(tmp_path))
  assert e.value.field == field


def test_the_tools_variant_composes_with_presets_and_sizes():
  cfg = tiny_config("e3,tools")
  assert cfg.task.environment == "calculator" and cfg.allocation.method == "e3"
  assert cfg.task.digit_width == 0 and not cfg.task.reverse_answer
  assert tiny_config("tools,e3") == cfg
  small = tiny_config("tools,test")
  assert small.model.hidden_size == 32 and small.rollout.max_new_tokens == 80
  assert tiny_config("").task.environment == ""


def test_sft_learns_only_the_model_tokens():
  """The SFT loss with a loss mask is the mean NLL of the masked tokens (the others still read).
  Without one the step is as before: tests/test_train.py's golden warm-started step."""
  graphdef, params = model.create(MCFG, 0)
  rng = np.random.default_rng(0)
  b, p, n = 4, 3, 6
  prompt_ids = rng.integers(4, 32, (b, p)).astype(np.int32)
  prompt_mask = np.ones((b, p), bool)
  target_ids = rng.integers(4, 32, (b, n)).astype(np.int32)
  target_mask = np.arange(n)[None] < np.array([[6], [5], [4], [2]])
  loss_mask = target_mask & (rng.random((b, n)) < 0.5)
  loss_mask[:, 0] = True
  tx = optax.sgd(0.0)
  state = step.init_state(params, tx)
  one = np.float32(1.0)
  logp_fn = jax.jit(lambda *a: scoring.logp_responses(graphdef, params, *a, one, 8)[0])
  logp = logp_fn(prompt_ids, prompt_mask, target_ids, target_mask)
  logp = np.asarray(logp, np.float64)
  update = jax.jit(lambda s, *a: step.sft_update(graphdef, tx, 8, s, *a))
  _, masked = update(state, prompt_ids, prompt_mask, target_ids, target_mask, loss_mask)
  # float32 sums of at most b*n terms of one sign: relative error <= b*n*eps.
  rtol = b * n * np.finfo(np.float32).eps
  np.testing.assert_allclose(masked["loss"], -(logp * loss_mask).sum() / loss_mask.sum(), rtol=rtol)
  assert not np.isclose(masked["loss"], -logp.sum() / target_mask.sum())  # the mask matters


def test_the_warm_start_trains_on_the_tool_corpus(tmp_path):
  """Trainer → sft.warm_start → the jitted step, with the task's loss mask."""
  from jaxrl.run.train import Trainer

  cfg = tiny_config("tools,test", **{"sft.steps": 2, "sft.batch_size": 8})
  with Trainer.open(cfg, str(tmp_path)) as trainer:
    params = trainer.warm_start(trainer.init_params())
    assert trainer.task.sft_loss_mask is not None and not trainer.task.sft_loss_mask.all()
  leaves = jax.tree.leaves(params)
  assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)
  assert os.path.isdir(tmp_path / "sft")


def test_a_cache_keyed_before_the_multi_turn_fields_still_matches():
  """A workdir's SFT and evaluation caches written before a field existed count it at its
  default (which computes what they hold); another value is a change."""
  from jaxrl.run import run_config

  new = (
    "task.environment",
    "rollout.max_observation_tokens",
    "rollout.max_turns",
    "tool.time_limit",
  )
  now = run_config.record(tiny_config(""))
  for key in (run_config.sft_key(now), run_config.eval_key(now, after_rl=True, params="p")):
    older = {k: v for k, v in key.items() if k not in new}
    assert len(older) < len(key) and run_config.cache_changes(older, key) is None
  other = run_config.record(tiny_config("", **{"rollout.max_observation_tokens": 5}))
  why = run_config.cache_changes(older, run_config.eval_key(other, after_rl=True, params="p"))
  assert why == "its config differs: rollout.max_observation_tokens 64 → 5"
