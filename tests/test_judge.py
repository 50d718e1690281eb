"""The judge term (``judge:URL``, docs/rewards.md) against a real HTTP server on 127.0.0.1 (Python's
``http.server`` on a real socket, answering as an OpenAI-compatible endpoint): verdicts read by
the parse rules, every kind of bad reply counted and None, retries with backoff, time-outs, a dead
endpoint at the start (an error naming the URL) and during the run (bounded, logged), the API key
sent and never logged, and user templates. Timing never decides an outcome: a server that must
time out waits on an event the test sets only afterwards."""

from __future__ import annotations

import dataclasses
import json
import math
import socket

import numpy as np
import pytest
from judge_fixtures import ChatServer, chat
from run_helpers import wait_until

from jaxrl.config import ConfigError, default_configdict, from_configdict
from jaxrl.run.components import task_sections
from jaxrl.tasks.rewards import judge
from jaxrl.tasks.rewards.judge import MAX_REPLY_BYTES, at, default_template, parse_score
from jaxrl.tasks.rewards.terms import build_terms, term_means

N = math.nan


@pytest.fixture
def template(tmp_path):
  """A user's template file of the given text."""

  def write(text: str) -> str:
    path = tmp_path / f"template{len(list(tmp_path.iterdir()))}.txt"
    path.write_text(text)
    return str(path)

  return write


@pytest.fixture
def endpoint_of():
  started = []

  def start(reply, **kwargs):
    started.append(ChatServer(reply, **kwargs))
    return started[-1]

  yield start
  for e in started:
    e.close()


def _terms(url: str, spec: str = "judge:{url}", **reward):
  cd = default_configdict()
  cd.reward.terms = spec.format(url=url)
  cd.reward.judge_backoff = 0.0  # retries at once: the tests count them, never wait them out
  for k, v in reward.items():
    setattr(cd.reward, k, v)
  return build_terms(task_sections(from_configdict(cd)))


def _score(terms, completions, answers=None):
  n = len(completions)
  answers = answers or ["42"] * n
  return terms.score(["What is 6 x 7?"] * n, completions, answers, None, np.zeros(n, int), 1)


# -- the parse rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "rule, reply, want",
  [
    ("score", "Correct.\nScore: 7", 0.7),
    ("score", "First Score: 2, on reflection **Score:** 9/10", 0.9),  # the last one, bold
    ("score", "score = 10", 1.0),
    ("score", "**Score**: 7", 0.7),
    ("score", "Score (0-10): 7", None),  # its first number is not the score: not read
    ("score", "I give it 8.", None),  # no "Score"
    ("score", "Score: 11", None),  # off the scale
    ("score", "Score: -1", None),
    ("score", "<think>Score: 3? no.</think>Score: 6.5", 0.65),  # thoughts are not read
    ("boxed", "The answer is fine: \\boxed{ 4 }", 0.4),
    ("boxed", "Score: 4", None),
    ("last-number", "Step 1 of 2: it checks out, 10", 1.0),
    ("last-number", "8/10", None),  # the last number is 10 ... on a 0-5 scale below
    ("last-number", "nothing", None),
  ],
)
def test_parse_rules(rule, reply, want):
  high = 5.0 if reply == "8/10" else 10.0
  got, why = parse_score(reply, rule, 0.0, high)
  if want is None:
    assert got is None and why
  else:
    assert got == pytest.approx(want) and why == ""


@pytest.mark.parametrize("rule", list(judge.PARSE_RULES))
def test_the_built_in_prompt_asks_for_what_its_rule_reads(rule):
  prompt = default_template(rule).format(question="Q", response="R", reference="A", min=0, max=10)
  ask = {"score": '"Score: N"', "boxed": "\\boxed{N}", "last-number": "write no number after it"}
  assert ask[rule] in prompt and "from 0 (wrong, or no answer) to 10" in prompt


def test_requests_go_under_the_servers_root():
  assert at("http://h:1", "/v1/models") == "http://h:1/v1/models"
  assert at("http://h:1/v1/", "/v1/models") == "http://h:1/v1/models"
  assert at("https://h/api/v1?api-version=2", "/v1/chat/completions") == (
    "https://h/api/v1/chat/completions?api-version=2"
  )


# -- verdicts and bad replies ---------------------------------------------------------------------

