"""Helpers shared by the test modules: configs/tiny.py variants, a run's metrics, a step context
built without a trainer (``step_context``, ``run_steps``), and the small model and batches of the
update tests (``SMALL_MODEL``, ``random_batch``, ``rollouts``).

Test modules import helpers from here (or ``rounding``, ``hf_fixtures``, ``sidecar_helpers``),
never from one another: a test module is collected, and its fixtures and parametrisations built,
once per import."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

from jaxrl.config import from_configdict
from jaxrl.nn import arch, lora, model
from jaxrl.parallel import sharding
from jaxrl.rl import losses
from jaxrl.rl.programs import Programs
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.engine import JaxEngine
from jaxrl.run import cli
from jaxrl.run.components import task_sections
from jaxrl.run.context import StepContext
from jaxrl.run.loop import rl_step
from jaxrl.run.phases import run_phases
from jaxrl.tasks.task import load_task

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
  "train_raw_tok_s",
  "train_mfu",
  "step_time",
  "diagnostics_seconds",
  "compiles_update",
  "compiles_sampler",
}


def tiny_config(arg="test", **overrides):
  """``configs/tiny.py:ARG`` with dotted overrides (``**{"rollout.engine": "vllm"}``)."""
  cd = cli.load_config(f"{os.path.join(ROOT, 'configs', 'tiny.py')}:{arg}")
  cd.update_from_flattened_dict(overrides)
  return from_configdict(cd)


def snapshot(directory) -> dict:
  """Every path under ``directory``: files with their size and modification time."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs:
      out[os.path.relpath(os.path.join(root, name), directory)] = "dir"
    for name in files:
      st = os.stat(os.path.join(root, name))
      out[os.path.relpath(os.path.join(root, name), directory)] = (st.st_size, st.st_mtime_ns)
  return out


def jaxrl_eval(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
  """``python -m jaxrl.eval FLAGS`` from the repository root (``env``: the process's environment,
  default this one's with the repository on PYTHONPATH); it must exit 0."""
  done = subprocess.run(
    [sys.executable, "-m", "jaxrl.eval", *flags],
    cwd=ROOT,
    env=env or dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  return done


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


def step_context(cfg, tokenizer_dir) -> tuple[StepContext, object]:
  """What ``rl_step`` reads, built as the trainer builds it but without a warm start or a run
  directory: the task (its tokenizer written to ``tokenizer_dir``), the programs on one device, a
  ``JaxEngine``; and fresh params of the config's model (seed 0)."""
  task = load_task(
    task_sections(cfg), str(tokenizer_dir)
  )  # the arithmetic tokenizer, built in code
  mcfg = arch.model_config(cfg.model, task.vocab_size)
  graphdef, params = model.create(mcfg, 0)
  programs = Programs.for_run(cfg.optim, graphdef, params, sharding.make_mesh(1, 1, 1))
  engine = JaxEngine(
    graphdef,
    mcfg,
    max_new_tokens=cfg.rollout.max_new_tokens,
    eos_id=task.eos_id,
    pad_id=task.pad_id,
    compact_every=cfg.rollout.compact_every,
  )
  collector = Collector(engine, programs, cfg.loss.logprob_chunk, cfg.loss.micro_batches)
  ctx = StepContext(cfg, task, programs, collector, run_phases(cfg), mcfg.vocab_size)
  return ctx, params


def run_steps(ctx, loop, first, last):
  """``rl_step`` for steps ``first`` .. ``last - 1``: the final loop state and the rows (without
  their wall-clock fields)."""
  rows = []
  for i in range(first, last):
    loop, row = rl_step(ctx, loop, i)
    rows.append({k: v for k, v in row.items() if k not in TIMING})
  return loop, rows


def loop_leaves(loop):
  """The loop state's arrays (train state, statistics, controller states) as numpy."""
  return [np.asarray(x) for x in jax.tree.leaves((loop.train, loop.stats, loop.controllers))]


# A small untied decoder for update tests (test_step, test_lora).
SMALL_MODEL = model.ModelConfig(
  vocab_size=32,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=2,
  num_kv_heads=1,
  head_dim=16,
  rope_theta=1e6,
  tie_embeddings=False,
)


def random_batch(rng, R=8, P=5, N=4, groups=2):
  """R random rollouts of ``SMALL_MODEL``'s vocabulary in ``groups`` groups, rewards 1, 0, 0, 1."""
  return rollouts(
    prompt_ids_RxP=rng.integers(0, 32, (R, P)).astype(np.int32),
    prompt_mask_RxP=np.ones((R, P), bool),
    tokens_RxN=rng.integers(0, 32, (R, N)).astype(np.int32),
    mask_RxN=np.arange(N)[None, :] < rng.integers(1, N + 1, (R, 1)),
    behaviour_logp_RxN=(-rng.random((R, N)) * 3 - 0.5).astype(np.float32),
    rewards_R=np.tile([1.0, 0.0, 0.0, 1.0], R // 4).astype(np.float32),
    group_ids_R=np.repeat(np.arange(groups), R // groups).astype(np.int32),
  )


def assert_same_step(new_a, new_b, params, rtol: float):
  """Two params stepped from ``params``: each weight within ``rtol`` of its leaf's largest step
  and one ulp."""
  for a, b, p in zip(*(jax.tree.leaves(x) for x in (new_a, new_b, params))):
    a, b = np.asarray(a), np.asarray(b)
    bound = rtol * np.max(np.abs(b - np.asarray(p))) + np.spacing(np.max(np.abs(b)))
    np.testing.assert_allclose(a, b, rtol=0, atol=bound)


def assert_same_update(out, params, rtol: float):
  """Two (state, metrics) of updates from ``params``: the new params as ``assert_same_step``
  says, the losses within rtol."""
  assert_same_step(out[0][0].params, out[1][0].params, params, rtol)
  np.testing.assert_allclose(
    float(out[0][1]["loss"]), float(out[1][1]["loss"]), rtol=rtol, atol=rtol
  )


def update_hparams():
  """The update's traced values for the update tests: no KL, no entropy bonus, τ = 0.9."""
  return losses.LossHparams.create(
    eps_low=0.2, eps_high=0.28, kl_coef=0.0, entropy_coef=0.0, tau=0.9
  )


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.02):
  """Polls ``condition()`` until it is true (and returns its value); fails after ``timeout_s``,
  a bound for a hang, never a measurement: it is chosen generous for a loaded machine."""
  deadline = time.monotonic() + timeout_s
  while not (value := condition()):
    assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
    time.sleep(poll_s)
  return value
