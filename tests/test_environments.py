"""Environments (jaxrl/tasks/envs): the batched protocol as the calculator implements it, tool
calls bounded in worker processes (a hanging or crashing tool is an error observation for its row,
the other rows are answered, the pool recovers), the registry, trajectories by author, and the
config fields of multi-turn rollouts."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
import run_helpers
from run_helpers import tiny_config

from jaxrl.config import ConfigError
from jaxrl.rollout import multiturn
from jaxrl.tasks.data.tokenizer import TOOLS_VOCAB, build_tokenizer
from jaxrl.tasks.envs import registry
from jaxrl.tasks.envs.environment import (
  Environment,
  TurnState,
  bounded_observation,
  ends_with_stop,
  token_ids,
)
from jaxrl.tasks.envs.tool import ToolEnvironment, ToolLimits
from jaxrl.tasks.envs.trajectory import trajectory_parts, trajectory_text

CHAOS = "tool_fns:chaos"  # tests/tool_fns.py; tests/ is on sys.path under pytest


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return build_tokenizer(tmp_path_factory.mktemp("tokenizer"), "tools")


def turns(tok, texts):
  return [token_ids(tok, t) for t in texts]


def read(tok, result):
  return [tok.decode(ids) for ids in result.observation_ids]


def _environment(cfg, tok):
  """The run's environment of ``cfg``, built from the sections an environment reads."""
  return registry.build_environment(
    tok, task=cfg.task, data=cfg.data, tool=cfg.tool, rollout=cfg.rollout
  )


@pytest.fixture
def calculator(tok):
  env = _environment(tiny_config("tools", **{"rollout.max_turns": 3}), tok)
  yield env
  env.close()


def test_the_calculator_answers_only_the_rows_that_asked(tok, calculator):
  env = calculator
  assert isinstance(env, Environment)
  assert env.stop_strings == ("</calc>",)
  assert env.stop_sequences == ((TOOLS_VOCAB["</calc>"],),)
  assert env._pool is None  # no worker until the first call
  states = env.reset([7, 8, 9, 10])
  assert states == [TurnState(q) for q in (7, 8, 9, 10)]
  res = env.step(states, turns(tok, ["<calc>12345*678</calc>", "so <calc>2*(3+4)</calc>"]), [1, 3])
  assert read(tok, res) == ["<result>8369910</result>", "<result>14</result>"]
  assert res.done.tolist() == [False, False]
  assert [i["status"] for i in res.info] == ["ok", "ok"]
  assert res.states[0] == states[0] and res.states[2] == states[2]  # not stepped: as they were
  assert res.states[1] == TurnState(8, turns=1, calls=1)
  assert env.trajectory_reward(res.states) is None
  # The calculator's own refusals are answers too; a turn without a call is told so.
  res = env.step(
    res.states, turns(tok, ["<calc>7/0</calc>", "</calc>", "<calc>1+</calc>"]), [0, 1, 2]
  )
  assert read(tok, res) == [
    "<result>error: division by zero</result>",
    "<result>error: no call</result>",
    "<result>error: syntax</result>",
  ]
  assert [i["status"] for i in res.info] == ["ok", "no_call", "ok"]
  assert res.states[1] == TurnState(8, turns=2, calls=2, failures=1)


def test_the_last_turn_ends_the_trajectory_unanswered(tok, calculator):
  env = calculator  # rollout.max_turns = 3
  states = env.reset([0, 1])
  call = turns(tok, ["<calc>1+1</calc>"])
  for _ in range(env.max_turns - 1):
    res = env.step(states, call, [0])
    states = res.states
    assert read(tok, res) == ["<result>2</result>"] and not res.done[0]
  res = env.step(states, call, [0])
  assert res.observation_ids == [[]] and res.done.tolist() == [True]
  assert res.info == [{"status": "turn_limit"}] and res.states[0].done
  with pytest.raises(ValueError, match="row 0 is done"):
    env.step(res.states, call, [0])
  with pytest.raises(ValueError, match="2 turns for 1 rows"):
    env.step(res.states, call * 2, [1])


def test_observations_are_bounded_with_a_marker():
  assert bounded_observation([1], [5, 6, 7], [2], 5) == ([1, 5, 6, 7, 2], False)
  assert bounded_observation([1], [5, 6, 7, 8, 9], [2], 6, marker=[0]) == ([1, 5, 6, 7, 0, 2], True)
  assert bounded_observation([1, 1], [5], [2, 2], 3, marker=[0]) == ([1, 1, 5], True)
  assert ends_with_stop([4, 5, 51], ((51,),)) and not ends_with_stop([51, 4], ((51,),))
  assert ends_with_stop([1, 2, 3], ((9,), (2, 3))) and not ends_with_stop([], ((51,),))