REPLIES = {
  "good": chat("Right, and shown.\nScore: 8"),
  "weak": chat("Score: 2/10"),
  "prose": chat("I cannot decide."),
  "off": chat("Score: 42"),
  "huge": chat("Score: 5 " + "x" * (1 << 20)),  # a 1 MiB reply
  "html": (200, b"<html>not json</html>"),
  "shape": (200, json.dumps({"choices": []}).encode()),
  "bad-request": (400, b'{"error": "no"}'),
  "redirect": (302, b""),  # to /elsewhere on the same server: never followed
}


def test_verdicts_and_every_bad_reply_counted(endpoint_of, template, caplog):
  server = endpoint_of(lambda prompt, tries, release: REPLIES[prompt.split("|")[1]])
  terms = _terms(server.url, judge_template=template("{question}|{response}|{reference}"))
  names = list(REPLIES)
  got = _score(terms, names)
  values = [0.8, 0.2, N, N, N, N, N, N, N]
  np.testing.assert_array_equal(got.kept_R, [not math.isnan(v) for v in values])
  np.testing.assert_allclose(got.rewards_R, np.nan_to_num(values), rtol=1e-6)
  means = term_means(got.metrics)
  assert means["reward_term_judge_failed"] == 7
  assert means["reward_term_judge"] == pytest.approx(0.5)
  assert means["reward_term_judge_applies"] == pytest.approx(2 / 9)
  # None of these is retried: another try would get the same reply.
  assert sorted(b["messages"][0]["content"] for b in server.chats()) == sorted(
    f"What is 6 x 7?|{n}|42" for n in names
  )
  body = server.chats()[0]
  assert body["model"] == "judge-1" and body["temperature"] == 0.0 and body["max_tokens"] == 512
  assert f"judge {server.url}: 7 of 9 answers got no verdict" in caplog.text
  assert {p for p, _, _ in server.requests} == {"/v1/models", "/v1/chat/completions"}


def test_a_reply_past_the_size_limit_is_refused_unread(endpoint_of, template):
  """Exactly the limit is read; one byte more is refused (the body's size, JSON included)."""
  wrapper = len(chat("")[1])
  sizes = {"at": MAX_REPLY_BYTES - wrapper, "over": MAX_REPLY_BYTES - wrapper + 1}
  server = endpoint_of(lambda p, t, r: chat("Score: 3" + " " * (sizes[p] - 8)))
  terms = _terms(server.url, judge_template=template("{response}"))
  got = _score(terms, ["at", "over"])
  np.testing.assert_array_equal(got.kept_R, [1, 0])
  assert got.rewards_R[0] == pytest.approx(0.3)


# -- retries, time-outs, dead endpoints -----------------------------------------------------------


def test_transient_failures_are_retried_then_counted(endpoint_of, template):
  """503 and 429 are retried (judge_retries = 2: three tries); a third failure is a verdict
  missing. One answer per batch: the endpoint is never marked down for another answer."""
  plan = {"late": [503, 429], "never": [503, 503, 503], "first": []}

  def reply(prompt, tries, release):
    codes = plan[prompt]
    return (codes[tries - 1], b"busy") if tries <= len(codes) else chat("Score: 10")

  server = endpoint_of(reply)
  terms = _terms(server.url, judge_template=template("{response}"))
  for name, want, sent in [("late", 1.0, 3), ("never", N, 3), ("first", 1.0, 1)]:
    got = _score(terms, [name])
    assert got.metrics["reward_term_judge_failed"] == float(math.isnan(want))
    assert got.kept_R[0] == (not math.isnan(want))
    assert sum(b["messages"][0]["content"] == name for b in server.chats()) == sent


def test_a_request_past_its_time_limit_is_retried_then_counted(endpoint_of, caplog):
  """The server holds every request until the test ends, so each try times out."""

  def reply(prompt, tries, release):
    release.wait()
    return chat("Score: 10")

  server = endpoint_of(reply)
  terms = _terms(server.url, judge_retries=1)
  # Short for the held requests only: the start's model query had the default, whatever the load.
  judge = terms.scorers[0]
  judge.settings = dataclasses.replace(judge.settings, timeout=0.3)
  got = _score(terms, ["slow"])
  assert got.metrics["reward_term_judge_failed"] == 1 and not got.kept_R[0]
  # a try and its retry (the server records a request when it reads it: waited for, not assumed)
  wait_until(lambda: len(server.chats()) == 2, 60, "both tries at the server")
  assert "timed out" in caplog.text and "(after 2 tries)" in caplog.text


