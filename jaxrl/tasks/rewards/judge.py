"""A generative judge as a reward term (``judge:URL`` or ``judge:sidecar``, docs/rewards.md).

Each answer becomes one chat request to an OpenAI-compatible ``/v1/chat/completions`` endpoint: a
prompt from a template (the question, the response, the reference answer, the scale), sent by
``reward.judge_workers`` threads at once. The score is read from the reply by one stated rule
(``parse_score``) and mapped to [0, 1] on the judge's scale.

A verdict that cannot be had is None, never 0: the term does not apply to that answer
(``combine_terms``: the other terms score it; with the judge alone the answer is set aside) and it
is counted (``failed``, the step's ``reward_term_judge_failed``). Causes: the request failed after
its retries (refused connection, time-out, HTTP 429 or 5xx, each retried with doubling backoff),
the endpoint refused the request (another 4xx: not retried, the same request fails again), the
reply was too long (``MAX_REPLY_BYTES``), not a chat completion, had no score, or a score off the
scale. A request that fails at the transport after its retries marks the endpoint down for the rest
of the batch: the answers not yet sent fail at once, so a dead endpoint costs about one request's
retries per worker per batch (logged, with the URL), and the next batch tries again.

Only the URL the user gave is contacted (or the run's own sidecar, on a Unix socket). The API key
comes from the environment variable ``reward.judge_api_key_env`` names; it is sent as a Bearer
header and never logged, and logged URLs drop their user info and query.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import logging
import math
import os
import re
import string
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import numpy as np

from jaxrl.fields import ConfigError

log = logging.getLogger(__name__)

# A verdict is a short text; a reply beyond this is refused unread (a runaway or hostile endpoint
# must not fill the trainer's memory). 256 KiB is ~500x a reply of judge_max_tokens = 512.
MAX_REPLY_BYTES = 256 * 1024
_READ_CHUNK = 64 * 1024
FIELDS = ("question", "response", "reference", "min", "max")

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
# The last match in the reply wins: a judge that reasons first states its verdict at the end.
PARSE_RULES = {
  # "Score: 7", "**Score:** 7/10", "score = 7"; not "Score (0-10): 7" (its first number is no score)
  "score": re.compile(rf"(?i)\bscore\b[\s*_]*[:=][\s*_]*({_NUMBER})"),
  "boxed": re.compile(rf"\\boxed\{{\s*({_NUMBER})\s*\}}"),  # \boxed{7}
  "last-number": re.compile(_NUMBER),
}
_ASK = {
  "score": 'End your reply with a line "Score: N"',
  "boxed": "End your reply with the score as \\boxed{{N}}",
  "last-number": "End your reply with the score N; write no number after it",
}
_DEFAULT = """You are grading a response to a question. Judge whether the response answers the \
question correctly, comparing it with the reference answer.

Question:
{{question}}

Reference answer:
{{reference}}

Response:
{{response}}

