"""A JSON config as a config file: ``--config=run/config.json`` (``jaxrl.run.cli`` points
``ml_collections.config_flags`` here with the JSON's path as the argument). A run's ``config.json``
and ``--print_config``'s output are both every field of the config, so loading one reproduces it.

Numbers must be finite: ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's ``json`` accepts
by default) are a ``ConfigError`` naming the field."""

import json
import logging

from jaxrl.config import default_configdict
from jaxrl.fields import ConfigError

log = logging.getLogger(__name__)

# Fields that a run's config.json written by an earlier jaxrl may hold and this one no longer has:
# dropped on load (logged), so that older runs still evaluate, export and resume.
REMOVED = {
  "vllm.host": "a launched vLLM server listens on a private Unix socket, not a TCP host",
  "vllm.port": "a launched vLLM server listens on a private Unix socket, not a TCP port",
}


def drop_removed(flat: dict, where: str) -> dict:
  """``flat`` (dotted field → value) without the ``REMOVED`` fields."""
  for field in REMOVED.keys() & flat.keys():
    log.warning("%s: ignoring %s (%s)", where, field, REMOVED[field])
  return {k: v for k, v in flat.items() if k not in REMOVED}


class _NonFinite:
  """A JSON constant (``NaN``, ``Infinity``, ``-Infinity``), kept to name its field."""

  def __init__(self, text: str):
    self.text = text


def get_config(path: str):
  with open(path) as f:
    try:
      data = json.load(f, parse_constant=_NonFinite)
    except json.JSONDecodeError as e:  # one line (config_flags cannot re-raise its own type)
      raise ValueError(
        f"{path}: not a JSON config: {e.msg} at line {e.lineno}, column {e.colno}"
      ) from None
  if not isinstance(data, dict):
    raise ValueError(
      f"{path}: expected a JSON object of config sections, got {type(data).__name__}"
    )
  flat = drop_removed(flatten(data), path)
  for field, value in flat.items():
    if isinstance(value, _NonFinite):
      raise ConfigError(field, f"is {value.text} in {path}: a JSON config takes finite numbers")
  c = default_configdict()
  c.update_from_flattened_dict(flat)
  return c


def unflatten(flat: dict) -> dict:
  """The nested sections of a dotted ``flat`` dict."""
  out: dict = {}
  for key, value in flat.items():
    *sections, name = key.split(".")
    node = out
    for s in sections:
      node = node.setdefault(s, {})
    node[name] = value
  return out


def flatten(data: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in data.items():
    if isinstance(value, dict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
