"""Helpers shared by the end-to-end tests: build configs/tiny.py variants, read a run's metrics."""

import json
import os

import jax
from flax import nnx

from jaxrl.config import from_configdict
from jaxrl.nn import lora
from jaxrl.run import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Wall-clock fields and jit-cache counters (process-wide) differ between runs; everything else
# must be identical.
TIMING = {
  "rollout_tok_s",
  "rollout_wait_s",
  "rollout_seconds",
  "update_seconds",
  "wall_time",
  "train_tok_s",
  "train_mfu",
  "step_time",
  "compiles_update",
  "compiles_sampler",
}


def tiny_config(arg="test", **overrides):
  """``configs/tiny.py:ARG`` with dotted overrides (``**{"rollout.engine": "vllm"}``)."""
  cd = cli.load_config(f"{os.path.join(ROOT, 'configs', 'tiny.py')}:{arg}")
  cd.update_from_flattened_dict(overrides)
  return from_configdict(cd)


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def rollouts(
  prompt_ids_RxP,
  prompt_mask_RxP,
  tokens_RxN,
  mask_RxN,
  behaviour_logp_RxN,
  rewards_R,
  group_ids_R,
  prox_logp_RxN=None,
  loss_mask_RxN=None,
):
  """A ``Rollouts`` for the update from the fields it reads (entropies, lengths and finished flags
  derived: the update ignores them). ``prox_logp_RxN`` defaults to the behaviour log-probs (an
  on-policy batch: the engine sampled with the params the update starts from); ``loss_mask_RxN``
  to the response mask (single-turn: every response token is the model's)."""
  import numpy as np

  from jaxrl.types import Rollouts

  mask_RxN = np.asarray(mask_RxN, bool)
  return Rollouts(
    prompt_ids_RxP=np.asarray(prompt_ids_RxP),
    prompt_mask_RxP=np.asarray(prompt_mask_RxP, bool),
    tokens_RxN=np.asarray(tokens_RxN),
    mask_RxN=mask_RxN,
    loss_mask_RxN=mask_RxN if loss_mask_RxN is None else np.asarray(loss_mask_RxN, bool),
    behaviour_logp_RxN=np.asarray(behaviour_logp_RxN, np.float32),
    prox_logp_RxN=np.asarray(
      behaviour_logp_RxN if prox_logp_RxN is None else prox_logp_RxN, np.float32
    ),
    entropy_RxN=np.zeros(mask_RxN.shape, np.float32),
    lengths_R=mask_RxN.sum(axis=1).astype(np.int32),
    group_ids_R=np.asarray(group_ids_R, np.int32),
    finished_R=mask_RxN.sum(axis=1) < mask_RxN.shape[1],
    rewards_R=np.asarray(rewards_R, np.float32),
  )


def moved_adapters(params, scale: float, seed: int = 1, move_a: bool = False):
  """``params`` with their LoRA adapters as after training: B = scale · N(0, 1) (off zero, so the
  adapter path computes something) and, with ``move_a``, A moved by as much."""
  keys = iter(jax.random.split(jax.random.key(seed), 1024))

  def move(path, v):
    name = str(path[-1])
    if name.endswith(lora.ADAPTER_B) or (move_a and name.endswith(lora.ADAPTER_A)):
      noise = scale * jax.random.normal(next(keys), v.shape, v.dtype)
      return v.replace(noise if name.endswith(lora.ADAPTER_B) else v[...] + noise)
    return v

  return nnx.from_flat_state([(p, move(p, v)) for p, v in nnx.to_flat_state(params)])