Explain your judgement briefly. {ask}, where N is a number from {{min}} (wrong, or no answer) to \
{{max}} (correct and well argued)."""


def default_template(rule: str) -> str:
  """The built-in prompt, its closing instruction the one ``rule`` reads."""
  return _DEFAULT.format(ask=_ASK[rule])


def template_fields(template: str) -> set[str]:
  """The ``{field}`` names a template uses (ValueError for a malformed brace)."""
  return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def read_template(path: str) -> str:
  """``reward.judge_template``: the file's text, its fields among ``FIELDS`` and ``{response}``
  among them; a ConfigError naming the field otherwise."""
  field = "reward.judge_template"
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(field, f"{path}: {e}") from None
  try:
    names = template_fields(text)
    unknown = sorted(n for n in names if n not in FIELDS)
    if not unknown:  # a format spec or conversion fails here, not at the first batch
      text.format(**{name: "0" for name in FIELDS})
  except (ValueError, IndexError, AttributeError) as e:
    raise ConfigError(field, f"{path}: {e} (literal braces are written {{{{ and }}}})") from None
  if unknown:
    raise ConfigError(field, f"{path}: fields {unknown} are not among {list(FIELDS)}")
  if "response" not in names:
    raise ConfigError(field, f"{path}: the template never shows the judge the {{response}}")
  return text


def parse_score(reply: str, rule: str, low: float, high: float) -> tuple[float | None, str]:
  """(the score mapped to [0, 1] on [low, high], "") or (None, why). A reasoning model's thoughts
  (up to its last ``</think>``) are not read."""
  text = reply.rpartition("</think>")[2]
  found = PARSE_RULES[rule].findall(text)
  if not found:
    return None, f"no score ({rule} rule) in the reply {text[-80:]!r}"
  score = float(found[-1])
  if not low <= score <= high:
    return None, f"score {score:g} is off the scale [{low:g}, {high:g}]"
  return (score - low) / (high - low), ""


def shown(url: str) -> str:
  """``url`` fit for a log: no user info, query or fragment (where keys may hide)."""
  u = urllib.parse.urlsplit(url)
  host = u.netloc.rpartition("@")[2]
  return urllib.parse.urlunsplit((u.scheme, host, u.path, "", ""))


def at(url: str, path: str) -> str:
  """``path`` (``/v1/...``) on the server at ``url``, whose root is its path without a trailing
  ``/v1``; a query is kept (some gateways take an API version there)."""
  u = urllib.parse.urlsplit(url)
  root = u.path.rstrip("/")
  root = root[: -len("/v1")] if root.endswith("/v1") else root
  return urllib.parse.urlunsplit((u.scheme, u.netloc, root + path, u.query, ""))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
  """A redirect is an error (HTTP 3xx, refused): requests, and the API key, go to the given URL
  only."""

  def redirect_request(self, *args, **kwargs):
    return None


_OPENER = urllib.request.build_opener(_NoRedirect())


def open_url(request, timeout: float):
  """An http(s) request, redirects refused."""
  return _OPENER.open(request, timeout=timeout)


class Transient(Exception):
  """A request that may succeed if sent again (connection, time-out, HTTP 429 or 5xx)."""


class Refused(Exception):
  """A request or reply that another try would not fix."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """Where the judge answers: a base URL, the model name requests carry, and how to open a URL
  (the sidecar's opener for its ``http+unix`` URL). For a server the run started, ``revive``
  restarts it if it has died (its new URL, or None) before each batch, and ``close`` stops it."""

  url: str
  model: str = ""
  opener: Callable = open_url
  close: Callable[[], None] = lambda: None
  revive: Callable[[], str | None] = lambda: None


def _read(response, deadline: float) -> bytes:
  """The body, refused past ``MAX_REPLY_BYTES`` or past the request's deadline: each read waits
  at most the socket's time-out, so a request ends within about twice ``judge_timeout`` even when
  the server drips its reply."""
  chunks, size = [], 0
  while chunk := response.read(_READ_CHUNK):
    size += len(chunk)
    if size > MAX_REPLY_BYTES:
      raise Refused(f"reply longer than {MAX_REPLY_BYTES} bytes")
    if time.monotonic() > deadline:
      raise Transient("timed out reading the reply")
    chunks.append(chunk)
  return b"".join(chunks)


def request_json(endpoint: Endpoint, path: str, body, headers: dict, timeout: float):
  """The JSON answer of one request (GET without ``body``); ``Transient`` or ``Refused``."""
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(at(endpoint.url, path), data=data, headers=headers)
  deadline = time.monotonic() + timeout
  try:
    with endpoint.opener(req, timeout=timeout) as r:
      raw = _read(r, deadline)
  except urllib.error.HTTPError as e:
    kind = Transient if e.code == 429 or e.code >= 500 else Refused
    raise kind(f"HTTP {e.code} {e.reason}") from None
  except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
    raise Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
  try:
    return json.loads(raw)
  except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
    raise Refused(f"reply is not JSON: {raw[:80]!r}") from None


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
  template: str  # with the FIELDS
  rule: str  # a key of PARSE_RULES
  low: float
  high: float
  workers: int
  timeout: float
  retries: int
  backoff: float
  max_tokens: int
  temperature: float
  api_key: str = dataclasses.field(default="", repr=False)  # never printed

  @classmethod
  def from_config(cls, r) -> JudgeSettings:
    """From the ``reward`` section: the template read, the key taken from its variable."""
    key = ""
    if r.judge_api_key_env:
      key = os.environ.get(r.judge_api_key_env, "")
      if not key:
        raise ConfigError(
          "reward.judge_api_key_env", f"the environment variable {r.judge_api_key_env} is unset"
        )
    template = read_template(r.judge_template) if r.judge_template else None
    return cls(
      template or default_template(r.judge_parse),
      r.judge_parse,
      r.judge_min,
      r.judge_max,
      r.judge_workers,
      r.judge_timeout,
      r.judge_retries,
      r.judge_backoff,
      r.judge_max_tokens,
      r.judge_temperature,
      key,
    )

  def headers(self) -> dict:
    h = {"Content-Type": "application/json"}
    return {**h, "Authorization": f"Bearer {self.api_key}"} if self.api_key else h


def served_model(endpoint: Endpoint, settings: JudgeSettings) -> str:
  """The model requests name, checked against the endpoint's ``GET /v1/models`` at the start: a
  dead endpoint or an unknown model is a ConfigError naming the URL."""
  what = f"the judge endpoint {shown(endpoint.url)}"
  try:
    listed = request_json(endpoint, "/v1/models", None, settings.headers(), settings.timeout)
    ids = [m["id"] for m in listed["data"]]
  except (Transient, Refused) as e:
    raise ConfigError("reward.terms", f"{what} did not answer GET /v1/models: {e}") from None
  except (KeyError, TypeError):
    raise ConfigError("reward.terms", f"{what}: GET /v1/models is not a model list") from None
  if endpoint.model:
    if endpoint.model not in ids:
      raise ConfigError("reward.judge_model", f"{what} serves {ids}, not {endpoint.model!r}")
    return endpoint.model
  if len(ids) != 1:
    raise ConfigError("reward.judge_model", f"{what} serves {ids}: name one")
  return ids[0]


class JudgeTerm:
  """The judge's verdicts on a batch (f32[R], NaN: no verdict); ``failed``: the last batch's
  answers without one. ``active`` False (processes other than the first of a multi-process run,
  whose rewards are process 0's) sends nothing and fails nothing."""

  def __init__(self, endpoint: Endpoint, settings: JudgeSettings, active: bool = True):
    self.endpoint, self.settings, self.active = endpoint, settings, active
    self.model = served_model(endpoint, settings) if active else ""
    self.failed = 0
    self._pool = concurrent.futures.ThreadPoolExecutor(settings.workers, "jaxrl-judge")

  def prompt(self, question: str, response: str, reference: str) -> str:
    s = self.settings
    return s.template.format(
      question=question, response=response, reference=reference, min=f"{s.low:g}", max=f"{s.high:g}"
    )

  def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> np.ndarray:
    if not self.active:
      self.failed = 0
      return np.full(len(completions), np.nan, np.float32)
    if url := self.endpoint.revive():  # the run's own server, restarted on a new socket
      self.endpoint = dataclasses.replace(self.endpoint, url=url)
    down = threading.Event()  # set once a request fails at the transport after its retries
    jobs = [self.prompt(*qra) for qra in zip(prompts, completions, answers)]
    verdicts = list(self._pool.map(lambda p: self._verdict(p, down), jobs))
    values = np.array([math.nan if v is None else v for v, _ in verdicts], np.float32)
    reasons = [why for v, why in verdicts if v is None]
    self.failed = len(reasons)
    if reasons:
      log.warning(
        "judge %s: %d of %d answers got no verdict (not scored by the judge); first: %s",
        shown(self.endpoint.url),
        len(reasons),
        len(jobs),
        reasons[0],
      )
    return values

  def _verdict(self, prompt: str, down: threading.Event) -> tuple[float | None, str]:
    """(score in [0, 1], "") or (None, why), after up to ``retries`` retries of a transient
    failure; skipped at once while the endpoint is down."""
    s = self.settings
    if down.is_set():
      return None, "skipped: the endpoint failed earlier in this batch"
    body = {
      "model": self.model,
      "messages": [{"role": "user", "content": prompt}],
      "max_tokens": s.max_tokens,
      "temperature": s.temperature,
    }
    for attempt in range(s.retries + 1):
      if attempt:
        time.sleep(s.backoff * 2 ** (attempt - 1))
      try:
        reply = request_json(self.endpoint, "/v1/chat/completions", body, s.headers(), s.timeout)
        return self.read_reply(reply)
      except Refused as e:
        return None, str(e)
      except Transient as e:
        why = f"{e} (after {attempt + 1} tries)"
    down.set()
    return None, why

  def read_reply(self, reply) -> tuple[float | None, str]:
    """A chat completion's score (``parse_score``), or (None, why) for any other shape."""
    try:
      content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
      return None, f"not a chat completion: {str(reply)[:80]!r}"
    if not isinstance(content, str):
      return None, f"the reply's content is {type(content).__name__}, not text"
    return parse_score(content, self.settings.rule, self.settings.low, self.settings.high)

  def close(self) -> None:
    """Stop the threads (their requests end within their time limits) and the run's server."""
    self._pool.shutdown(wait=True, cancel_futures=True)
    self.endpoint.close()
