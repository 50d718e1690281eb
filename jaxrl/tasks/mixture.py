"""Data mixtures written as ``NAME[:WEIGHT],...`` (``data.train``, ``anneal_phase.mixture``)."""

from __future__ import annotations

from jaxrl.fields import ConfigError


def parse_mixture(spec: str, field: str) -> tuple[tuple[str, float], ...]:
  """``"A:2,B"`` → ``(("A", 2.0), ("B", 1.0))``: pool names with weights (default 1); a Hub
  dataset ``hf:ORG/NAME[:CONFIG][:SPLIT][:WEIGHT]`` keeps its colons."""
  out = []
  for part in filter(None, (x.strip() for x in spec.split(","))):
    name, sep, weight = part.rpartition(":") if ":" in part else (part, "", "1")
    try:
      w = float(weight)
    except ValueError:
      w = -1.0
      if part.startswith("hf:"):  # hf:ORG/NAME[:CONFIG][:SPLIT]: colons that are not a weight
        name, w = part, 1.0
    if not name.strip() or not w > 0:
      raise ConfigError(field, f"expected NAME or NAME:WEIGHT with WEIGHT > 0, got {part!r}")
    out.append((name.strip(), w))
  return tuple(out)
