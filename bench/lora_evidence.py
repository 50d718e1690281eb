"""LoRA against full fine-tuning on the tiny task (configs/tiny.py, GRPO), at equal steps.

  PYTHONPATH=. .venv/bin/python bench/lora_evidence.py --steps 300 --seeds 0 1 2 --jobs 2

Settings: full fine-tuning and LoRA ranks 1, 8, 32 (alpha = 16, every projection). The learning
rate of each setting is chosen on seed 0 from its grid by held-out pass@1 after RL; seeds 1 and 2
then run at that rate. A seed's SFT warm start is computed once (the full fine-tuning run at its
default rate) and shared by every run of the seed (the cache holds the base alone), so all settings
start from the same policy. Resumable: finished runs are skipped. Writes --out (markdown).

Per-step update times here come from runs that may share the machine; the quiet, side-by-side
update and push times are ``bench/lora_timing.py``'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import tiny_runs  # noqa: E402

# setting -> (LoRA rank, learning-rate grid): full fine-tuning's default (3e-4), a third of it and
# 3x it; for LoRA about 10x those, as its best rate is about 10x full fine-tuning's ("LoRA Without
# Regret", Thinking Machines, 2025). Three points each: what this 2-core machine affords.
SETTINGS = {
  "full": (0, (1e-4, 3e-4, 1e-3)),
  "lora r1": (1, (1e-3, 3e-3, 1e-2)),
  "lora r8": (8, (1e-3, 3e-3, 1e-2)),
  "lora r32": (32, (1e-3, 3e-3, 1e-2)),
}
SHARED_SFT = ("full", 3e-4)  # the run that makes each seed's warm start


def _name(setting: str, lr: float, seed: int) -> str:
  return f"{setting.replace(' ', '_')}_lr{lr:g}_s{seed}"


def run(setting: str, lr: float, seed: int, steps: int, root: str) -> str:
  workdir, shared = (
    os.path.join(root, _name(setting, lr, seed)),
    os.path.join(root, _name(*SHARED_SFT, seed)),
  )
  overrides = (f"optim.learning_rate={lr}", f"model.lora.rank={SETTINGS[setting][0]}")
  return tiny_runs.ensure_run("configs/tiny.py", workdir, seed, steps, shared, *overrides)


def _json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def result(workdir: str, steps: int) -> dict:
  """Held-out pass@1 / pass@8 / greedy after RL (and at the warm start), median update time."""
  after, before = (
    _json(os.path.join(workdir, f"eval_step{steps}.json")),
    _json(os.path.join(workdir, "eval_sft.json")),
  )
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    updates = [json.loads(line)["update_seconds"] for line in f]
  return {
    "pass1": after["pass_at"]["1"]["all"],
    "pass8": after["pass_at"]["8"]["all"],
    "greedy": after["greedy"]["all"],
    "sft_pass1": before["pass_at"]["1"]["all"],
    "update_s": float(np.median(updates[1:])),  # step 1 compiles
  }


def best_lr(setting: str, steps: int, root: str) -> float:
  grid = SETTINGS[setting][1]
  scores = [result(os.path.join(root, _name(setting, lr, 0)), steps)["pass1"] for lr in grid]
  return grid[int(np.argmax(scores))]


def _pct(values) -> str:
  v = 100 * np.asarray(values)
  return f"{v.mean():.1f} ({v.min():.1f}–{v.max():.1f})"


def summarize(root: str, seeds, steps: int) -> str:
  grid_width = range(max(len(grid) for _, grid in SETTINGS.values()))
  lines = [
    "# LoRA vs full fine-tuning on the tiny task",
    "",
    f"`configs/tiny.py` (GRPO, {steps} RL steps, 16 questions × 8 rollouts per step, the same "
    "SFT warm start for every setting of a seed), LoRA alpha 16 on q, k, v, o, gate, up, down. "
    f"Held-out pass@1 / pass@8 / greedy accuracy (%) after RL: mean (min–max) over seeds "
    f"{', '.join(map(str, seeds))}. Command: `PYTHONPATH=. .venv/bin/python "
    f"bench/lora_evidence.py --steps {steps} --seeds {' '.join(map(str, seeds))} --jobs 2`.",
    "",
    "| setting | learning rate (tuned on seed 0) | pass@1 | pass@8 | greedy | pass@1 per seed | "
    "update s/step (median) |",
    "|---|---|---|---|---|---|---|",
  ]
  for setting in SETTINGS:
    lr = best_lr(setting, steps, root)
    rows = [result(os.path.join(root, _name(setting, lr, s)), steps) for s in seeds]
    per_seed = ", ".join(f"{100 * r['pass1']:.1f}" for r in rows)
    lines.append(
      f"| {setting} | {lr:g} | {_pct([r['pass1'] for r in rows])} | "
      f"{_pct([r['pass8'] for r in rows])} | {_pct([r['greedy'] for r in rows])} | {per_seed} | "
      f"{np.median([r['update_s'] for r in rows]):.3f} |"
    )
  sft = [result(os.path.join(root, _name(*SHARED_SFT, s)), steps)["sft_pass1"] for s in seeds]
  lines += [
    "",
    f"SFT warm start (before RL), pass@1: {_pct(sft)}. Update s/step: the median over a run's "
    "steps while another run shared the machine; the quiet side-by-side figures are below.",
    "",
    "## Learning-rate search (seed 0, held-out pass@1 after RL)",
    "",
    "| setting | " + " | ".join("lr: pass@1" for _ in grid_width) + " |",
    "|---" * (1 + len(grid_width)) + "|",
  ]
  for setting, (_, grid) in SETTINGS.items():
    cells = [
      f"{lr:g}: {100 * result(os.path.join(root, _name(setting, lr, 0)), steps)['pass1']:.1f}"
      for lr in grid
    ]
    lines.append(f"| {setting} | " + " | ".join(cells) + " |")
  lines += [
    "",
    "The rate is chosen on the figure the table reports for seed 0 (held-out pass@1), so seed 0's "
    "number is the best of its grid; seeds 1 and 2 are not selected on. A pass@1 of 0.0 is a "
    "collapse: every group all-wrong, so GRPO's advantages (and gradients) are zero from then on.",
  ]
  return "\n".join(lines) + "\n"


def main():
  args = tiny_runs.evidence_args(300, "runs/lora_evidence", "bench/results/lora.md")
  if not args.summarize_only:
    with cf.ThreadPoolExecutor(args.jobs) as pool:
      # each seed's shared warm start, then the search on seed 0, then every seed at the best rate
      jobs = [(*SHARED_SFT, seed) for seed in args.seeds]
      list(pool.map(lambda job: run(*job, args.steps, args.root), jobs))
      jobs = [(setting, lr, 0) for setting, (_, grid) in SETTINGS.items() for lr in grid]
      list(pool.map(lambda job: run(*job, args.steps, args.root), jobs))
      best = {setting: best_lr(setting, args.steps, args.root) for setting in SETTINGS}
      jobs = [(setting, best[setting], seed) for setting in SETTINGS for seed in args.seeds]
      list(pool.map(lambda job: run(*job, args.steps, args.root), jobs))
  text = summarize(args.root, args.seeds, args.steps)
  with open(args.out, "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
