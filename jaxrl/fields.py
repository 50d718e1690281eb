"""How a config field is checked: ``ConfigError`` (naming the dotted field), ``Range`` (the values a
number may take) and the checks every section's ``check()`` uses.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal


class ConfigError(ValueError):
  """A broken config: ``field`` is the dotted path of the offending entry."""

  def __init__(self, field: str, message: str | None = None):
    if message is None:  # rebuilt from its text: ml_collections re-raises a config file's
      super().__init__(field)  # errors as type(e)(text with the traceback)
      self.field = ""
      return
    super().__init__(f"config.{field}: {message}")
    self.field = field


def need(ok: bool, field: str, message: str) -> None:
  if not ok:
    raise ConfigError(field, message)


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a number of the config may take: from ``low`` (itself allowed when ``low_ok``) to
  ``high`` (itself allowed), never NaN. A value outside fails later (a division by zero, NaN steps,
  an allocation numpy refuses) or silently changes the run (a negative clip turning clipping off),
  so each section's ``check`` refuses it, naming the field."""

  low: float = -math.inf
  low_ok: bool = True
  high: float = math.inf
  note: str = ""  # what a special value means, e.g. " (0 = off)"

  def holds(self, value: float) -> bool:
    above = value >= self.low if self.low_ok else value > self.low
    return above and value <= self.high  # NaN compares False

  def __str__(self) -> str:
    if self.high == math.inf:
      return f"{'>=' if self.low_ok else '>'} {self.low}{self.note}"
    return f"in {'[' if self.low_ok else '('}{self.low}, {self.high}]{self.note}"


AT_LEAST_0 = Range(0)


AT_LEAST_1 = Range(1)


POSITIVE = Range(0, low_ok=False)


FRACTION = Range(0, high=1)  # a probability, a share, a threshold on one


def check_ranges(section: str, obj, ranges: dict[str, Range]) -> None:
  """Each number ``ranges`` names of the section ``obj`` in its range (a ConfigError naming it)."""
  for name, allowed in ranges.items():
    value = getattr(obj, name)
    need(allowed.holds(value), f"{section}.{name}", f"must be {allowed}, got {value}")


def need_seconds(value: float, field: str) -> None:
  """A timeout: a positive, finite number of seconds (an infinite wait never ends)."""
  need(0 < value < math.inf, field, f"must be a finite number of seconds > 0, got {value}")


def check_type(path: str, value: Any, annotation: Any) -> Any:
  hint = annotation
  if typing.get_origin(hint) is Literal:
    allowed = typing.get_args(hint)
    if value not in allowed:
      raise ConfigError(path, f"{value!r} is not one of {allowed}")
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint in (int, float, str, bool) and not (
    isinstance(value, hint) and not (hint is int and isinstance(value, bool))
  ):
    raise ConfigError(path, f"expected {hint.__name__}, got {type(value).__name__} {value!r}")
  if hint is float and math.isnan(value):
    raise ConfigError(path, "is NaN: expected a number")
  return value
