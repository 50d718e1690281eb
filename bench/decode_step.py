"""Where the JAX sampler's time goes: prefill vs decode step, fixed cost per step vs cost per row.

For each vocabulary and row count, ``sampler.generate`` is timed at two lengths, 1 new token (the
prompt's prefill, the first draw, the program's fixed cost) and 1 + K new tokens; the difference
over K is one decode step (the model on one token per row, the LM head, the draw, ℓ and the
entropy). A least-squares line through the steps at the row counts splits a step into a fixed
cost (weights read, per-operation overhead: what does not grow with the batch) and a cost per row.
Sampled (τ = 1, top_p = 1) and greedy steps are both timed: their difference is the draw.

    PYTHONPATH=. .venv/bin/python bench/decode_step.py                        # 16/64/256 rows, vocab 2048
    PYTHONPATH=. .venv/bin/python bench/decode_step.py --vocab 151936 --rows 16 64

Run it with nothing else on the cores. ``--out F`` appends the result as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side  # noqa: E402


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(side_by_side.MODEL_SIZES), default="5m")
  parser.add_argument("--vocab", type=int, help="replace the size's vocabulary")
  parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
  parser.add_argument("--group", type=int, default=8, help="samples per prompt")
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--steps", type=int, default=32, help="K: decode steps timed")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", help="append the result as a JSON line to this file")
  return parser.parse_args(argv)


def _timer(cfg, graphdef, params, rows: int, group: int, prompt_len: int):
  """time(new_tokens, greedy) -> seconds of one ``generate`` call (compiled beforehand)."""
  import jax
  import numpy as np

  from jaxrl.rollout import sampler

  prompts_BxP = np.random.default_rng(0).integers(
    0, cfg.vocab_size, (rows // group, prompt_len), np.int32
  )
  counts_B = np.full((rows // group,), group, np.int32)

  def run(new_tokens: int, greedy: bool, seed: int) -> float:
    start = time.perf_counter()
    out = sampler.generate(
      graphdef,
      params,
      prompts_BxP,
      np.ones_like(prompts_BxP, bool),
      counts_B,
      jax.random.key(seed),
      1.0,
      1.0,
      num_rollouts=rows,
      max_new_tokens=new_tokens,
      eos_id=-1,
      pad_id=0,
      model_cfg=cfg,
      greedy=greedy,
    )  # fmt: skip  (eos -1: no row stops early, every step runs)
    jax.block_until_ready(out)
    return time.perf_counter() - start

  return run


def measure(args) -> dict:
  cfg, graphdef, params = side_by_side.jaxrl_model(args.size, args.vocab)
  points = []
  for rows in args.rows:
    run = _timer(cfg, graphdef, params, rows, args.group, args.prompt_len)
    point = {"rows": rows}
    for mode, greedy in (("sampled", False), ("greedy", True)):
      lengths = (1, 1 + args.steps)
      for n in lengths:
        run(n, greedy, 0)  # compile and warm up
      times = {n: [] for n in lengths}
      for i in range(args.repeats):  # the two lengths alternate: load hits both alike
        for n in lengths:
          times[n].append(run(n, greedy, i))
      short, long = (statistics.median(times[n]) for n in lengths)
      point[mode] = {"prefill_s": short, "step_ms": 1e3 * (long - short) / args.steps}
    points.append(point)
    print(
      f"  {rows:4d} rows: prefill + first draw {point['sampled']['prefill_s'] * 1e3:8.1f} ms, "
      f"decode step {point['sampled']['step_ms']:7.2f} ms sampled / "
      f"{point['greedy']['step_ms']:7.2f} ms greedy",
      flush=True,
    )
  return {
    "size": args.size,
    "vocab": cfg.vocab_size,
    "prompt_len": args.prompt_len,
    "group": args.group,
    "steps": args.steps,
    "repeats": args.repeats,
    "points": points,
    "fit": {mode: _fit(points, mode) for mode in ("sampled", "greedy")},
    "machine": side_by_side.machine(),
  }


def _fit(points: list[dict], mode: str) -> dict:
  """Least-squares step_ms = fixed + per_row · rows over the measured row counts."""
  xs = [p["rows"] for p in points]
  ys = [p[mode]["step_ms"] for p in points]
  if len(xs) < 2:
    return {"fixed_ms": None, "per_row_ms": None}
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
  return {"fixed_ms": my - slope * mx, "per_row_ms": slope}


def main(argv=None):
  args = parse_args(argv)
  print(
    f"{args.size} (vocab {args.vocab or side_by_side.MODEL_SIZES[args.size][-1]}), "
    f"{args.prompt_len}-token prompts in groups of {args.group}, {args.steps} decode steps timed, "
    f"median of {args.repeats}",
    flush=True,
  )
  result = measure(args)
  for mode, fit in result["fit"].items():
    if fit["fixed_ms"] is not None:
      print(f"  {mode}: a decode step ≈ {fit['fixed_ms']:.2f} ms + {fit['per_row_ms']:.4f} ms/row")
  side_by_side.finish(result, args.out)
  print(json.dumps(result["fit"]))


if __name__ == "__main__":
  main()
