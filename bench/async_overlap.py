"""Asynchronous rollouts through the vLLM sidecar: RL steps per second with
``rollout.max_staleness`` k = 0, 1, 2, the trainer on one core and the server on the other.

Each run is ``python -m jaxrl.main`` on ``configs/tiny.py`` with the vLLM engine, the trainer
pinned to core 0 (``taskset``: XLA's threads stay there) and the server to core 1
(``vllm.cpus``), from one shared SFT warm start (copied into each workdir, so no run pays for it)
and a minimal held-out evaluation. Runs alternate k = 0, 1, 2 within each repeat. Read from each
run's metrics.jsonl over the steps after ``--skip`` (compilation, first pushes):
- steps/s: (n - 1) / (last - first update end), the loop's own rate;
- generation s/step (the engine's time for a batch), update s/step, trainer idle (waiting for a
  batch) s/step; server idle per step = step interval − generation.
Medians over repeats; ratios against k = 0 pair by pair (same repeat).

  python bench/async_overlap.py --steps 40 --repeats 3 --out bench/results/async_overlap.md
Run it on a quiet machine (nothing else on the two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
  "--config=configs/tiny.py",
  "--config.rollout.engine=vllm",
  "--config.vllm.cpus=1",
  "--config.eval.ks=1",
  "--config.eval.num_samples=1",
  "--config.task.num_heldout_per_level=1",
  "--config.log.plot=False",
  "--config.log.progress=False",
]


def _run(workdir: str, steps: int, k: int, extra=()) -> None:
  cmd = [
    "taskset",
    "-c",
    "0",
    sys.executable,
    "-m",
    "jaxrl.main",
    *COMMON,
    f"--workdir={workdir}",
    f"--config.steps={steps}",
    f"--config.checkpoint.every={steps}",
    f"--config.rollout.max_staleness={k}",
    *extra,
  ]
  env = dict(os.environ, PYTHONPATH=ROOT)
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def _measure(workdir: str, skip: int) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f][skip:]
  n = len(rows)
  span = rows[-1]["wall_time"] - rows[0]["wall_time"]
  mean = lambda key: sum(r[key] for r in rows[1:]) / (n - 1)  # noqa: E731
  interval = span / (n - 1)
  return dict(
    steps_per_s=1 / interval,
    generation_s=mean("rollout_seconds"),
    update_s=mean("update_seconds"),
    trainer_idle_s=mean("rollout_wait_s"),
    server_idle_s=max(interval - mean("rollout_seconds"), 0.0),
    staleness=max(r["rollout_staleness"] for r in rows),
  )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--skip", type=int, default=5)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--ks", default="0,1,2")
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  ks = [int(k) for k in args.ks.split(",")]
  base = tempfile.mkdtemp(prefix="async-overlap-")
  warm = os.path.join(base, "warm")
  _run(warm, 1, 0)  # the shared SFT warm start
  results = {k: [] for k in ks}
  for rep in range(args.repeats):
    for k in ks:
      workdir = os.path.join(base, f"k{k}-r{rep}")
      os.makedirs(workdir)
      shutil.copytree(os.path.join(warm, "sft"), os.path.join(workdir, "sft"))
      _run(workdir, args.steps, k)
      results[k].append(_measure(workdir, args.skip))
      print(f"repeat {rep} k={k}: {results[k][-1]}", flush=True)
      shutil.rmtree(workdir)
  shutil.rmtree(base, ignore_errors=True)
  lines = [
    f"steps={args.steps} (first {args.skip} skipped), repeats={args.repeats}, medians; "
    "trainer on core 0, server on core 1",
    "",
    "| k | steps/s | × k=0 (pairwise median) | generation s/step | update s/step | "
    "trainer idle s/step | server idle s/step |",
    "|---|---|---|---|---|---|---|",
  ]
  med = lambda k, key: statistics.median(r[key] for r in results[k])  # noqa: E731
  for k in ks:
    ratio = statistics.median(
      a["steps_per_s"] / b["steps_per_s"] for a, b in zip(results[k], results[ks[0]])
    )
    lines.append(
      f"| {k} | {med(k, 'steps_per_s'):.3f} | {ratio:.2f} | {med(k, 'generation_s'):.3f} | "
      f"{med(k, 'update_s'):.3f} | {med(k, 'trainer_idle_s'):.3f} | {med(k, 'server_idle_s'):.3f} |"
    )
  table = "\n".join(lines)
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(
        "# Asynchronous rollouts: steps per second (bench/async_overlap.py)\n\n" + table + "\n"
      )
      f.write("\nraw:\n\n```\n" + json.dumps(results, indent=1) + "\n```\n")


if __name__ == "__main__":
  main()
