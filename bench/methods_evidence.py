"""Evidence for the four papers' methods on the tiny task: every preset × seeds, same rollout budget.

  PYTHONPATH=. .venv/bin/python bench/methods_evidence.py --steps 200 --seeds 0 1 2 --jobs 2

Runs ``python -m jaxrl.main --config=configs/tiny.py:PRESET`` per (preset, seed) under --root (the
SFT warm start of a seed is shared: it does not depend on the preset), then writes --out (markdown
table of the claims of issue "The four papers' methods") and PNG plots beside it. Every run keeps
the same budget: batch_questions × group_size rollouts per step.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys

import numpy as np

PRESETS = ("grpo", "e3", "dynamo", "eepo", "es", "all")
# Not the same budget: the annealing phase doubles G for the last 40% of the steps (section f).
ANNEAL = "e3,anneal"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import tiny_runs  # noqa: E402


def run(preset: str, seed: int, steps: int, root: str) -> str:
  workdir, shared = os.path.join(root, f"{preset}_s{seed}"), os.path.join(root, f"grpo_s{seed}")
  return tiny_runs.ensure_run(f"configs/tiny.py:{preset}", workdir, seed, steps, shared)


def metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def final_eval(workdir: str, steps: int) -> dict:
  with open(os.path.join(workdir, f"eval_step{steps}.json")) as f:
    return json.load(f)


def col(rows, key):
  return np.array([r[key] if isinstance(r.get(key), (int, float)) else np.nan for r in rows], float)


def eval_row(name: str, evals: list[dict]) -> str:
  """One table row: mean held-out pass@1, pass@8, greedy over seeds, and pass@1 per seed."""

  def mean(get) -> str:
    return f"{100 * np.mean([get(e) for e in evals]):.1f}"

  per_seed = ", ".join(f"{100 * e['pass_at']['1']['all']:.1f}" for e in evals)
  pass1 = mean(lambda e: e["pass_at"]["1"]["all"])
  pass8 = mean(lambda e: e["pass_at"]["8"]["all"])
  greedy = mean(lambda e: e["greedy"]["all"])
  return f"| {name} | {pass1} | {pass8} | {greedy} | {per_seed} |"


def summarize(root: str, seeds, steps: int) -> tuple[str, dict]:
  anneal_start = int(0.6 * steps)
  res = {
    p: {s: metrics(os.path.join(root, f"{p}_s{s}")) for s in seeds} for p in PRESETS + (ANNEAL,)
  }
  lines = [
    f"# Methods on the tiny task ({steps} steps, seeds {list(seeds)}, same rollout budget)\n"
  ]

  # (a) E3 temperature: entropy vs H_init before annealing.
  lines.append("## (a) Entropy relative to H_init (step 1), steps before annealing starts\n")
  lines.append(
    "| preset | seed | H_init | min H/H_init | max H/H_init | H/H_init at anneal start |"
  )
  lines.append("|---|---|---|---|---|---|")
  for p in ("grpo", "e3"):
    for s in seeds:
      h = col(res[p][s], "entropy_rollout")
      ratio = h[:anneal_start] / h[0]
      lines.append(
        f"| {p} | {s} | {h[0]:.3f} | {ratio.min():.2f} | {ratio.max():.2f} | {ratio[-1]:.2f} |"
      )
  # (b) EEPO: stage-2 vs stage-1 entropy on gate steps.
  lines.append("\n## (b) EEPO: steps where the gate fired, stage-2 vs stage-1 entropy\n")
  lines.append(
    "| preset | seed | gate fired (steps) | stage-2 > stage-1 on fired steps | mean H2 − H1 (fired) |"
  )
  lines.append("|---|---|---|---|---|")
  for p in ("eepo", "all"):
    for s in seeds:
      r = res[p][s]
      fired = col(r, "eepo_gate") > 0
      d = col(r, "entropy_stage2") - col(r, "entropy_stage1")
      share = float(np.mean(d[fired] > 0)) if fired.any() else float("nan")
      lines.append(
        f"| {p} | {s} | {int(fired.sum())} | {100 * share:.0f}% | "
        f"{np.mean(d[fired]) if fired.any() else float('nan'):+.4f} |"
      )
  # (c) Zero-advantage rollouts.
  lines.append("\n## (c) Fraction of rollouts in zero-advantage groups (mean over steps)\n")
  lines.append("| preset | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |")
  lines.append("|---|" + "---|" * (len(seeds) + 1))
  for p in ("grpo", "e3", "dynamo"):
    v = [float(np.mean(1 - col(res[p][s], "informative_frac"))) for s in seeds]
    lines.append(
      f"| {p} | " + " | ".join(f"{100 * x:.1f}%" for x in v) + f" | {100 * np.mean(v):.1f}% |"
    )
  # (d) Adaptive clip vs its constant target.
  lines.append("\n## (d) Adaptive clip: entropy relative to the constant target after warm-up\n")
  lines.append(
    "| preset | seed | target | steps within ±20% | mean H/target (2nd half) | final ε_high |"
  )
  lines.append("|---|---|---|---|---|---|")
  for p in ("grpo", "es"):
    for s in seeds:
      target = col(res["es"][s], "clip_target")[-1]  # the ES run's schedule, for both rows
      h = col(res[p][s], "entropy_rollout")[5:]
      within = float(np.mean(np.abs(h / target - 1) <= 0.2))
      lines.append(
        f"| {p} | {s} | {target:.3f} | {100 * within:.0f}% | "
        f"{np.mean(h[len(h) // 2 :]) / target:.2f} | {col(res[p][s], 'eps_high')[-1]:.3f} |"
      )
  # (e) Held-out evaluation.
  lines.append(
    "\n## (e) Held-out pass@1 / pass@8 / greedy after RL (mean over seeds; SFT start in the first row)\n"
  )
  lines.append("| preset | pass@1 | pass@8 | greedy | per seed pass@1 |")
  lines.append("|---|---|---|---|---|")
  sft = []
  for s in seeds:
    with open(os.path.join(root, f"grpo_s{s}", "eval_sft.json")) as f:
      sft.append(json.load(f))
  lines.append(eval_row("SFT start", sft))
  for p in PRESETS:
    lines.append(eval_row(p, [final_eval(os.path.join(root, f"{p}_s{s}"), steps) for s in seeds]))
  # (f) The annealing-phase curriculum on top of E3.
  lines.append(
    f"\n## (f) Annealing phase (`{ANNEAL}`): from step {anneal_start + 1}, only the hard half "
    "of the levels, G 8 → 16, max response 8 → 12 tokens (so a larger budget in that phase)\n"
  )
  ev = {
    p: [final_eval(os.path.join(root, f"{p}_s{s}"), steps) for s in seeds] for p in ("e3", ANNEAL)
  }
  levels = [k for k in ev["e3"][0]["pass_at"]["1"] if k != "all"]
  hard = levels[len(levels) // 2 :]
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  from tiny import get_config

  from jaxrl.tasks.data.arithmetic import parse_levels

  names = [spec.name for spec in parse_levels(get_config("").task.levels)]
  lines.append(
    "| preset | pass@1 all | pass@1 hard levels ("
    + ", ".join(names[int(k)] for k in hard)
    + ") | pass@1 easy levels | "
    "pass@8 all | greedy all |"
  )
  lines.append("|---|---|---|---|---|---|")
  for p, evals in ev.items():
    m = lambda ks, n="1": 100 * np.mean([np.mean([e["pass_at"][n][k] for k in ks]) for e in evals])
    lines.append(
      f"| {p} | {m(['all']):.1f} | {m(hard):.1f} | {m(levels[: len(levels) // 2]):.1f} | "
      f"{m(['all'], '8'):.1f} | {100 * np.mean([e['greedy']['all'] for e in evals]):.1f} |"
    )
  return "\n".join(lines) + "\n", res


def plot(res: dict, seeds, out_png: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  keys = [
    ("entropy_rollout", "rollout entropy"),
    ("tau", "τ"),
    ("eps_high", "ε_high"),
    ("informative_frac", "rollouts in informative groups"),
    ("reward", "batch reward"),
  ]
  fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
  for ax, (key, title) in zip(axes, keys):
    for p in PRESETS:
      ys = np.mean([col(res[p][s], key) for s in seeds], axis=0)
      w = 10
      ax.plot(np.convolve(ys, np.ones(w) / w, mode="valid"), label=p, lw=1.3)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out_png, dpi=90)


def main():
  args = tiny_runs.evidence_args(200, "runs/evidence", "bench/results/methods_evidence.md")
  if not args.summarize_only:
    with cf.ThreadPoolExecutor(args.jobs) as pool:  # grpo first: it makes each seed's SFT
      list(pool.map(lambda s: run("grpo", s, args.steps, args.root), args.seeds))
      jobs = [(p, s) for s in args.seeds for p in PRESETS + (ANNEAL,) if p != "grpo"]
      list(pool.map(lambda ps: run(ps[0], ps[1], args.steps, args.root), jobs))
  text, res = summarize(args.root, args.seeds, args.steps)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)
  plot(res, args.seeds, os.path.splitext(args.out)[0] + ".png")
  print(text)


if __name__ == "__main__":
  main()