def test_a_dead_endpoint_mid_run_is_bounded_logged_and_tried_again(endpoint_of, caplog):
  """An endpoint failing every request costs at most one request's tries per worker, the rest of
  the batch failing at once (counted, logged with the URL); the next batch asks again. A server
  that is gone altogether fails the same way."""
  state = {"up": False}
  server = endpoint_of(lambda p, t, r: chat("Score: 6") if state["up"] else (503, b"down"))
  terms = _terms(server.url, judge_workers=2, judge_retries=1)
  got = _score(terms, [f"a{i}" for i in range(16)])
  assert got.metrics["reward_term_judge_failed"] == 16 and not got.kept_R.any()
  assert 2 <= len(server.chats()) <= 2 * 2  # workers x (retries + 1)
  assert f"judge {server.url}: 16 of 16 answers got no verdict" in caplog.text
  assert "HTTP 503" in caplog.text
  state["up"] = True
  got = _score(terms, [f"b{i}" for i in range(16)])
  assert got.metrics["reward_term_judge_failed"] == 0
  np.testing.assert_allclose(got.rewards_R, 0.6, rtol=1e-6)
  server.close()  # the port now refuses connections
  got = _score(terms, ["c"])
  assert got.metrics["reward_term_judge_failed"] == 1 and not got.kept_R[0]
  terms.close()


