"""Reward terms written as ``KIND[:SOURCE][*WEIGHT],...`` (``reward.terms``).

``verifier`` is the task's verifier (``reward.fn`` or the task's own; no source); ``fn:MODULE:NAME``
a Python callable in TRL's form ``(prompts, completions, **columns) -> list[float | None]``;
``model:PATH`` an HF sequence-classification checkpoint (one label; a directory, or a Hub id
``ORG/NAME[@REVISION]``) run on the trainer's mesh; ``judge:URL`` a generative judge behind an
OpenAI-compatible endpoint (``http://`` or ``https://``; its settings are ``reward.judge_*``), or
``judge:sidecar`` the judge ``reward.judge_model`` served by a vLLM server the run starts. A
weight defaults to 1 and may be negative (a penalty); "" is the verifier alone, weight 1.
"""

from __future__ import annotations

import dataclasses
import math
import urllib.parse

from jaxrl.fields import ConfigError

TERM_KINDS = ("verifier", "fn", "model", "judge")
SIDECAR = "sidecar"  # judge:sidecar: the run serves reward.judge_model itself


@dataclasses.dataclass(frozen=True)
class TermSpec:
  kind: str  # one of TERM_KINDS
  source: (
    str  # fn: "module:function"; model: the checkpoint; judge: a URL or "sidecar"; verifier: ""
  )
  weight: float

  @property
  def label(self) -> str:
    """The term's name in the metrics: its kind, and a callable's function name."""
    if self.kind == "fn":
      return "fn_" + self.source.rpartition(":")[2].replace(".", "_")
    return self.kind


def _weight(part: str, text: str, field: str) -> float:
  try:
    weight = float(text)
  except ValueError:
    weight = math.nan
  if not math.isfinite(weight):
    raise ConfigError(field, f"term {part!r}: weight {text!r} is not a finite number")
  return weight


def _judge_source(source: str) -> bool:
  if source == SIDECAR:
    return True
  try:
    url = urllib.parse.urlparse(source)
    return url.scheme in ("http", "https") and bool(url.hostname)
  except ValueError:  # e.g. an unclosed IPv6 bracket
    return False


def _source_error(kind: str, source: str) -> str:
  """Why ``source`` is not a source of a ``kind`` term ("" when it is)."""
  if kind == "verifier" and source:
    return "the verifier takes no source (see reward.fn)"
  if kind == "fn" and not (":" in source and all(source.split(":", 1))):
    return "expected fn:MODULE:FUNCTION"
  if kind == "model" and not source:
    return "expected model:PATH (an HF checkpoint directory)"
  if kind == "judge" and not _judge_source(source):
    return f"expected judge:URL (http:// or https://) or judge:{SIDECAR}"
  return ""


def _with_password(part: str) -> bool:
  """A judge URL with user info, which no message may repeat (it would log a password)."""
  kind, _, source = part.partition(":")
  try:
    return kind.strip() == "judge" and "@" in urllib.parse.urlsplit(source.strip()).netloc
  except ValueError:  # not a URL at all: _source_error says so
    return False


def parse_terms(spec: str, field: str = "reward.terms") -> tuple[TermSpec, ...]:
  """``"verifier, fn:pkg.mod:f*0.5"`` → the terms in order; ConfigError names a bad one."""
  terms = []
  for part in filter(None, (x.strip() for x in spec.split(","))):
    if _with_password(part):
      raise ConfigError(
        field,
        "a judge URL carries no user or password: put the API key in the environment variable "
        "reward.judge_api_key_env names",
      )
    body, star, weight_text = part.rpartition("*")
    if not star:
      body, weight_text = part, "1"
    weight = _weight(part, weight_text.strip(), field)
    kind, _, source = body.strip().partition(":")
    kind, source = kind.strip(), source.strip()
    if kind not in TERM_KINDS:
      raise ConfigError(field, f"term {part!r}: kind {kind!r} is not one of {TERM_KINDS}")
    if why := _source_error(kind, source):
      raise ConfigError(field, f"term {part!r}: {why}")
    terms.append(TermSpec(kind, source, weight))
  for once in ("verifier", "judge"):  # the judge's settings (reward.judge_*) are one judge's
    if sum(t.kind == once for t in terms) > 1:
      raise ConfigError(field, f"the {once} may appear once")
  return tuple(terms)
