"""Benchmark: the GRPO update on padded rows against the packed update (docs/algorithms.md §1.6).

One jitted ``rl_update`` (SGD, token-mean), the same model and batch, run padded and packed
(``rl.packing.plan``). Response lengths are drawn uniformly from [--min_frac, 1] of the budget N,
prompts from [P/2, P]: the packed update's work shrinks with the padding it skips. Reports the
packed buffers' fill, their rows against the padded rows, XLA's temporary memory of each program
(`compiled.memory_analysis()`), and the median (and minimum) wall time over --repeats calls after
a warm-up, the two variants timed round-robin so that load from other processes hits both alike.

Run from the repository root; at the default size each call takes a few seconds on 2 idle CPU
cores (a minute or two in all):
    PYTHONPATH=. python bench/packed_update.py
Writes a markdown table to stdout and to --out (default bench/results/packed_update.md).
"""

import argparse
import functools
import os
import platform
import statistics
import time

import jax
import numpy as np
import optax

from jaxrl.nn import model
from jaxrl.rl import losses, packing, step
from jaxrl.types import Rollouts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
  """Command-line flags: model and batch size, length distribution, repeats, output path."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--R", type=int, default=16)
  parser.add_argument("--P", type=int, default=64)
  parser.add_argument("--N", type=int, default=512)
  parser.add_argument("--min_frac", type=float, default=0.1)
  parser.add_argument("--D", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--V", type=int, default=8192)
  parser.add_argument("--micro", type=int, default=1)
  parser.add_argument("--buckets", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench/results/packed_update.md"))
  return parser.parse_args()


def make_batch(args, rng) -> Rollouts:
  """R rollouts of random tokens: prompts of P/2..P real tokens (left-padded), responses of
  min_frac·N..N (right-padded), two groups of mixed rewards."""
  r, p, n = args.R, args.P, args.N
  prompt_R = rng.integers(p // 2, p + 1, r)
  response_R = rng.integers(max(1, int(args.min_frac * n)), n + 1, r)
  mask_RxN = np.arange(n)[None, :] < response_R[:, None]
  logp_RxN = np.where(mask_RxN, -3.0, 0.0).astype(np.float32)
  return Rollouts(
    prompt_ids_RxP=rng.integers(0, args.V, (r, p)).astype(np.int32),
    prompt_mask_RxP=np.arange(p)[None, :] >= p - prompt_R[:, None],
    tokens_RxN=rng.integers(0, args.V, (r, n)).astype(np.int32),
    mask_RxN=mask_RxN,
    loss_mask_RxN=mask_RxN,
    behaviour_logp_RxN=logp_RxN,
    entropy_RxN=np.zeros((r, n), np.float32),
    lengths_R=response_R.astype(np.int32),
    group_ids_R=np.repeat([0, 1], r // 2).astype(np.int32),
    finished_R=np.ones(r, bool),
    prox_logp_RxN=logp_RxN,
    rewards_R=np.tile([1.0, 0.0], r // 2).astype(np.float32),
  )


def main():
  args = parse_args()
  mcfg = model.ModelConfig(
    vocab_size=args.V, hidden_size=args.D, intermediate_size=4 * args.D, num_layers=args.layers,
    num_heads=max(1, args.D // 64), num_kv_heads=1, head_dim=64,
  )  # fmt: skip
  graphdef, params = model.create(mcfg, 0)
  tx = optax.sgd(1e-3)
  cfg = losses.LossConfig(num_groups=3, micro_batches=args.micro)
  batch = make_batch(args, np.random.default_rng(0))
  pack = packing.plan(batch.prompt_mask_RxP, batch.mask_RxN, 1, args.micro, args.buckets)
  lengths_R = packing.sequence_lengths(batch.prompt_mask_RxP, batch.mask_RxN)
  t = args.P + args.N
  fill = lengths_R.sum() / (pack.rows * args.micro * t)
  update = jax.jit(functools.partial(step.rl_update, graphdef, tx, cfg))
  hp = losses.LossHparams.create(tau=1.0)
  variants = {"padded": None, "packed": pack}
  state = step.init_state(params, tx)
  compiled, times = {}, {name: [] for name in variants}
  for name, p in variants.items():
    compiled[name] = update.lower(state, batch, hp, None, p).compile()
    jax.block_until_ready(compiled[name](state, batch, hp, None, p))  # warm-up
  for _ in range(args.repeats):
    for name, p in variants.items():
      t0 = time.perf_counter()
      jax.block_until_ready(compiled[name](state, batch, hp, None, p))
      times[name].append(time.perf_counter() - t0)
  lines = [
    f"# Packed update vs padded ({platform.processor() or platform.machine()}, "
    f"{jax.default_backend()})",
    "",
    f"R={args.R}, P={args.P}, N={args.N}, responses {args.min_frac:g}N..N, D={args.D}, "
    f"layers={args.layers}, V={args.V}, micro={args.micro}; packed: {pack.rows} buffer rows per "
    f"micro-batch of {args.R // args.micro} rows, fill {fill:.2f}",
    "",
    "| variant | median s | min s | XLA temp MiB |",
    "|---|---|---|---|",
  ]
  for name in variants:
    temp = compiled[name].memory_analysis().temp_size_in_bytes / 2**20
    lines.append(
      f"| {name} | {statistics.median(times[name]):.3f} | {min(times[name]):.3f} | {temp:.1f} |"
    )
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
