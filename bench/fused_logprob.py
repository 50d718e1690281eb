"""Benchmark: fused chunked log-prob + entropy against the naive [B,T,V] version.

Measures the training use (value_and_grad of Σ logp + Σ entropy w.r.t. hidden and lm_head) and
reports, side by side from one run, XLA's temporary memory (`compiled.memory_analysis()`) and the
median wall time over --repeats calls after a warm-up (the minimum too: on a shared machine it is
the figure least disturbed by other processes). Variants are timed round-robin so that load
from other processes on the machine hits all of them alike. Several --chunk values compare sizes.

Run from the repository root (`make bench`, or with PYTHONPATH=. as below); at the default size
each variant costs about 5 s per call on 2 idle CPU cores, so the 4-variant run takes ~4 minutes:
    python bench/fused_logprob.py --chunk 128 256 512
Writes a markdown table to stdout and to --out (default bench/results/fused_logprob.md).
"""

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.nn.logprobs import DEFAULT_CHUNK_SIZE, fused_logprobs_entropy, naive_logprobs_entropy

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAIVE = "naive [B,T,V]"


def parse_args():
  """Command-line flags: problem size, chunk sizes to try, repeats, output path."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--B", type=int, default=8)
  parser.add_argument("--T", type=int, default=1024)
  parser.add_argument("--D", type=int, default=256)
  parser.add_argument("--V", type=int, default=32768)
  parser.add_argument("--tau", type=float, default=0.7)
  parser.add_argument("--chunk", type=int, nargs="+", default=[DEFAULT_CHUNK_SIZE])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
    "--out", default=os.path.join(REPO_ROOT, "bench", "results", "fused_logprob.md")
  )
  return parser.parse_args()


def make_step(fn):
  """Jitted value_and_grad of Σ logp + Σ entropy w.r.t. (hidden, lm_head)."""

  def objective(hidden_BxTxD, lm_head_VxD, tokens_BxT, tau):
    logp_BxT, entropy_BxT = fn(hidden_BxTxD, lm_head_VxD, tokens_BxT, tau)
    return jnp.sum(logp_BxT) + jnp.sum(entropy_BxT)

  return jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))


def compare(B: int, T: int, D: int, V: int, tau: float, chunks, repeats: int) -> dict:
  """Compile the naive variant and one fused variant per chunk size, time them round-robin
  (``repeats`` calls each after a warm-up): ``{"variants": {name: {"temp_bytes", "times",
  "rel_diff"}}, "naive": name}`` (rel_diff: the largest difference from the naive outputs,
  relative to their largest entry)."""
  k_h, k_w, k_t = jax.random.split(jax.random.key(0), 3)
  hidden_BxTxD = jax.random.normal(k_h, (B, T, D), jnp.float32)
  lm_head_VxD = jax.random.normal(k_w, (V, D), jnp.float32) / np.sqrt(D)
  tokens_BxT = jax.random.randint(k_t, (B, T), 0, V)
  call_args = (hidden_BxTxD, lm_head_VxD, tokens_BxT, jnp.float32(tau))

  variants = {NAIVE: naive_logprobs_entropy}
  for chunk in chunks:
    variants[f"fused, chunk {chunk}"] = lambda *a, c=chunk: fused_logprobs_entropy(*a, chunk_size=c)

  compiled, temp_bytes, outputs = {}, {}, {}
  for name, fn in variants.items():
    compiled[name] = make_step(fn).lower(*call_args).compile()
    temp_bytes[name] = compiled[name].memory_analysis().temp_size_in_bytes
    outputs[name] = jax.block_until_ready(compiled[name](*call_args))  # warm-up

  times = {name: [] for name in variants}
  for _ in range(repeats):
    for name in variants:
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](*call_args))
      times[name].append(time.perf_counter() - start)

  naive_leaves = jax.tree.leaves(outputs[NAIVE])
  out = {}
  for name in variants:
    rel_diff = max(
      float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
      for a, b in zip(jax.tree.leaves(outputs[name]), naive_leaves)
    )
    out[name] = {"temp_bytes": int(temp_bytes[name]), "times": times[name], "rel_diff": rel_diff}
  return {"variants": out, "naive": NAIVE}


def table_rows(result: dict) -> list[str]:
  """The markdown table of ``compare``'s result: header and one row per variant."""
  variants, naive = result["variants"], result["variants"][result["naive"]]
  naive_time = statistics.median(naive["times"])
  lines = [
    "| variant | XLA temp (MiB) | naive / variant | median time (s) | variant / naive "
    "| min time (s) | max rel. diff vs naive |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, v in variants.items():
    median = statistics.median(v["times"])
    lines.append(
      f"| {name} | {v['temp_bytes'] / 2**20:.1f} | "
      f"{naive['temp_bytes'] / v['temp_bytes']:.1f}x | {median:.3f} | "
      f"{median / naive_time:.2f} | {min(v['times']):.3f} | {v['rel_diff']:.1e} |"
    )
  return lines


def main():
  """Compile every variant, time them round-robin, print and save the table."""
  args = parse_args()
  result = compare(args.B, args.T, args.D, args.V, args.tau, args.chunk, args.repeats)
  lines = [
    f"B={args.B} T={args.T} D={args.D} V={args.V} tau={args.tau}, value_and_grad of "
    f"sum(logp)+sum(entropy) w.r.t. hidden and lm_head; median of {args.repeats} after warm-up; "
    f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores, "
    f"{platform.machine()}).",
    "",
    *table_rows(result),
  ]
  table = "\n".join(lines) + "\n"
  print(table)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(table)


if __name__ == "__main__":
  main()
