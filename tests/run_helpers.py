"""Helpers shared by the end-to-end tests: build configs/tiny.py variants, read a run's metrics."""

import importlib.util
import json
import os

from jaxrl.config import from_configdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Wall-clock fields and jit-cache counters (process-wide) differ between runs; everything else
# must be identical.
TIMING = {"rollout_tok_s", "train_tok_s", "step_time", "compiles_update", "compiles_sampler"}


def tiny_config(arg="test", **overrides):
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cd = module.get_config(arg)
  for key, value in overrides.items():
    node = cd
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return from_configdict(cd)


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
