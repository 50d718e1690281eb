"""Multi-turn rollouts in a chat template (jaxrl.tasks.envs.chat): the frame read off a ChatML
(Qwen2.5-style) and a Llama 3-style template, the calculator's answers framed by it, tiny:tools in
its chat form (prompt, SFT corpus, verifier), and a chat rollout of the JAX sampler whose layout is
the template's, id for id."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from math_fixtures import make_tokenizer
from run_helpers import tiny_config

from jaxrl.config import ConfigError
from jaxrl.rollout.engine import SampleRequest
from jaxrl.run.components import task_sections
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.envs import calculator
from jaxrl.tasks.envs.chat import ChatTemplateError, chat_frame, render, user_prompt
from jaxrl.tasks.envs.environment import token_ids
from jaxrl.tasks.envs.tool import ToolEnvironment
from jaxrl.tasks.task import load_task

TAGS = [
  calculator.CALL_OPEN,
  calculator.CALL_CLOSE,
  calculator.RESULT_OPEN,
  calculator.RESULT_CLOSE,
]


def _hf_tokenizer(style: str):
  """The math tests' byte-level BPE tokenizer (ChatML or Llama 3 style) with the calculator's tags
  as added tokens, as a user adds their tool's tags to an instruct model's tokenizer."""
  tok = make_tokenizer(style)
  tok.add_tokens(TAGS)
  return tok


FRAMES = {
  "chatml": dict(
    end_of_turn="<|im_end|>",
    before_tool="\n<|im_start|>tool\n",
    after_tool="<|im_end|>\n<|im_start|>assistant\n",
    assistant_header="<|im_start|>assistant\n",
  ),
  "llama3": dict(
    end_of_turn="<|eot_id|>",
    before_tool="<|start_header_id|>tool<|end_header_id|>\n\n",
    after_tool="<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    assistant_header="<|start_header_id|>assistant<|end_header_id|>\n\n",
  ),
}


@pytest.mark.parametrize("style", sorted(FRAMES))
def test_the_frame_is_read_off_the_template(style):
  tok = _hf_tokenizer(style)
  frame = chat_frame(tok)
  want = FRAMES[style]
  assert {k: getattr(frame, k) for k in want} == want
  assert frame.end_of_turn_id == tok.convert_tokens_to_ids(want["end_of_turn"])
  # The frame and the template agree on a whole conversation: the model's turn and its end, the
  # tool message, the next header, the final answer.
  messages = [
    {"role": "user", "content": "What is 2*3?"},
    {"role": "assistant", "content": "<calc>2*3</calc>"},
    {"role": "tool", "content": "6"},
  ]
  text = user_prompt(tok, "What is 2*3?")
  text += "<calc>2*3</calc>" + frame.end_of_turn + frame.before_tool + "6" + frame.after_tool
  assert text == render(tok, messages, generation_prompt=True)


@pytest.mark.parametrize("style", sorted(FRAMES))
def test_a_call_is_answered_in_the_tool_role_and_the_turn_stop_is_the_end_of_turn(style):
  tok = _hf_tokenizer(style)
  frame = chat_frame(tok)
  env = ToolEnvironment(
    tok,
    tool=calculator.TOOL,
    call_open=calculator.CALL_OPEN,
    call_close=calculator.CALL_CLOSE,
    result_open="",
    result_close="",
    max_turns=3,
    max_observation_tokens=64,
    chat=frame,
  )
  try:
    assert env.stop_sequences == ((frame.end_of_turn_id,),)
    assert env.call_ids == (tok.convert_tokens_to_ids(calculator.CALL_CLOSE),)
    turn = token_ids(tok, "<calc>2*3</calc>") + [frame.end_of_turn_id]
    (state,) = env.reset([0])
    result = env.step([state], [turn], [0])
    (obs,) = result.observation_ids
    assert obs == token_ids(tok, frame.before_tool + "6" + frame.after_tool)
    assert tok.decode(obs) == frame.before_tool + "6" + frame.after_tool
    assert result.info[0]["status"] == "ok" and not result.done[0]
  finally:
    env.close()


def test_a_template_whose_turn_has_no_end_token_is_refused():
  tok = _hf_tokenizer("chatml")
  tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
  with pytest.raises(ChatTemplateError, match="generation prompt"):
    chat_frame(tok)
  tok.chat_template += "{% if add_generation_prompt %}assistant: {% endif %}"
  with pytest.raises(ChatTemplateError, match="no special token ends the assistant's turn"):
    chat_frame(tok)


def test_a_frame_that_does_not_fit_the_observation_names_the_field(tmp_path):
  cfg = tiny_config("tools,chat,test", **{"rollout.max_observation_tokens": 16})
  with pytest.raises(ConfigError, match="rollout.max_observation_tokens"):
    load_task(task_sections(cfg), str(tmp_path))


@pytest.mark.parametrize(
  "arg,overrides",
  [("test", {"task.chat_template": True}), ("countdown,test", {"task.chat_template": True})],
)
def test_chat_template_is_the_calculator_tasks_variant(arg, overrides):
  with pytest.raises(ConfigError, match="task.chat_template"):
    tiny_config(arg, **overrides)


@pytest.fixture(scope="module")
def chat_task(tmp_path_factory):
  task = load_task(
    task_sections(tiny_config("tools,chat,test")), str(tmp_path_factory.mktemp("tokenizer"))
  )
  yield task
  task.close()


def test_tiny_tools_chat_prompts_corpus_and_verifier(chat_task):
  tok, env = chat_task.tokenizer, chat_task.environment
  frame = env.chat
  assert chat_task.eos_id == frame.end_of_turn_id == tok.convert_tokens_to_ids(vocab.CHAT_END)
  # Prompts: BOS, then the user turn and the assistant header; the frame's length is the constant
  # the prompt width is computed from.
  ids = chat_task.train_prompt_ids[0][chat_task.train_prompt_mask[0]].tolist()
  text = tok.decode(ids[1:])
  assert ids[0] == vocab.BOS_ID and text.startswith("<|im_start|>user\n")
  assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
  assert len(token_ids(tok, user_prompt(tok, ""))) == vocab.CHAT_PROMPT_TOKENS
  # The SFT corpus: a call ends with the end-of-turn token (learned), the frame is read, not learned.
  called = np.flatnonzero(chat_task.sft_loss_mask.sum(1) < chat_task.sft_target_mask.sum(1))
  assert called.size
  for i in called[:20]:
    keep = chat_task.sft_target_mask[i]
    ids, learned = chat_task.sft_target_ids[i][keep].tolist(), chat_task.sft_loss_mask[i][keep]
    turn_end = ids.index(frame.end_of_turn_id)
    assert tok.decode(ids[: turn_end + 1]).endswith("</calc><|im_end|>") and learned[turn_end]
    obs = ids[turn_end + 1 : turn_end + 1 + int((~learned).sum())]
    assert not learned[turn_end + 1 : turn_end + 1 + len(obs)].any()
    obs_text = tok.decode(obs)
    assert obs_text.startswith(frame.before_tool) and obs_text.endswith(frame.after_tool)
    assert ids[-1] == chat_task.eos_id and learned[-1]
  # The verifier reads the model's last turn.
  framed = f"<calc>1+1</calc><|im_end|>{frame.before_tool}<result>2</result>{frame.after_tool}"
  assert chat_task.score([framed + "2", framed + "3", "2"], ["2"] * 3).tolist() == [1, 0, 1]


@pytest.mark.slow  # a warm start of 150 steps (~30 s)
def test_a_chat_rollout_is_the_templates_conversation_id_for_id(tmp_path):
  """The JAX sampler on tiny:tools,chat after a short warm start: each asked turn ends
  ``</calc><|im_end|>``, its observation is the frame around the calculator's answer, and a row
  that finished ends with the end-of-turn token, sampled and in the loss mask."""
  from jaxrl.run.train import Trainer

  cfg = tiny_config("tools,chat,test", **{"sft.steps": 150})
  with Trainer.open(cfg, str(tmp_path)) as trainer:
    params = trainer.warm_start(trainer.init_params())
    task, engine = trainer.task, trainer.engine
    ids, mask = task.train_prompt_ids, task.train_prompt_mask
    counts = np.full(len(ids), 2)
    request = SampleRequest(ids, mask, counts, jax.random.PRNGKey(0), 1.0)
    out = jax.tree.map(np.asarray, engine.generate(params, 0, request))
    tok, frame = task.tokenizer, task.environment.chat
  close = tok.convert_tokens_to_ids(calculator.CALL_CLOSE)
  asked = finished = 0
  for r in range(int(counts.sum())):
    keep = out.mask_RxN[r]
    ids_r, model_r = out.tokens_RxN[r][keep].tolist(), out.loss_mask_RxN[r][keep]
    pieces, start = [], 0
    for k in range(1, len(ids_r) + 1):  # the response split by author
      if k == len(ids_r) or model_r[k] != model_r[start]:
        pieces.append((bool(model_r[start]), ids_r[start:k]))
        start = k
    for (by_model, turn), (_, obs) in zip(pieces[::2], pieces[1::2]):
      assert by_model and turn[-2:] == [close, frame.end_of_turn_id]
      text = tok.decode(obs)
      assert text.startswith(frame.before_tool) and text.endswith(frame.after_tool), text
      asked += 1
    if out.finished_R[r] and pieces[-1][0]:
      assert pieces[-1][1][-1] == frame.end_of_turn_id
      finished += 1
  assert asked >= 4 and finished >= 4, (asked, finished)


def test_the_verifier_reads_past_the_end_of_turn_an_observation_answered(chat_task):
  """In a chat the model's end-of-turn id (its EOS) ends every turn: the text the verifier reads
  runs to the one no observation follows, and samples.jsonl shows every turn."""
  from jaxrl.tasks.envs.trajectory import trajectory_parts

  tok, env = chat_task.tokenizer, chat_task.environment
  eot = env.chat.end_of_turn_id
  call = token_ids(tok, "<calc>2*3</calc>") + [eot]
  obs, _ = env.observation_ids("6")
  answer = token_ids(tok, "6") + [eot]
  ids = call + obs + answer
  by_model = [True] * len(call) + [False] * len(obs) + [True] * len(answer)
  rollouts = types.SimpleNamespace(
    tokens_RxN=np.array([ids]),
    mask_RxN=np.ones((1, len(ids)), bool),
    loss_mask_RxN=np.array([by_model]),
    lengths_R=np.array([len(ids)]),
  )
  (text,) = chat_task.decode(rollouts)
  assert text == tok.decode(ids[:-1]) and chat_task.score([text], ["6"]).tolist() == [1.0]
  parts = trajectory_parts(tok, ids, by_model, eos_id=chat_task.eos_id)
  assert [p["by"] for p in parts] == ["model", "environment", "model"]
  assert parts[0]["text"] == "<calc>2*3</calc><|im_end|>" and parts[-1]["text"] == "6"