def test_a_hanging_or_crashing_tool_is_an_error_for_its_row_and_the_pool_recovers(tok):
  limits = ToolLimits(workers=2, time_limit_s=2.0, kill_grace_s=1.0, memory_limit_mb=1024,
                      batch_time_limit_s=120.0)  # fmt: skip
  env = ToolEnvironment(
    tok,
    tool=CHAOS,
    call_open="<calc>",
    call_close="</calc>",
    result_open="<result>",
    result_close="</result>",
    max_turns=4,
    max_observation_tokens=32,
    limits=limits,
  )
  calls = ["a", "hang", "b", "crash", "deaf", "raise", "memory", "number", "huge", "c"]
  try:
    states = env.reset(range(len(calls)))
    res = env.step(states, turns(tok, [f"<calc>{c}</calc>" for c in calls]), range(len(calls)))
    timeout, failed = "<result>error: timeout</result>", "<result>error: tool failed</result>"
    huge = "<result>" + "7" * (32 - 5) + "...</result>"  # 1 MB cut to 32 tokens, tags kept
    assert read(tok, res) == [
      "<result>echo a</result>", timeout, "<result>echo b</result>", failed, timeout, failed,
      failed, failed, huge, "<result>echo c</result>",
    ]  # fmt: skip
    assert [len(o) for o in res.observation_ids][8] == 32
    status = [i["status"] for i in res.info]
    assert status == [
      "ok",
      "timeout",
      "ok",
      "error",
      "timeout",
      "error",
      "error",
      "error",
      "ok",
      "ok",
    ]
    assert "worker died" in res.info[3]["error"]
    assert res.info[5]["error"] == "RuntimeError: the tool broke"
    assert res.info[7]["error"] == "returned int, not str"
    assert res.info[8]["truncated"] and not res.info[0]["truncated"]
    assert [s.failures for s in res.states] == [0, 1, 0, 1, 1, 1, 1, 1, 0, 0]
    assert env._pool.restarts >= 2  # the crash and the deaf hang, at least
    # The next call finds a whole pool.
    res = env.step(res.states, turns(tok, ["<calc>d</calc>", "<calc>e</calc>"]), [1, 3])
    assert read(tok, res) == ["<result>echo d</result>", "<result>echo e</result>"]
  finally:
    env.close()
  env.close()  # idempotent


def test_registry(tok, monkeypatch):
  assert _environment(tiny_config("test"), tok) is None  # "" = single-turn
  cfg = tiny_config("tools", **{"task.environment": "nope"})
  with pytest.raises(ConfigError, match=r"^config\.task\.environment: 'nope' is not one of \(''"):
    registry.check(cfg.task)
  # A new environment is its factory and one registry line.
  made = []

  def echo_environment(tokenizer, *, task, data, tool, rollout):
    made.append(rollout.max_turns)
    return ToolEnvironment(
      tokenizer, tool=CHAOS, call_open="<calc>", call_close="</calc>", result_open="<result>",
      result_close="</result>", max_turns=rollout.max_turns, max_observation_tokens=8,
    )  # fmt: skip

  monkeypatch.setitem(registry.ENVIRONMENTS, "echo", echo_environment)
  registry.check((cfg := tiny_config("tools", **{"task.environment": "echo"})).task)
  env = _environment(cfg, tok)
  assert isinstance(env, Environment) and made == [cfg.rollout.max_turns]
  env.close()


