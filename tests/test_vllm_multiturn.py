"""The sidecar's multi-turn turns (jaxrl.rollout.vllm_multiturn) against a scripted server: what
each turn's requests carry (the ids so far, never text), where the turns and observations land,
how each turn ends (EOS, a stop token, a stop string, the budget), the limits, and a turn retried
after a server restart."""

import types

import jax
import numpy as np

from jaxrl.rollout import multiturn, vllm_multiturn
from jaxrl.rollout.engine import SampleRequest
from jaxrl.rollout.sidecar import LaunchConfig
from jaxrl.rollout.vllm_api import Completion, ServerError
from jaxrl.rollout.vllm_engine import EngineConfig, VllmEngine

PAD, EOS, STOP = 0, 1, 2
T, O = 4, 3
OBS = [20, 21]


def _stops(max_turns=3, strings=()):
  turns = multiturn.TurnConfig(
    stop_ids=(STOP,), max_turn_tokens=T, max_observation_tokens=O, max_turns=max_turns
  )
  return vllm_multiturn.TurnStops(turns, strings)


class Server:
  """Answers turn t of row r with ``script[r][t]`` (ids, finish reason); records the requests."""

  def __init__(self, script):
    self.script, self.requests, self.max_tokens = script, [], []

  def __call__(self, seqs, running_R, turn, max_tokens):
    self.max_tokens.append(max_tokens)
    self.requests.append({r: list(seqs[r]) for r in np.flatnonzero(running_R)})
    out = []
    for r, running in enumerate(running_R):
      if running:
        ids, reason = self.script[r][turn]
        ids = ids[:max_tokens]  # the server's budget
        out.append([Completion(ids, [-0.5] * len(ids), reason)])
      else:
        out.append([])
    return out


class Environment:
  """Answers every asked row with ``OBS``; records the turns it was shown."""

  def __init__(self):
    self.shown = []

  def __call__(self, asked_R, turn_tokens):
    self.shown.append({r: list(turn_tokens[r]) for r in np.flatnonzero(asked_R)})
    return [OBS if a else [] for a in asked_R], np.zeros(len(asked_R), bool)


def _run(script, n, stops, prompts):
  server, env = Server(script), Environment()
  out = vllm_multiturn.generate(
    server, prompts, env, stops=stops, max_new_tokens=n, eos_id=(EOS,), pad_id=PAD
  )
  return (*out, server, env)


