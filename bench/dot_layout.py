"""Decode-like matmuls on XLA CPU: does the stored layout of the weights matter when rows are few?

A decode step multiplies a few rows by every weight of the model once. This times that pattern
alone: a jitted loop over ``--layers`` weights of [K, N] (by default 12 × 4 MB, more than the
L3 cache holds, as a model's weights are), each applied to the same M rows, for two layouts of
the same weights:

- ``kn``: W stored [K, N] (x @ W; jaxrl's kernels until this benchmark moved them);
- ``nk``: W stored [N, K] (x @ Wᵀ: torch's ``Linear``, HF checkpoints, and ``layers.dense`` now).

The products and sums are the same; only the order in which the dot reads the weights differs.
Both layouts are timed round-robin (medians of ``--repeats``); per row count the script prints
µs per dot, GB/s of weights read and GFLOP/s, and the last line is ``ratio R``: the kn time over
the nk time at the first row count (above 1: the [N, K] layout is faster).

    PYTHONPATH=. .venv/bin/python bench/dot_layout.py                    # M 4 / 16 / 64
    PYTHONPATH=. .venv/bin/python bench/dot_layout.py --layers 1         # weights resident

Run it with nothing else on the cores. ``--out F`` appends the result as one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side  # noqa: E402

LAYOUTS = ("kn", "nk")
STEPS = 16  # loop iterations per timed call: each applies every weight once


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64])
  parser.add_argument("--k", type=int, default=512, help="K: the input width (hidden size)")
  parser.add_argument("--n", type=int, default=2048, help="N: the output width")
  parser.add_argument("--layers", type=int, default=12, help="weights in the loop")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", help="append the result as a JSON line to this file")
  return parser.parse_args(argv)


def _program(layout: str):
  """jit(rows_MxK, weights) -> rows after STEPS passes over every weight in ``layout``."""
  import jax
  import jax.numpy as jnp

  # contract x's dim 1 with the weight's K dim: dim 0 of [K, N], dim 1 of [N, K]
  weight_k_dim = {"kn": 0, "nk": 1}[layout]

  @jax.jit
  def run(x_MxK, weights):
    def one_pass(_, x_MxK):
      for w in weights:
        y_MxN = jax.lax.dot_general(x_MxK, w, (((1,), (weight_k_dim,)), ((), ())))
        # each dot depends on the previous one (through y's row means: any K, N)
        x_MxK = x_MxK + 1e-3 * jnp.tanh(jnp.mean(y_MxN, axis=1, keepdims=True))
      return x_MxK

    return jax.lax.fori_loop(0, STEPS, one_pass, x_MxK)

  return run


def measure(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(0)
  weights_kn = [
    (rng.standard_normal((args.k, args.n)) * 0.02).astype(np.float32) for _ in range(args.layers)
  ]
  weights = {
    "kn": [jnp.asarray(w) for w in weights_kn],
    "nk": [jnp.asarray(np.ascontiguousarray(w.T)) for w in weights_kn],
  }
  programs = {layout: _program(layout) for layout in LAYOUTS}
  dots = STEPS * args.layers
  points = []
  for m in args.rows:
    x_MxK = jnp.asarray(rng.standard_normal((m, args.k)).astype(np.float32))
    for layout in LAYOUTS:  # compile and warm up
      jax.block_until_ready(programs[layout](x_MxK, weights[layout]))
    secs = {layout: [] for layout in LAYOUTS}
    for _ in range(args.repeats):
      for layout in LAYOUTS:
        start = time.perf_counter()
        jax.block_until_ready(programs[layout](x_MxK, weights[layout]))
        secs[layout].append((time.perf_counter() - start) / dots)
    point = {"rows": m}
    for layout in LAYOUTS:
      s = statistics.median(secs[layout])
      point[layout] = {
        "us_per_dot": s * 1e6,
        "weight_gb_per_s": args.k * args.n * 4 / s / 1e9,
        "gflops": 2 * m * args.k * args.n / s / 1e9,
      }
    point["ratio"] = point["kn"]["us_per_dot"] / point["nk"]["us_per_dot"]
    points.append(point)
    print(
      f"  M {m:4d}: "
      + ", ".join(
        f"{layout} {point[layout]['us_per_dot']:8.1f} µs ({point[layout]['weight_gb_per_s']:.1f} "
        f"GB/s, {point[layout]['gflops']:.1f} GFLOP/s)"
        for layout in LAYOUTS
      )
      + f"; kn / nk {point['ratio']:.2f}",
      flush=True,
    )
  return {
    "k": args.k,
    "n": args.n,
    "layers": args.layers,
    "repeats": args.repeats,
    "points": points,
    "ratio": points[0]["ratio"],  # the kn / nk time at the first row count
    "machine": side_by_side.machine(),
  }


def main(argv=None):
  args = parse_args(argv)
  print(
    f"{args.layers} weights of [{args.k}, {args.n}] float32 "
    f"({args.layers * args.k * args.n * 4 / 2**20:.0f} MiB), {STEPS} passes per call, "
    f"median of {args.repeats}",
    flush=True,
  )
  side_by_side.finish(measure(args), args.out)


if __name__ == "__main__":
  main()
