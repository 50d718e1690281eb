"""Reward terms written as ``KIND[:SOURCE][*WEIGHT],...`` (``reward.terms``).

``verifier`` is the task's verifier (``reward.fn`` or the task's own; no source); ``fn:MODULE:NAME``
a Python callable in TRL's form ``(prompts, completions, **columns) -> list[float | None]``;
``model:PATH`` an HF sequence-classification checkpoint (one label; a directory, or a Hub id
``ORG/NAME[@REVISION]``) run on the trainer's mesh. A
weight defaults to 1 and may be negative (a penalty); "" is the verifier alone, weight 1.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl.config.schema import ConfigError

TERM_KINDS = ("verifier", "fn", "model")


@dataclasses.dataclass(frozen=True)
class TermSpec:
  kind: str  # one of TERM_KINDS
  source: str  # fn: "module:function"; model: the checkpoint's directory; verifier: ""
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


def parse_terms(spec: str, field: str = "reward.terms") -> tuple[TermSpec, ...]:
  """``"verifier, fn:pkg.mod:f*0.5"`` → the terms in order; ConfigError names a bad one."""
  terms = []
  for part in filter(None, (x.strip() for x in spec.split(","))):
    body, star, weight_text = part.rpartition("*")
    if not star:
      body, weight_text = part, "1"
    weight = _weight(part, weight_text.strip(), field)
    kind, _, source = body.strip().partition(":")
    kind, source = kind.strip(), source.strip()
    if kind not in TERM_KINDS:
      raise ConfigError(field, f"term {part!r}: kind {kind!r} is not one of {TERM_KINDS}")
    if kind == "verifier" and source:
      raise ConfigError(field, f"term {part!r}: the verifier takes no source (see reward.fn)")
    if kind == "fn" and not (":" in source and all(source.split(":", 1))):
      raise ConfigError(field, f"term {part!r}: expected fn:MODULE:FUNCTION")
    if kind == "model" and not source:
      raise ConfigError(field, f"term {part!r}: expected model:PATH (an HF checkpoint directory)")
    terms.append(TermSpec(kind, source, weight))
  if sum(t.kind == "verifier" for t in terms) > 1:
    raise ConfigError(field, "the verifier may appear once")
  return tuple(terms)