def test_turns_observations_and_ends_in_the_jax_samplers_layout():
  script = [
    [([5, 6, STOP], "stop"), ([7, EOS], "stop")],  # calls, then finishes
    [([5, EOS], "stop")],  # finishes in its first turn
    [([9, 9, 9, 9], "length")],  # the turn's budget: ends unfinished
    [([8, 9], "stop"), ([STOP], "stop")],  # a stop string; then asks on the last turn it has
  ]
  prompts = [[3, 4], [3], [4, 4, 4], [3, 3]]
  tokens, mask, loss, logp, finished, counts, server, env = _run(
    script, T + O + T, _stops(strings=("</x>",)), prompts
  )
  # Turn 1 is as wide as its longest row (4); the observation block right-aligned after it.
  want = np.array(
    [
      [5, 6, STOP, PAD, PAD, *OBS, 7, EOS, PAD, PAD],
      [5, EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
      [9, 9, 9, 9, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
      [8, 9, PAD, PAD, PAD, *OBS, STOP, PAD, PAD, PAD],
    ]
  )
  np.testing.assert_array_equal(tokens, want)
  np.testing.assert_array_equal(mask, want != PAD)
  env_positions = np.zeros_like(mask)
  env_positions[[0, 0, 3, 3], [5, 6, 5, 6]] = True
  np.testing.assert_array_equal(loss, mask & ~env_positions)
  assert np.all(logp[loss] == -0.5) and np.all(logp[~loss] == 0)
  np.testing.assert_array_equal(finished, [True, True, False, False])
  np.testing.assert_array_equal(counts.turns_R, [2, 1, 1, 2])
  np.testing.assert_array_equal(counts.tool_calls_R, [1, 0, 0, 1])
  # Tokens in: turn 2's prompts are the ids so far; the environment saw each asked turn's ids.
  assert server.requests == [
    dict(enumerate(prompts)),
    {0: [3, 4, 5, 6, STOP, *OBS], 3: [3, 3, 8, 9, *OBS]},
  ]
  assert env.shown == [{0: [5, 6, STOP], 3: [8, 9]}]


def test_no_observation_without_room_for_its_block_and_a_reply():
  # The first turn takes all T positions: an observation needs its O positions and one more.
  script = [[([5, 5, 5, STOP], "stop")], [([STOP], "stop")]]
  for n, turns in ((T + O, 3), (T + O + T, 1)):
    tokens, mask, loss, _, finished, counts, server, env = _run(
      script, n, _stops(max_turns=turns), [[3], [4]]
    )
    assert env.shown == [] and len(server.requests) == 1
    np.testing.assert_array_equal(counts.tool_calls_R, [0, 0])
    np.testing.assert_array_equal(finished, [False, False])  # asked, never answered
    np.testing.assert_array_equal(mask, loss)


def test_an_observation_that_fits_is_answered_and_the_reply_gets_what_is_left():
  """N = T + O + 1: the block fits with one position for the reply, which the server is asked
  for; a reply cut there ends unfinished, one that finishes in it is finished."""
  script = [
    [([5, 5, 5, STOP], "stop"), ([EOS], "stop")],
    [([STOP], "stop"), ([7, 7, EOS], "length")],
  ]
  tokens, mask, loss, _, finished, counts, server, env = _run(
    script, T + O + 1, _stops(), [[3], [4]]
  )
  assert server.max_tokens == [T, 1]
  assert env.shown == [{0: [5, 5, 5, STOP], 1: [STOP]}]
  np.testing.assert_array_equal(tokens[:, -1], [EOS, 7])
  np.testing.assert_array_equal(finished, [True, False])
  np.testing.assert_array_equal(counts.turns_R, [2, 2])
  np.testing.assert_array_equal(counts.tool_calls_R, [1, 1])


def test_an_empty_server_turn_is_no_turn():
  """The server ends a turn before any token where its context is full: the row ends unfinished,
  and that turn is not counted (the JAX sampler's turns always hold a token), in the first turn
  and after an observation alike."""
  script = [
    [([5, STOP], "stop"), ([], "length")],  # calls, is answered, then the server has no room
    [([], "length")],  # no room from the start
    [([6, EOS], "stop")],
  ]
  tokens, mask, loss, logp, finished, counts, server, env = _run(
    script, 2 * T + O, _stops(), [[3], [4], [5]]
  )
  np.testing.assert_array_equal(counts.turns_R, [1, 0, 1])
  np.testing.assert_array_equal(counts.tool_calls_R, [1, 0, 0])
  np.testing.assert_array_equal(finished, [False, False, True])
  assert not mask[1].any() and not loss[1].any()


def test_a_chat_turn_asks_only_with_a_call_and_finishes_without_one():
  """The end-of-turn id ends every turn (and is EOS too, as a chat model's): a turn holding the
  call id asks, one without finishes the row; an empty server turn is no turn."""
  eot, call = 9, 8
  stops = vllm_multiturn.TurnStops(
    multiturn.TurnConfig(
      stop_ids=(eot,), call_ids=(call,), max_turn_tokens=T, max_observation_tokens=O, max_turns=3
    )
  )
  script = [
    [([5, call, eot], "stop"), ([6, eot], "stop")],  # calls, then answers
    [([6, eot], "stop")],  # answers at once
    [([], "length")],  # the server had no room: no token, no turn
  ]
  server, env = Server(script), Environment()
  tokens, mask, loss, logp, finished, counts = vllm_multiturn.generate(
    server, [[3], [4], [5]], env, stops=stops, max_new_tokens=2 * T + O, eos_id=(eot,), pad_id=PAD
  )
  assert env.shown == [{0: [5, call, eot]}]
  np.testing.assert_array_equal(finished, [True, True, False])
  np.testing.assert_array_equal(counts.turns_R, [2, 1, 0])
  np.testing.assert_array_equal(counts.tool_calls_R, [1, 0, 0])


ADAPTER = "policy-test-000001"


class FlakyClient:
  """A stand-in server: a turn ends ``[5, STOP]`` until the row has an observation, then
  ``[EOS]``; its ``fail_at``-th call dies (``ServerError``) as a crashed server's would."""

  def __init__(self, calls, fail_at):
    self.calls, self.fail_at = calls, fail_at

  def complete(self, prompts, counts, *, seed, stop_token_ids, model, **kw):
    assert stop_token_ids == [EOS, STOP] and model == ADAPTER  # each turn names the adapter
    self.calls.append((seed, [list(p) for p, c in zip(prompts, counts) if c]))
    if len(self.calls) == self.fail_at:
      raise ServerError("connection reset")
    return [
      [Completion([EOS] if OBS[0] in p else [5, STOP], [-0.5] * (1 + (OBS[0] not in p)), "stop")]
      if c
      else []
      for p, c in zip(prompts, counts)
    ]

  def close(self):
    pass


def _engine(tmp_path, calls, fail_at):
  """A launched-mode engine whose server is the ``FlakyClient``; each restart makes a new one."""
  cfg = EngineConfig(launch=LaunchConfig(python="python", log_dir=str(tmp_path)), max_restarts=1)
  engine = VllmEngine(
    types.SimpleNamespace(vocab_size=32),  # generate reads the vocabulary's size alone
    None,
    cfg,
    workdir=str(tmp_path),
    max_new_tokens=T + O + T,
    eos_id=EOS,
    pad_id=PAD,
    turns=_stops(max_turns=2),
  )
  engine.version, engine._dir = 0, str(tmp_path)
  engine._adapter = ADAPTER  # as after a LoRA adapter push
  engine.client = FlakyClient(calls, fail_at)
  restarts = []

  def start(model_dir, version, loads=None):
    restarts.append(model_dir)
    engine.client = FlakyClient(calls, fail_at=0)

  engine._start = start
  return engine, restarts


def test_a_turn_that_fails_is_retried_whole_after_a_restart(tmp_path):
  """The server dies under turn 2: it is restarted and turn 2's requests are sent again, with the
  same prompts and seeds; the environment answered turn 1 once; the rollouts equal a run that never
  failed."""
  ids, mask = np.array([[3, 4], [0, 4]]), np.array([[True, True], [False, True]])
  outs, envs, logs = [], [], []
  for fail_at in (0, 2):
    calls = []
    engine, restarts = _engine(tmp_path, calls, fail_at)
    env = Environment()
    # version 0 is the one the engine holds: no push
    request = SampleRequest(ids, mask, [1, 1], jax.random.PRNGKey(0), 1.0, respond=env)
    outs.append(engine.generate(None, 0, request))
    engine.close()
    envs.append(env.shown)
    logs.append((calls, restarts, outs[-1]))
  (calls0, restarts0, counts0), (calls1, restarts1, counts1) = logs
  assert restarts0 == [] and restarts1 == [str(tmp_path)]
  assert len(calls0) == 2 and calls1 == [calls0[0], calls0[1], calls0[1]]
  assert envs[0] == envs[1] == [{0: [5, STOP], 1: [5, STOP]}]
  for field in ("tokens_RxN", "mask_RxN", "loss_mask_RxN", "behaviour_logp_RxN", "finished_R"):
    np.testing.assert_array_equal(getattr(outs[0], field), getattr(outs[1], field))
  np.testing.assert_array_equal(outs[1].finished_R, [True, True])
  np.testing.assert_array_equal(counts1.tool_calls_R, counts0.tool_calls_R)