def test_trajectory_parts_by_author(tok):
  ids = token_ids(tok, "<calc>12*3</calc><result>36</result>36") + [tok.eos_token_id, 0, 0]
  model = [True] * 6 + [False] * 4 + [True] * 3 + [False] * 2  # EOS is the model's; pads are not
  parts = trajectory_parts(tok, ids, model, length=13)  # the pads are past the response's length
  assert parts == [
    {"by": "model", "text": "<calc>12*3</calc>"},
    {"by": "environment", "text": "<result>36</result>"},
    {"by": "model", "text": "36"},
  ]
  assert trajectory_text(parts) == "<calc>12*3</calc>[<result>36</result>]36"
  assert trajectory_parts(tok, ids, model, length=8) == [
    {"by": "model", "text": "<calc>12*3</calc>"},
    {"by": "environment", "text": "<result>3"},
  ]
  assert trajectory_parts(tok, [], []) == []
  with pytest.raises(ValueError, match="3 ids but 2 mask entries"):
    trajectory_parts(tok, [1, 2, 3], [True, True])


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"rollout.max_turns": 0}, "rollout.max_turns"),
    ({"rollout.max_turn_tokens": -1}, "rollout.max_turn_tokens"),
    ({"rollout.max_turn_tokens": 81}, "rollout.max_turn_tokens"),  # over max_new_tokens = 80
    ({"rollout.max_observation_tokens": 0}, "rollout.max_observation_tokens"),
    ({"rollout.max_observation_tokens": 80}, "rollout.max_observation_tokens"),
    ({"rollout.max_turns": 1}, "rollout.max_turns"),  # no turn would read the answer
    ({"tool.workers": -1}, "tool.workers"),
    ({"tool.time_limit": 0.0}, "tool.time_limit"),
    ({"tool.time_limit": float("inf")}, "tool.time_limit"),
    ({"tool.memory_limit_mb": 100}, "tool.memory_limit_mb"),
  ],
)
def test_config_errors_name_the_field(overrides, field):
  with pytest.raises(ConfigError) as e:
    tiny_config("tools", **overrides)
  assert e.value.field == field, e.value


def test_multi_turn_fields_are_free_without_an_environment():
  # Single-turn runs never read them: an observation budget above max_new_tokens is no error.
  cfg = tiny_config("test", **{"rollout.max_turns": 1, "rollout.max_observation_tokens": 500})
  assert cfg.task.environment == "" and cfg.rollout.max_new_tokens == 4


def guide_environment():
  """The class of docs/environments.md's environment written from scratch, as the guide shows it."""
  guide = (pathlib.Path(__file__).parents[1] / "docs" / "environments.md").read_text()
  section = guide.split("## The protocol from scratch", 1)[1]
  code = section.split("```python\n", 1)[1].split("```", 1)[0]
  namespace: dict = {}
  exec(compile(code, "docs/environments.md", "exec"), namespace)
  return namespace["GuessEnvironment"]


def test_the_guide_example_runs_as_written(tok):
  env = guide_environment()(tok, secrets=[42, 7], max_turns=3)
  assert isinstance(env, Environment)
  states = env.reset([0, 1])
  res = env.step(states, turns(tok, ["50=", "3="]), [0, 1])
  assert read(tok, res) == [" lower ", " higher "] and not res.done.any()
  res = env.step(res.states, turns(tok, ["42="]), [0])
  assert res.observation_ids == [[]] and res.done.tolist() == [True]
  assert env.trajectory_reward(res.states).tolist() == pytest.approx([-0.2, -0.1])


def test_a_hosts_slice_steps_its_own_rows_and_its_rollouts_carry_the_reward_term(tok):
  """One host's rows of a batch (``PerHostEngine``) get a fresh respond over their questions; the
  engine that stepped it puts the environment's trajectory reward into the rollouts' ``rewards_R``
  (gathered from the hosts with the rows)."""
  env = guide_environment()(tok, secrets=[42, 7], max_turns=3)
  whole = multiturn.EnvironmentRespond(env, [0, 0, 1, 1])
  part = whole.rows(2, 4)
  assert part.question_ids_R.tolist() == [1, 1] and [s.question_id for s in part.states] == [1, 1]
  observations, done_R = part(np.array([True, True]), turns(tok, ["3=", "7="]))
  assert [tok.decode(ids) for ids in observations] == [" higher ", ""] and done_R.tolist() == [
    False,
    True,
  ]
  part(np.array([True, False]), turns(tok, ["9=", ""]))  # only row 0 asked again
  rows = run_helpers.rollouts(
    np.ones((2, 1)),
    np.ones((2, 1)),
    np.ones((2, 2)),
    np.ones((2, 2)),
    np.zeros((2, 2)),
    [0, 0],
    [0, 0],
  )
  out = multiturn.with_trajectory_reward(dataclasses.replace(rows, rewards_R=None), part)
  np.testing.assert_allclose(out.rewards_R, [-0.2, -0.1])  # two guesses, one
  assert [s.turns for s in whole.states] == [0, 0, 0, 0]  # the whole batch's respond untouched
  assert multiturn.with_trajectory_reward(rows, lambda asked_R, turn_ids: None) is rows
