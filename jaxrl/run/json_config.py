"""A JSON config as a config file: ``--config=run/config.json`` (``jaxrl.run.cli`` points
``ml_collections.config_flags`` here with the JSON's path as the argument). A run's ``config.json``
and ``--print_config``'s output are both every field of the config, so loading one reproduces it."""

import json

from jaxrl.config import default_configdict


def get_config(path: str):
  with open(path) as f:
    data = json.load(f)
  c = default_configdict()
  c.update_from_flattened_dict(_flatten(data))
  return c


def _flatten(data: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in data.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
