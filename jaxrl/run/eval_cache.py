"""A held-out evaluation cached in the workdir (``eval_{name}.json``) beside the key it was
computed for: a resumed run reads it instead of evaluating again, a run whose config or params
differ evaluates again (why: logged)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os

from jaxrl.nn import lora
from jaxrl.parallel import distributed
from jaxrl.run import run_config
from jaxrl.run.heldout import EvalResult

log = logging.getLogger(__name__)


def params_fingerprint(params) -> str:
  """The identity of ``params`` in an evaluation's key: a hash of every leaf's bit sums
  (``lora.bit_sums``: exact, the same on any mesh). It tells apart params the config does not pin,
  such as steps trained again after a resume that changed a field of ``run_config.SAFE``."""
  sums = [[int(v) for v in leaf] for leaf in distributed.to_host(lora.bit_sums(params))]
  return hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]


def write_json(path: str, value, indent: int | None = 1) -> None:
  """``value`` as the JSON file ``path``, whole or not at all: written aside, then renamed."""
  tmp = f"{path}.tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(value, f, indent=indent)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


EVAL_KEY = "config"  # an evaluation cache's key (``run_config.eval_key``), beside its result


def cached_eval(path: str, key: dict) -> EvalResult | None:
  """The evaluation cached in ``path`` when it was computed for ``key``; else None (why: logged)."""
  if not os.path.exists(path):
    return None
  try:
    with open(path, "rb") as f:
      saved = json.load(f)
    problem = None if isinstance(saved, dict) else "not a JSON object"
  except ValueError as e:  # JSON or UTF-8: a write cut short (a kill, a full disk)
    problem = str(e)
  if problem is not None:
    log.warning("%s: not a cached evaluation (%s): evaluating again", path, problem)
    return None
  why = run_config.cache_changes(saved.get(EVAL_KEY), key)
  if why is not None:
    log.warning("%s does not match this run (%s): evaluating again", path, why)
    return None
  return EvalResult.from_json(saved)
