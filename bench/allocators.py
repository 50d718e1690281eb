"""Benchmark: rollout allocators (jaxrl.allocation) on a 1,000,000-question pool, under jax.jit.

Two groups, each against a baseline timed side by side:
  * over all Q questions: ``e3_difficulty`` (the E3 difficulty ranks) and the E3 allocator's
    ``on_epoch_end`` (which recomputes them), against a plain ``jnp.argsort`` of Q floats;
  * over one batch of B questions drawn from the Q: ``e3_allocate``, ``dynamo_priority`` +
    ``dynamo_allocate``, and each optax-style allocator's ``allocate`` (uniform, E3, DynaMO),
    against ``jnp.full((B,), G)``, i.e. the cost of one jitted call that does no work.
The statistics are drawn to look like a run a few epochs in: most questions seen a few groups'
worth of rollouts, a per-question success rate from a U-shaped Beta (many questions nearly always
or nearly never solved), binary rewards. E3 runs with the bounds of its fourth epoch, DynaMO with
g_min=4, g_max=12.

Compile time (lower + compile) is reported separately; the timed calls exclude it, follow one
warm-up call and end with block_until_ready. Variants are timed round-robin so that load from
other processes hits them alike; the ratio column is the median over repeats of variant time /
baseline time within the same round.

Run from the repository root (about a minute at the defaults on 2 CPU cores):
    PYTHONPATH=. .venv/bin/python bench/allocators.py
Writes a markdown table to stdout and to --out (default bench/results/allocators.md).
"""

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.methods import allocation
from jaxrl.types import QuestionStats

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
  """Command-line flags: pool and batch size, group size, bounds, repeats, output path."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--Q", type=int, default=1_000_000, help="questions in the pool")
  parser.add_argument("--B", type=int, default=512, help="questions per batch")
  parser.add_argument("--G", type=int, default=8, help="group size (mean rollouts per question)")
  parser.add_argument(
    "--epoch",
    type=int,
    default=2,
    help="0-based epoch that just ended (sets E3's bounds for the next one)",
  )
  parser.add_argument("--g-min", type=int, default=4, help="DynaMO lower bound")
  parser.add_argument("--g-max", type=int, default=12, help="DynaMO upper bound")
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "allocators.md"))
  args = parser.parse_args()
  if args.B > args.Q:
    parser.error(f"--B ({args.B}) must not exceed --Q ({args.Q})")
  if not args.g_min <= args.G <= args.g_max:
    parser.error(f"need --g-min <= --G <= --g-max, got {args.g_min} <= {args.G} <= {args.g_max}")
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  return args


def realistic_stats(num_questions: int, group_size: int, epochs: int, rng) -> QuestionStats:
  """Statistics of a run ``epochs`` epochs in; success rates per question from Beta(0.6, 0.6)."""
  # Each epoch visits a question once with about G rollouts (E3/DynaMO vary it between bounds);
  # 10% of the pool is never visited (e.g. added by a later data mixture).
  visits_Q = np.where(rng.random(num_questions) < 0.9, epochs, 0)
  rollouts_Q = visits_Q * group_size + rng.integers(-2, 3, num_questions) * (visits_Q > 0)
  seen_Q = np.maximum(rollouts_Q, 0).astype(np.int32)
  success_Q = rng.beta(0.6, 0.6, num_questions)
  correct_Q = rng.binomial(seen_Q, success_Q).astype(np.int32)
  return QuestionStats(
    seen_Q=jnp.asarray(seen_Q),
    correct_Q=jnp.asarray(correct_Q),
    reward_sum_Q=jnp.asarray(correct_Q, jnp.float32),  # binary verifier: reward 1 per correct
    last_step_Q=jnp.where(jnp.asarray(seen_Q) > 0, 0, -1).astype(jnp.int32),
  )


def time_group(variants, repeats):
  """Compile each (fn, args) variant, warm up, then time them round-robin; returns dicts."""
  compiled, compile_s, outputs = {}, {}, {}
  for name, (fn, call_args) in variants.items():
    start = time.perf_counter()
    compiled[name] = jax.jit(fn).lower(*call_args).compile()
    compile_s[name] = time.perf_counter() - start
    outputs[name] = jax.block_until_ready(compiled[name](*call_args))  # warm-up
  times = {name: [] for name in variants}
  for _ in range(repeats):
    for name, (_, call_args) in variants.items():
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](*call_args))
      times[name].append(time.perf_counter() - start)
  return compile_s, times, outputs


def fmt_time(seconds: float) -> str:
  """Seconds as ms with 3 significant figures, or µs below a millisecond."""
  if seconds >= 1e-3:
    return f"{seconds * 1e3:.3g} ms"
  return f"{seconds * 1e6:.3g} µs"


def table_rows(baseline, compile_s, times):
  """One markdown row per variant: median, p10–p90, ratio to the baseline of the same round."""
  rows = []
  for name, samples in times.items():
    p10, p90 = np.percentile(samples, [10, 90])
    ratio = statistics.median(t / b for t, b in zip(samples, times[baseline]))
    rows.append(
      f"| {name} | {fmt_time(statistics.median(samples))} | {fmt_time(p10)} – "
      f"{fmt_time(p90)} | {ratio:.2f} | {compile_s[name]:.2f} |"
    )
  return rows


def check_counts(name, counts_B, args):
  """Check that Σ counts = B·G (the fixed rollout count); return "min–max" for the table."""
  counts_B = np.asarray(counts_B)
  if counts_B.shape != (args.B,) or int(counts_B.sum()) != args.B * args.G:
    raise AssertionError(
      f"{name}: counts of shape {counts_B.shape} sum to {counts_B.sum()}, "
      f"expected shape ({args.B},) and sum {args.B * args.G}"
    )
  return f"{counts_B.min()}–{counts_B.max()}"


def main():
  """Build the statistics, time both groups, check the outputs, print and save the tables."""
  args = parse_args()
  rng = np.random.default_rng(args.seed)
  stats = realistic_stats(args.Q, args.G, args.epoch + 1, rng)
  ids_B = jnp.asarray(rng.choice(args.Q, args.B, replace=False).astype(np.int32))
  avg_Q = stats.reward_sum_Q / jnp.maximum(stats.seen_Q, 1).astype(jnp.float32)

  uniform = allocation.uniform_allocator(args.G)
  e3 = allocation.e3_allocator(args.G)
  dynamo = allocation.dynamo_allocator(args.G, args.g_min, args.g_max)
  epoch = jnp.int32(args.epoch)
  dynamo_state = dynamo.init(args.Q)
  seen_B, correct_B = stats.seen_Q[ids_B], stats.correct_Q[ids_B]

  def dynamo_reference(seen_B, correct_B, g_min, g_max):
    priority_B = allocation.dynamo_priority(seen_B, correct_B)
    return allocation.dynamo_allocate(priority_B, seen_B.shape[0] * args.G, g_min, g_max)

  argsort_name = f"baseline: jnp.argsort of {args.Q:,} f32"
  pool_variants = {
    argsort_name: (jnp.argsort, (avg_Q,)),
    "e3_difficulty(reward_sum, seen)": (
      allocation.e3_difficulty,
      (stats.reward_sum_Q, stats.seen_Q),
    ),
    "e3_allocator.on_epoch_end": (e3.on_epoch_end, (e3.init(args.Q), stats, epoch)),
  }
  pool_compile, pool_times, pool_out = time_group(pool_variants, args.repeats)
  # The batch group allocates from the state that epoch end produced (ranks and widened bounds).
  e3_state = pool_out["e3_allocator.on_epoch_end"]
  g_min_e3, g_max_e3 = int(e3_state.g_min), int(e3_state.g_max)
  rank_B = e3_state.rank_Q[ids_B]

  full_name = f"baseline: jnp.full(({args.B},), {args.G})"
  batch_variants = {
    full_name: (lambda ids: jnp.full(ids.shape, args.G, jnp.int32), (ids_B,)),
    "e3_allocate(k_B, G, g_min, g_max)": (
      lambda k, lo, hi: allocation.e3_allocate(k, args.G, lo, hi),
      (rank_B, e3_state.g_min, e3_state.g_max),
    ),
    "dynamo_priority + dynamo_allocate": (
      dynamo_reference,
      (seen_B, correct_B, jnp.int32(args.g_min), jnp.int32(args.g_max)),
    ),
    "uniform_allocator.allocate": (uniform.allocate, (uniform.init(args.Q), stats, ids_B)),
    "e3_allocator.allocate": (e3.allocate, (e3_state, stats, ids_B)),
    "dynamo_allocator.allocate": (dynamo.allocate, (dynamo_state, stats, ids_B)),
  }

  batch_compile, batch_times, batch_out = time_group(batch_variants, args.repeats)

  # The ranks must be a permutation of 0..Q-1 (over Q); the state's ranks must equal them.
  k_Q = np.asarray(pool_out["e3_difficulty(reward_sum, seen)"])
  positions_Q = np.rint(k_Q.astype(np.float64) * args.Q).astype(np.int64)
  if not np.array_equal(np.sort(positions_Q), np.arange(args.Q)):
    raise AssertionError("e3_difficulty: ranks are not a permutation of 0..Q-1")
  if not np.array_equal(np.asarray(pool_out["e3_allocator.on_epoch_end"].rank_Q), k_Q):
    raise AssertionError("e3_allocator.on_epoch_end: ranks differ from e3_difficulty")
  ranges = {name: check_counts(name, out, args) for name, out in batch_out.items()}
  if not np.array_equal(
    batch_out["e3_allocator.allocate"], batch_out["e3_allocate(k_B, G, g_min, g_max)"]
  ):
    raise AssertionError("e3_allocator.allocate differs from e3_allocate on the same ranks")
  if not np.array_equal(
    batch_out["dynamo_allocator.allocate"], batch_out["dynamo_priority + dynamo_allocate"]
  ):
    raise AssertionError("dynamo_allocator.allocate differs from dynamo_priority + dynamo_allocate")

  seen_np = np.asarray(stats.seen_Q)
  header = [
    "| variant | median | p10 – p90 | ratio to baseline | compile (s) |",
    "|---|---:|---:|---:|---:|",
  ]
  lines = [
    f"Q={args.Q:,} questions, B={args.B}, G={args.G}; E3 bounds after epoch {args.epoch} "
    f"[{g_min_e3}, {g_max_e3}], DynaMO [{args.g_min}, {args.g_max}]; statistics: "
    f"{np.mean(seen_np == 0):.0%} of questions unseen, mean seen {seen_np.mean():.1f}. "
    f"jax.jit, compile excluded, {args.repeats} repeats round-robin after a warm-up; ratio = "
    f"median over repeats of variant / baseline in the same round. jax {jax.__version__} on "
    f"{jax.devices()[0].platform} ({os.cpu_count()} cores, {platform.machine()}).",
    "",
    f"Over all Q = {args.Q:,} questions:",
    "",
    *header,
    *table_rows(argsort_name, pool_compile, pool_times),
    "",
    f"One batch of B = {args.B} questions (counts range shown; every allocator checked to sum "
    f"to B·G = {args.B * args.G}):",
    "",
    *[h.replace(" compile (s) |", " compile (s) | counts |") for h in header[:1]],
    header[1] + "---:|",
    *[
      row + f" {ranges[name]} |"
      for row, name in zip(table_rows(full_name, batch_compile, batch_times), batch_times)
    ],
  ]
  table = "\n".join(lines) + "\n"
  print(table)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(table)


if __name__ == "__main__":
  main()