def _dead_url() -> str:
  """A loopback URL whose port refuses connections (bound, then closed)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  return f"http://127.0.0.1:{port}"


def test_a_dead_endpoint_at_the_start_is_an_error_naming_the_url(endpoint_of):
  url = _dead_url()
  with pytest.raises(ConfigError, match=f"config.reward.terms: the judge endpoint {url} did not"):
    _terms(url)
  # a query (where keys may hide) is not shown; user info is refused, without repeating it
  with pytest.raises(ConfigError) as e:
    _terms(url + "/v1?key=s3cret")
  assert "s3cret" not in str(e.value) and f"{url}/v1 did not answer" in str(e.value)
  with pytest.raises(ConfigError, match="reward.judge_api_key_env") as e:
    _terms(url.replace("http://", "http://user:s3cret@"))
  assert "s3cret" not in str(e.value)
  server = endpoint_of(lambda p, t, r: chat("Score: 1"), model="judge-1")
  with pytest.raises(
    ConfigError, match=r"reward.judge_model: .* serves \['judge-1'\], not 'other'"
  ):
    _terms(server.url, judge_model="other")


def test_the_api_key_is_sent_and_never_logged(endpoint_of, caplog, monkeypatch):
  key = "sk-test-0123456789"
  monkeypatch.setenv("JUDGE_KEY", key)
  server = endpoint_of(lambda p, t, r: (503, b"down"))
  terms = _terms(server.url + "/v1", judge_api_key_env="JUDGE_KEY", judge_retries=0)
  got = _score(terms, ["x"])
  assert got.metrics["reward_term_judge_failed"] == 1
  assert {h["Authorization"] for _, h, _ in server.requests} == {f"Bearer {key}"}
  assert [p for p, _, _ in server.requests] == ["/v1/models", "/v1/chat/completions"]
  assert key not in caplog.text and key not in repr(terms.scorers[0].settings)
  monkeypatch.delenv("JUDGE_KEY")
  with pytest.raises(ConfigError, match="reward.judge_api_key_env: .*JUDGE_KEY is unset"):
    _terms(server.url, judge_api_key_env="JUDGE_KEY")


# -- the prompt and the config --------------------------------------------------------------------


def test_the_prompt_is_the_users_template_filled(endpoint_of, template):
  server = endpoint_of(lambda p, t, r: chat("Score: 4"))
  path = template("Q: {question}\nA: {response}\nRef: {reference}\n{min}..{max} {{x}}")
  terms = _terms(server.url, judge_template=path, judge_min=1.0, judge_max=5.0)
  got = _score(terms, ["six sevens"], ["42"])
  assert got.rewards_R[0] == pytest.approx(0.75)  # (4 - 1) / (5 - 1)
  prompt = server.chats()[0]["messages"][0]["content"]
  assert prompt == "Q: What is 6 x 7?\nA: six sevens\nRef: 42\n1..5 {x}"


@pytest.mark.parametrize(
  "text, match",
  [
    ("{question} {answer} {response}", r"fields \['answer'\] are not among"),
    ("{question} only", "never shows the judge the {response}"),
    ("{response} {", "literal braces are written"),
  ],
)
def test_a_bad_template_is_named(text, match, template):
  with pytest.raises(ConfigError, match=f"config.reward.judge_template: .*{match}"):
    _terms("http://127.0.0.1:9", judge_template=template(text))
  with pytest.raises(ConfigError, match="config.reward.judge_template: .*no-such"):
    _terms("http://127.0.0.1:9", judge_template="/no-such/template.txt")


def test_judge_terms_spec():
  from jaxrl.config import TermSpec, parse_terms

  got = parse_terms("verifier, judge:http://127.0.0.1:8000/v1*0.5")
  assert got[1] == TermSpec("judge", "http://127.0.0.1:8000/v1", 0.5) and got[1].label == "judge"
  assert parse_terms("judge:sidecar") == (TermSpec("judge", "sidecar", 1.0),)


@pytest.mark.parametrize(
  "overrides, match",
  [
    ({"terms": "judge:ftp://host"}, "expected judge:URL"),
    ({"terms": "judge:localhost:8000"}, "expected judge:URL"),
    ({"terms": "judge:http://[::1"}, "expected judge:URL"),
    ({"terms": "judge:http://a, judge:http://b"}, "the judge may appear once"),
    ({"judge_min": 5.0, "judge_max": 5.0}, "reward.judge_min"),
    ({"judge_workers": 0}, "reward.judge_workers"),
    ({"judge_timeout": 0.0}, "reward.judge_timeout"),
    ({"judge_api_key_env": "sk-abc-123"}, "reward.judge_api_key_env"),
    ({"fn_time_limit": math.inf}, "reward.fn_time_limit"),
  ],
)
def test_bad_judge_settings_are_named(overrides, match):
  cd = default_configdict()
  for k, v in overrides.items():
    setattr(cd.reward, k, v)
  with pytest.raises(ConfigError, match=match):
    from_configdict(cd)


def test_judge_sidecar_needs_its_model_before_the_run():
  from jaxrl.tasks.task import check_inputs

  cd = default_configdict()
  cd.reward.terms = "verifier, judge:sidecar*0.5"
  with pytest.raises(ConfigError, match="config.reward.judge_model: judge:sidecar serves"):
    check_inputs(task_sections(from_configdict(cd)))


def test_a_run_trains_on_the_judges_verdicts_and_stops_its_threads(tmp_path, endpoint_of):
  """One RL step of a run with the verifier and a judge that gives every answer 10 of 10: the
  step's reward is the verifier's plus half a point, the judge's metrics are in the row, and the
  trainer's close stops the judge's threads. A dead judge URL stops the start, naming it, and
  leaves the run directory free."""
  from run_helpers import read_metrics, tiny_config

  from jaxrl.run.train import Trainer

  server = endpoint_of(lambda p, t, r: chat("Fine.\nScore: 10"))
  cfg = tiny_config("test", steps=1, **{"reward.terms": f"verifier, judge:{server.url}*0.5"})
  with Trainer.open(cfg, str(tmp_path)) as trainer:
    judge = trainer.reward_terms.scorers[1]
    trainer.rl(trainer.init_params())
  assert judge._pool._shutdown  # closed with the trainer
  (row,) = read_metrics(tmp_path)
  assert row["reward_term_judge"] == 1.0 and row["reward_term_judge_applies"] == 1.0
  assert row["reward_term_judge_failed"] == 0
  assert row["reward"] == pytest.approx(row["reward_term_verifier"] + 0.5, rel=1e-6)
  assert len(server.chats()) >= cfg.num_rollouts  # an answer, a request
  url = _dead_url()
  dead = tiny_config("test", steps=1, **{"reward.terms": f"judge:{url}"})
  with pytest.raises(ConfigError, match=f"the judge endpoint {url} did not answer"):
    Trainer.open(dead, str(tmp_path / "dead"))
  Trainer.open(tiny_config("test"), str(tmp_path / "dead")).close()  # the directory's lock is free
