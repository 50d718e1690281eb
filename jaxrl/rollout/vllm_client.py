"""HTTP client for vLLM servers: token-id completions and the file-based weight update.

Stdlib only (urllib + a thread pool): one request per question with ``n = G_i``, spread round-robin
over the servers, each with a timeout and bounded retries. Log-probs are those of the sampled tokens
at the request's temperature (the server runs with ``--logprobs-mode processed_logprobs``).

Weight update without NCCL (works on CPU and GPU; ../shared/spec/SIDECAR.md): the trainer writes an
HF-layout directory, then per server: pause (finish in-flight requests) → ``reload_weights`` from that
directory → reset the prefix cache (cached KV of the old weights) → set the weight version → resume.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
  """A request failed after its retries (the server is down, hung, or answered an error)."""


@dataclasses.dataclass(frozen=True)
class Completion:
  """One sampled response."""
  token_ids: list[int]
  logprobs: list[float]             # log p(token) at τ for each sampled token
  finish_reason: str                # "stop" (EOS / stop token) or "length"


def _post(url: str, payload: dict | None, timeout: float):
  data = None if payload is None else json.dumps(payload).encode()
  req = urllib.request.Request(url, data=data, method="POST",
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=timeout) as r:
    body = r.read()
  return json.loads(body) if body.strip() else None


class VllmClient:
  def __init__(self, urls: list[str], *, timeout: float = 120.0, retries: int = 2,
               max_concurrency: int = 32):
    if not urls:
      raise ValueError("VllmClient needs at least one server URL")
    self.urls = [u.rstrip("/") for u in urls]
    self.timeout, self.retries = timeout, retries
    self._pool = cf.ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm-client")

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  def post(self, url: str, path: str, payload: dict | None = None, timeout: float | None = None):
    """POST with bounded retries; ServerError names the endpoint and the last failure."""
    last = None
    for attempt in range(self.retries + 1):
      try:
        return _post(f"{url}{path}", payload, self.timeout if timeout is None else timeout)
      except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        if e.code < 500:  # a bad request will not get better by retrying
          raise ServerError(f"{url}{path}: HTTP {e.code}: {detail}") from None
        last = f"HTTP {e.code}: {detail}"
      except (urllib.error.URLError, OSError, TimeoutError) as e:
        last = repr(e)
      if attempt < self.retries:
        log.warning("%s%s failed (%s); retry %d/%d", url, path, last, attempt + 1, self.retries)
        time.sleep(min(0.5 * 2 ** attempt, 4.0))
    raise ServerError(f"{url}{path} failed after {self.retries + 1} attempts: {last}")

  # -- rollouts ------------------------------------------------------------------------------------

  def complete(self, prompts: list[list[int]], counts: list[int], *, temperature: float,
               max_tokens: int, stop_token_ids: list[int], seed: int, top_p: float = 1.0,
               model: str | None = None) -> list[list[Completion]]:
    """``counts[i]`` completions of each token-id prompt (questions with 0 are skipped), in order."""
    def one(i: int) -> list[Completion]:
      if counts[i] == 0:
        return []
      payload = {"prompt": prompts[i], "n": int(counts[i]), "temperature": float(temperature),
                 "top_p": float(top_p), "max_tokens": int(max_tokens),
                 "stop_token_ids": list(stop_token_ids), "seed": int(seed) + i, "logprobs": 0,
                 "return_token_ids": True, "skip_special_tokens": False}
      if model:
        payload["model"] = model
      url = self.urls[i % len(self.urls)]
      body = self.post(url, "/v1/completions", payload)
      choices = sorted(body["choices"], key=lambda c: c["index"])
      if len(choices) != counts[i]:
        raise ServerError(f"{url}: asked for n={counts[i]} completions, got {len(choices)}")
      return [Completion(list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]],
                         c.get("finish_reason") or "length") for c in choices]

    return list(self._pool.map(one, range(len(prompts))))

  # -- weights -------------------------------------------------------------------------------------

  def models(self, url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=self.timeout) as r:
      return [m["id"] for m in json.loads(r.read())["data"]]

  def weight_version(self, url: str) -> str | None:
    with urllib.request.urlopen(f"{url}/weight_info", timeout=self.timeout) as r:
      return json.loads(r.read())["weight_version"]

  def load_weights(self, weights_dir: str, version: str) -> None:
    """Every server: pause → reload_weights(dir) → reset prefix cache → set version → resume."""
    def one(url: str) -> None:
      self.post(url, "/pause?mode=wait", None)
      try:
        self.post(url, "/collective_rpc",
                  {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
                  timeout=max(self.timeout, 600.0))
        self.post(url, "/reset_prefix_cache", None)
        self.post(url, "/update_weight_version", {"new_version": version})
      finally:
        self.post(url, "/resume", None)
      got = self.weight_version(url)
      if got != version:
        raise ServerError(f"{url}: after the weight update the server reports version {got!r}, "
                          f"expected {version!r}")

    list(self._pool.map(one, self.urls))
