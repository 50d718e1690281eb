"""HTTP client for vLLM servers: token-id completions and the file-based weight update.

Stdlib only (urllib + a thread pool): one request per question with ``n = G_i``, spread round-robin
over the servers, each with a timeout and bounded retries. Log-probs are those of the sampled tokens
at the request's temperature (the server runs with ``--logprobs-mode processed_logprobs``). The
timeout bounds one whole request (responses are not streamed): it must exceed the slowest rollout
batch, or a busy server counts as hung.

Servers are named by ``http://`` URLs or, for a server on a Unix socket (a launched sidecar),
``http+unix://`` URLs (``unix_http.unix_url``).

Failures: a connection refused or reset, a timeout or an HTTP 5xx is retried and then raised as
``ServerError`` (the server is down or hung: the engine restarts it), for every request, the GETs
(``/v1/models``, ``/weight_info``) as the POSTs; an HTTP 4xx is raised at once as ``RequestError``
(the request itself is wrong: a restart would not help). An answer that cannot be right
(``vllm_api.check_completion``) is ``SidecarError``. For tests, ``VllmClient.on_requests_sent`` is a
one-shot hook that fires while a rollout's requests are in flight: deterministic fault injection
(e.g. SIGKILL the server at that moment).

Weight update without NCCL (works on CPU and GPU): the trainer writes
an HF-layout directory, then per server: pause (finish in-flight requests) → ``reload_weights``
from that directory → reset the prefix cache (cached KV of the old weights) → set the weight
version → resume → read the version back (``GET /weight_info``). Versions are ints; the server
stores a string, so they are converted in ``vllm_api`` and nowhere else (``version_label``,
``parse_version``). A LoRA adapter is loaded under
its name the same way, and then the path the server lists for that name (``GET /v1/models``:
``root`` of each adapter) must be the directory just written: a server that already held an
adapter of that name (refusing the load as "already loaded") would otherwise serve the old one.

The request and answer shapes, the version labels and the error classes are ``vllm_api``'s; so is
the NCCL path's protocol, which is not built.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable

from jaxrl.rollout.sidecar import SidecarError
from jaxrl.rollout.unix_http import urlopen
from jaxrl.rollout.vllm_api import (
  Completion,
  RequestError,
  ServerError,
  check_completion,
  completion_payload,
  parse_version,
  same_path,
  version_label,
)

log = logging.getLogger(__name__)


def _then(data: bytes, sent: Callable[[], None]) -> Iterable[bytes]:
  """``data`` as a request body that calls ``sent()`` once http.client has written all of it."""
  yield data
  sent()


def _call(
  method: str,
  url: str,
  payload: dict | None,
  timeout: float,
  sent: Callable[[], None] | None = None,
  parse: bool = True,
):
  """``sent``: called once the request has been written, before its answer is awaited;
  ``parse``: the answer is JSON (else it is returned as text)."""
  data = None if payload is None else json.dumps(payload).encode()
  headers = {"Content-Type": "application/json"} if method == "POST" else {}
  if sent is not None and data is not None:
    headers["Content-Length"] = str(len(data))  # an iterable body would be sent chunked otherwise
    data = _then(data, sent)
  req = urllib.request.Request(url, data=data, method=method, headers=headers)
  with urlopen(req, timeout=timeout) as r:
    body = r.read()
  if not parse:  # the LoRA endpoints answer "Success: ..." as plain text
    return body.decode(errors="replace")
  return json.loads(body) if body.strip() else None


class _Countdown:
  """``done`` is set once every key has been marked (repeated marks count once)."""

  def __init__(self, keys):
    self._left, self._lock, self.done = set(keys), threading.Lock(), threading.Event()
    if not self._left:
      self.done.set()

  def mark(self, key) -> None:
    with self._lock:
      self._left.discard(key)
      if not self._left:
        self.done.set()


class VllmClient:
  def __init__(
    self, urls: list[str], *, timeout: float = 120.0, retries: int = 2, max_concurrency: int = 256
  ):
    if not urls:
      raise ValueError("VllmClient needs at least one server URL")
    self.urls = [u.rstrip("/") for u in urls]
    self.timeout, self.retries = timeout, retries
    # One thread per in-flight question: fewer threads would cap the server's batch.
    self._pool = cf.ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm-client")
    self._closed = False
    # Deterministic fault injection, for tests: a test sets this (e.g. to SIGKILL the server) to
    # act at the one moment a crash test needs, while a rollout's requests are in flight, instead
    # of racing the server with a polling thread. One-shot: the next ``complete`` with at least one
    # request clears it, then calls it from the caller's thread once every request has been written
    # to its server (or has already failed), before any result is collected; so the rollout's
    # retry (after the engine's restart) runs unharmed. None (the default) costs nothing. With more
    # questions than ``max_concurrency``, the last requests are sent only as earlier ones finish.
    self.on_requests_sent: Callable[[], None] | None = None

  def close(self) -> None:
    """Cancel queued requests; running ones stop retrying (the server may be replaced)."""
    self._closed = True
    self._pool.shutdown(wait=False, cancel_futures=True)

  def post(
    self,
    url: str,
    path: str,
    payload: dict | None = None,
    timeout: float | None = None,
    *,
    sent: Callable[[], None] | None = None,
    parse: bool = True,
  ):
    """POST with bounded retries; the error names the endpoint and the last failure. ``sent``,
    ``parse``: see ``_call`` (``sent`` is called at each attempt that gets its request written)."""
    return self._request("POST", url, path, payload, timeout, sent, parse)

  def get(self, url: str, path: str):
    """GET a JSON answer, with the retries and error classes of ``post``."""
    return self._request("GET", url, path, None, None, None, True)

  def _request(self, method, url, path, payload, timeout, sent, parse):
    last = None
    for attempt in range(self.retries + 1):
      try:
        return _call(
          method, f"{url}{path}", payload, self.timeout if timeout is None else timeout, sent, parse
        )
      except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        if e.code < 500:
          raise RequestError(f"{url}{path}: HTTP {e.code}: {detail}", e.code) from None
        last = f"HTTP {e.code}: {detail}"
      # OSError: refused, reset, timed out; HTTPException and ValueError: a truncated answer.
      except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
        last = repr(e)
      if attempt < self.retries and not self._closed:
        log.warning("%s%s failed (%s); retry %d/%d", url, path, last, attempt + 1, self.retries)
        time.sleep(min(0.5 * 2**attempt, 4.0))
      else:
        break
    raise ServerError(f"{url}{path} failed after {attempt + 1} attempt(s): {last}")

  # -- rollouts ------------------------------------------------------------------------------------

  def complete(
    self,
    prompts: list[list[int]],
    counts: list[int],
    *,
    temperature: float,
    max_tokens: int,
    stop_token_ids: list[int],
    seed: int,
    top_p: float = 1.0,
    model: str | None = None,
    vocab_size: int | None = None,
    stop: tuple[str, ...] = (),
  ) -> list[list[Completion]]:
    """``counts[i]`` completions of each token-id prompt (questions with 0 are skipped), in order;
    request i has seed ``seed + i``; ``stop``: stop strings (``completion_payload``).

    ``temperature = 0`` is greedy: vLLM then accepts only ``n = 1``, and the one answer stands for
    all ``counts[i]`` rows. ``vocab_size``: token ids must lie below it (None: not checked).
    """
    greedy = float(temperature) == 0.0

    # Runs on a pool thread: the request is built there too, so a bad argument fails that question's
    # future (and is raised by ``_gather`` in question order) like a failed request.
    def one(i: int, sent: Callable[[], None] | None = None) -> list[Completion]:
      n = 1 if greedy else int(counts[i])
      payload = completion_payload(
        prompts[i], n, temperature, top_p, max_tokens, stop_token_ids, int(seed) + i, model, stop
      )
      done = self._send(self.urls[i % len(self.urls)], payload, sent, vocab_size)
      return done * int(counts[i]) if greedy else done

    wanted = [i for i in range(len(prompts)) if counts[i] > 0]
    return self._gather(one, wanted, len(prompts))

  def _send(
    self, url: str, payload: dict, sent: Callable[[], None] | None, vocab_size: int | None
  ) -> list[Completion]:
    """POST one completion request; its ``payload["n"]`` choices, in vLLM's index order."""
    n = payload["n"]
    body = self.post(url, "/v1/completions", payload, sent=sent)
    try:
      choices = sorted(body["choices"], key=lambda c: c["index"])
      out = [
        Completion(
          [int(t) for t in c["token_ids"]],
          [float(x) for x in c["logprobs"]["token_logprobs"]],
          c.get("finish_reason") or "length",
        )
        for c in choices
      ]
    except (KeyError, TypeError, ValueError) as e:
      raise SidecarError(f"{url}: a malformed /v1/completions answer ({e!r})") from None
    if len(out) != n:
      raise ServerError(f"{url}: asked for n={n} completions, got {len(out)}")
    for c in out:
      check_completion(url, c, vocab_size)
    return out

  def _gather(
    self, one: Callable[..., list[Completion]], wanted: list[int], size: int
  ) -> list[list[Completion]]:
    """``one(i)`` for every wanted question on the pool; the results of questions 0..size-1 in order
    ([] for those not wanted). Fires ``on_requests_sent`` (one-shot) once every request has been
    written or has failed; on any error, cancels the requests not yet done."""
    hook = self.on_requests_sent if wanted else None
    if hook is None:
      futures = {i: self._pool.submit(one, i) for i in wanted}
    else:
      self.on_requests_sent = None  # one-shot
      in_flight = _Countdown(wanted)
      futures = {i: self._pool.submit(one, i, functools.partial(in_flight.mark, i)) for i in wanted}
      for i, f in futures.items():  # a request that failed (or was cancelled) unsent counts too
        f.add_done_callback(lambda _, i=i: in_flight.mark(i))
    try:
      if hook is not None:
        in_flight.done.wait()
        hook()
      return [futures[i].result() if i in futures else [] for i in range(size)]
    except BaseException:
      for f in futures.values():  # the rollout is lost: do not keep a failing server busy
        f.cancel()
      raise

  # -- weights -------------------------------------------------------------------------------------

  def served(self, url: str) -> dict[str, str | None]:
    """What the server serves: model name → its path (``root``; an adapter's ``lora_path``)."""
    body = self.get(url, "/v1/models")
    try:
      return {m["id"]: m.get("root") for m in body["data"]}
    except (KeyError, TypeError) as e:
      raise ServerError(f"{url}/v1/models: an unexpected answer ({e!r}): {body!r:.300}") from None

  def models(self, url: str) -> list[str]:
    return list(self.served(url))

  def weight_version(self, url: str) -> int | None:
    """The version the server reports (None until one is set)."""
    body = self.get(url, "/weight_info")
    try:
      label = body["weight_version"]
    except (KeyError, TypeError) as e:
      raise ServerError(f"{url}/weight_info: an unexpected answer ({e!r}): {body!r:.300}") from None
    return parse_version(url, label)

  def _verify(self, url: str, version: int) -> None:
    got = self.weight_version(url)
    if got != version:
      raise ServerError(
        f"{url}: after the weight update the server reports version {got!r}, expected {version!r}"
      )

  def set_version(self, version: int) -> None:
    """Label the weights every server holds (after a start on a weights directory) and verify."""
    label = version_label(version)

    def one(url: str) -> None:
      self.post(url, "/update_weight_version", {"new_version": label})
      self._verify(url, version)

    list(self._pool.map(one, self.urls))

  def load_adapter(self, name: str, adapter_dir: str, version: int, drop: str | None) -> None:
    """Every server: pause → load the PEFT adapter ``adapter_dir`` as ``name`` → reset the
    prefix cache → set version → resume → unload ``drop`` (the previous adapter, if any).

    Paused, so no request runs across the swap (its tokens would mix two policies); the prefix
    cache is reset and every version has a new directory and name, since vLLM keys cached blocks
    by (name, path) and a reload in place would serve stale blocks."""
    label = version_label(version)

    def one(url: str) -> None:
      self.post(url, "/pause?mode=wait", None)
      try:
        adapter = {"lora_name": name, "lora_path": adapter_dir}
        loaded = lambda: same_path(self.served(url).get(name), adapter_dir)  # noqa: E731
        try:
          self._idempotent(url, "/v1/load_lora_adapter", adapter, loaded)
        except RequestError as e:
          self._check_adapter(url, name, adapter_dir, loaded=False)  # a leftover: say so
          raise e from None
        self._check_adapter(url, name, adapter_dir, loaded=True)
        self.post(url, "/reset_prefix_cache", None)
        self.post(url, "/update_weight_version", {"new_version": label})
      finally:
        self.post(url, "/resume", None)
      self._verify(url, version)
      if drop is not None and drop in self.models(url):
        dropped = lambda: drop not in self.models(url)  # noqa: E731
        self._idempotent(url, "/v1/unload_lora_adapter", {"lora_name": drop}, dropped)
      log.info("%s serves %s", url, ", ".join(self.models(url)))  # the base and `name` alone

    list(self._pool.map(one, self.urls))

  def _check_adapter(self, url: str, name: str, adapter_dir: str, *, loaded: bool) -> None:
    """The server serves ``name`` from ``adapter_dir`` (``loaded``: after a load that went
    through), or does not serve it at all (after a refused load)."""
    served = self.served(url).get(name)
    if served is None and not loaded:
      return
    if not same_path(served, adapter_dir):
      raise SidecarError(
        f"{url} serves the LoRA adapter {name!r} from {served}, not from {adapter_dir} just "
        "written: another run's (or an earlier one's) adapter holds that name on this server"
        if served is not None
        else f"{url} accepted the LoRA adapter {name!r} ({adapter_dir}) but does not list it"
      )

  def _idempotent(self, url: str, path: str, payload: dict, done: Callable[[], bool]) -> None:
    """A LoRA load or unload: ``post`` retries a timed-out attempt, and when the first went
    through the retry is refused ("already loaded", "not found"); ``done()`` tells that apart
    from a real refusal. A server without runtime LoRA (404) gets an error that says so."""
    try:
      self.post(url, path, payload, parse=False)
    except RequestError as e:
      if e.status == 404:
        raise RequestError(
          f"{url} does not serve runtime LoRA ({e}): start it with --enable-lora "
          "--max-lora-rank >= model.lora.rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, "
          "or set vllm.lora_sync=merged",
          e.status,
        ) from None
      if not done():
        raise

  def load_weights(self, weights_dir: str, version: int) -> None:
    """Every server: pause → reload_weights(dir) → reset prefix cache → set version → resume."""
    label = version_label(version)

    def one(url: str) -> None:
      self.post(url, "/pause?mode=wait", None)
      try:
        self.post(
          url,
          "/collective_rpc",
          {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
          timeout=max(self.timeout, 600.0),
        )
        self.post(url, "/reset_prefix_cache", None)
        self.post(url, "/update_weight_version", {"new_version": label})
      finally:
        self.post(url, "/resume", None)
      self._verify(url, version)

    list(self._pool.map(one, self.urls))
