"""A JSON config as a config file: ``--config=run/config.json`` (``jaxrl.run.cli`` points
``ml_collections.config_flags`` here with the JSON's path as the argument). A run's ``config.json``
and ``--print_config``'s output are both every field of the config, so loading one reproduces it.

Numbers must be finite: ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's ``json`` accepts
by default) are a ``ConfigError`` naming the field."""

import json

from jaxrl.config import ConfigError, default_configdict


class _NonFinite:
  """A JSON constant (``NaN``, ``Infinity``, ``-Infinity``), kept to name its field."""

  def __init__(self, text: str):
    self.text = text


def get_config(path: str):
  with open(path) as f:
    data = json.load(f, parse_constant=_NonFinite)
  if not isinstance(data, dict):
    raise ValueError(
      f"{path}: expected a JSON object of config sections, got {type(data).__name__}"
    )
  flat = _flatten(data)
  for field, value in flat.items():
    if isinstance(value, _NonFinite):
      raise ConfigError(field, f"is {value.text} in {path}: a JSON config takes finite numbers")
  c = default_configdict()
  c.update_from_flattened_dict(flat)
  return c


def _flatten(data: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in data.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
