"""vLLM's HTTP API as jaxrl speaks it: a completion request's body (``completion_payload``), the
answer's shape (``Completion``) and the checks it must pass (``check_completion``), the weight
version's label (an int here, a string on the server), and the two errors a request ends in
(``ServerError``: retried, then the server restarted; ``RequestError``: the request itself is
wrong). ``vllm_client`` sends them.

An answer that cannot be right is ``SidecarError``, naming the server: a token id outside
``[0, vocab_size)`` (JAX would clamp it without a word), a log-prob that is not finite or above
``LOGP_SLACK``, as many log-probs as token ids or not.

The NCCL path (GPU only; ``vllm.weight_transfer = "nccl"``, not built: the config refuses it) would
be: server started with ``--weight-transfer-config '{"backend":"nccl"}'``; once,
``POST /init_weight_transfer_engine`` with the rendezvous (``nccl_unique_id_b64``: a torch-free
handshake, so the JAX trainer can join the NCCL group as rank 0); per push, ``POST /pause`` →
``/start_weight_update`` → ``/update_weights {names, dtype_names, shapes}`` while the trainer
broadcasts each tensor in that order from device memory → ``/finish_weight_update
{weight_version}`` → ``/resume``. The CPU build has no accelerator for it ("Cannot access
accelerator device").
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from jaxrl.rollout.sidecar import SidecarError

# The largest log-prob accepted for a sampled token: 0 up to float32 rounding of log_softmax.
LOGP_SLACK = 1e-4

# What vLLM reports before any version is set.
_UNSET_VERSION = "default"


def version_label(version: int) -> str:
  """The server's label of weight version ``version``: its API takes a string, jaxrl's are ints."""
  if isinstance(version, bool) or not isinstance(version, int):
    raise TypeError(f"a weight version is an int, not {type(version).__name__} {version!r}")
  return str(version)


def parse_version(url: str, label) -> int | None:
  """The int weight version of a label the server reports (None: none set yet)."""
  if label is None or label == _UNSET_VERSION:
    return None
  if not (isinstance(label, str) and re.fullmatch(r"-?[0-9]+", label)):
    raise ServerError(
      f"{url}/weight_info: the server reports weight version {label!r}, not an int (this client "
      "labels every version it loads with an int): did another client set it?"
    )
  return int(label)


class ServerError(RuntimeError):
  """A request failed after its retries (the server is down, hung, or answered an error)."""


class RequestError(RuntimeError):
  """The server rejected a request (HTTP 4xx): retrying or restarting the server cannot help."""

  def __init__(self, message: str, status: int | None = None):
    super().__init__(message)
    self.status = status  # the HTTP status code


@dataclasses.dataclass(frozen=True)
class Completion:
  """One sampled response."""

  token_ids: list[int]
  logprobs: list[float]  # log p(token) at τ for each sampled token
  finish_reason: str  # "stop" (EOS / stop token) or "length"


def completion_payload(
  prompt: list[int],
  n: int,
  temperature: float,
  top_p: float,
  max_tokens: int,
  stop_token_ids: list[int],
  seed: int,
  model: str | None,
  stop: tuple[str, ...] = (),
) -> dict:
  """The ``/v1/completions`` body of one question: token ids in and out, the log-prob of each
  sampled token (``logprobs: 0``: no alternatives), special tokens not stripped. ``stop``: texts
  that also end the response, kept in it (the stop's ids are sampled tokens)."""
  payload = {
    "prompt": prompt,
    "n": n,
    "temperature": float(temperature),
    "top_p": float(top_p),
    "max_tokens": int(max_tokens),
    "stop_token_ids": list(stop_token_ids),
    "seed": seed,
    "logprobs": 0,
    "return_token_ids": True,
    "skip_special_tokens": False,
  }
  if stop:
    payload["stop"] = list(stop)
    payload["include_stop_str_in_output"] = True
  if model:
    payload["model"] = model
  return payload


def check_completion(url: str, c: Completion, vocab_size: int | None) -> None:
  """Refuse a completion that cannot be right: out-of-vocabulary ids, impossible log-probs."""
  if len(c.token_ids) != len(c.logprobs):
    raise SidecarError(
      f"{url}: a completion with {len(c.token_ids)} token ids and {len(c.logprobs)} log-probs"
    )
  if vocab_size is not None:
    bad = [t for t in c.token_ids if not 0 <= t < vocab_size]
    if bad:
      raise SidecarError(
        f"{url}: the server sampled token id {bad[0]}, outside the model's vocabulary "
        f"[0, {vocab_size}): does it serve this run's model?"
      )
  bad = [x for x in c.logprobs if not (math.isfinite(x) and x <= LOGP_SLACK)]
  if bad:
    raise SidecarError(
      f"{url}: the server returned a sampled token's log-prob {bad[0]} (a log-prob is finite "
      "and <= 0)"
    )


def same_path(served: str | None, written: str) -> bool:
  return served is not None and os.path.normpath(served) == os.path.normpath(written)
