"""Evidence for multi-turn rollouts with a tool: ``configs/tiny.py:tools`` (the calculator), the
same in a chat template (``tiny:tools,chat``), and the same task, model and budget without the
tool, over seeds.

  PYTHONPATH=. .venv/bin/python bench/tools_evidence.py --steps 200 --seeds 0 1 2 --jobs 2

Each (setting, seed) is one ``python -m jaxrl.main`` run under --root (a finished run is kept and
not run again, so the command resumes). "no tool" is ``tiny:tools`` with ``task.environment=""``:
its SFT corpus answers every level in the head, its rollouts are single-turn. Writes --out
(markdown) and a PNG beside it:
  - held-out pass@1 per level after SFT and after RL, both settings (mean over seeds, and the
    per-seed range);
  - on the hard levels (rare in the SFT corpus), the share of samples that call the calculator
    and the share solved with a call (``solved_with_call`` of the evaluation);
  - the mean model turns and tool calls per trajectory over training.
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

# setting -> (config, overrides): the tool in raw ids and in a chat template, and no tool
SETTINGS = {
  "tool": ("configs/tiny.py:tools", ()),
  "tool, chat": ("configs/tiny.py:tools,chat", ()),
  "no tool": ("configs/tiny.py:tools", ("task.environment=",)),
}
TOOL_SETTINGS = ("tool", "tool, chat")


def workdir(root: str, setting: str, seed: int) -> str:
  return os.path.join(root, f"{setting.replace(', ', '_').replace(' ', '_')}_s{seed}")


def run(root: str, setting: str, seed: int, steps: int) -> str:
  config, overrides = SETTINGS[setting]
  return tiny_runs.ensure_run(config, workdir(root, setting, seed), seed, steps, None, *overrides)


def _json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _metrics(path: str) -> list[dict]:
  with open(os.path.join(path, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def level_names() -> tuple[list[str], list[str]]:
  """The levels' names in the evaluation's order, and those of the hard levels."""
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  from tiny import TOOLS_HARD_LEVELS, get_config

  from jaxrl.tasks.data.arithmetic import parse_levels

  return [s.name for s in parse_levels(get_config("tools").task.levels)], [
    s.name for s in parse_levels(TOOLS_HARD_LEVELS)
  ]


def _cell(values, scale: float = 100, digits: int = 1) -> str:
  """Mean over seeds (in % by default) with the seeds' range, both to ``digits`` decimals."""
  v = scale * np.asarray(values, float)
  if len(v) == 1:
    return f"{v[0]:.{digits}f}"
  return f"{v.mean():.{digits}f} ({v.min():.{digits}f}–{v.max():.{digits}f})"


def _seeds(values) -> str:
  """Each seed's value, in %."""
  return " / ".join(f"{100 * v:.1f}" for v in values)


def summarize(root: str, seeds, steps: int) -> tuple[str, dict]:
  """The report over the settings whose runs finished for every seed (the others are named)."""
  names, hard_names = level_names()
  hard = [i for i, n in enumerate(names) if n in hard_names]
  settings = [
    s for s in SETTINGS if all(tiny_runs.finished(workdir(root, s, seed), steps) for seed in seeds)
  ]
  missing = [s for s in SETTINGS if s not in settings]
  evals = {
    (setting, when): [
      _json(os.path.join(workdir(root, setting, s), f"eval_{when}.json")) for s in seeds
    ]
    for setting in settings
    for when in ("sft", f"step{steps}")
  }
  after = f"step{steps}"
  lines = [
    f"# Multi-turn rollouts with a calculator: `tiny:tools` with the tool (raw ids, and in a chat "
    f"template: `tiny:tools,chat`) and without it ({steps} RL steps, seeds {list(seeds)})\n",
    f"Held-out pass@1 (%, mean over {len(seeds)} seeds and the seeds' range: with this few seeds "
    "the range is what the data show, not a confidence interval); hard levels (1% of the SFT "
    "corpus each): " + ", ".join(names[i] for i in hard) + ".\n",
    *([f"Not run to the end for every seed here: {', '.join(missing)}.\n"] if missing else []),
    "| level | " + " | ".join(f"{s}, {w}" for s in settings for w in ("SFT", "RL")) + " |",
    "|---" * (1 + 2 * len(settings)) + "|",
  ]
  for key, label in [(str(i), n) for i, n in enumerate(names)] + [("all", "all")]:
    label = f"**{label}**" if key != "all" and int(key) in hard else label
    cells = [
      _cell([e["pass_at"]["1"][key] for e in evals[(setting, when)]])
      for setting in settings
      for when in ("sft", after)
    ]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")

  lines += [
    "\nHeld-out pass@1 over all levels after RL, seed by seed: "
    + "; ".join(
      f"{setting} {_seeds([e['pass_at']['1']['all'] for e in evals[(setting, after)]])}"
      for setting in settings
    )
    + ".\n"
  ]
  tools = [s for s in TOOL_SETTINGS if s in settings]
  for setting in tools:
    lines += _hard_levels(setting, evals, names, hard, after)
  res = {setting: {s: _metrics(workdir(root, setting, s)) for s in seeds} for setting in settings}
  for setting in tools:
    lines += _over_training(setting, res[setting], seeds, steps)
  return "\n".join(lines) + "\n", res


def _hard_levels(setting: str, evals: dict, names, hard, after: str) -> list[str]:
  lines = [
    f"\n## Hard levels solved with a tool call ({setting})\n",
    "Calculator calls per held-out sample; the share of samples that are correct, and that are "
    "correct and called it (%) (mean over seeds and the seeds' range; solved, seed by seed).\n",
    "| level | SFT: calls | SFT: solved | SFT: solved with a call "
    "| RL: calls | RL: solved | RL: solved with a call | RL: solved per seed |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for i in hard:
    cells = []
    for when in ("sft", after):
      tool = evals[(setting, when)]
      cells.append(_cell([e["turns"]["tool_calls"][str(i)] for e in tool], scale=1, digits=2))
      cells.append(_cell([e["pass_at"]["1"][str(i)] for e in tool]))
      cells.append(_cell([e["turns"]["solved_with_call"][str(i)] for e in tool]))
    cells.append(_seeds([e["pass_at"]["1"][str(i)] for e in evals[(setting, after)]]))
    lines.append(f"| {names[i]} | " + " | ".join(cells) + " |")
  return lines


def _over_training(setting: str, res: dict, seeds, steps: int) -> list[str]:
  lines = [
    f"\n## Turns and tool calls per trajectory over training ({setting}, mean over seeds)\n",
    "| steps | turns | tool calls | batch reward |",
    "|---|---|---|---|",
  ]
  tenth = max(steps // 10, 1)
  for start in range(0, steps, tenth):
    end = min(start + tenth, steps)

    def mean(key):
      return np.mean([np.mean([r[key] for r in res[s][start:end]]) for s in seeds])

    turns, calls, reward = mean("turns_mean"), mean("tool_calls_mean"), mean("reward")
    lines.append(f"| {start + 1}–{end} | {turns:.2f} | {calls:.2f} | {reward:.3f} |")
  return lines


def plot(res: dict, seeds, out_png: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
  w = 10
  for setting, rows in res.items():
    ys = np.mean([[r["reward"] for r in rows[s]] for s in seeds], axis=0)
    axes[0].plot(np.convolve(ys, np.ones(w) / w, mode="valid"), label=setting)
  for setting in (s for s in TOOL_SETTINGS if s in res):
    ys = np.mean([[r["tool_calls_mean"] for r in res[setting][s]] for s in seeds], axis=0)
    axes[1].plot(np.convolve(ys, np.ones(w) / w, mode="valid"), label=f"tool calls ({setting})")
  for ax, title in zip(axes, ("batch reward", "per trajectory (tool runs)")):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out_png, dpi=90)


def main():
  args = tiny_runs.evidence_args(200, "runs/tools_evidence", "bench/results/tools.md")
  if not args.summarize_only:
    # The settings with the tool first, seed by seed: the comparison of the two layouts is whole
    # before the runs without the tool start.
    jobs = [(setting, s) for s in args.seeds for setting in TOOL_SETTINGS]
    jobs += [
      (setting, s) for s in args.seeds for setting in SETTINGS if setting not in TOOL_SETTINGS
    ]
    with cf.ThreadPoolExecutor(args.jobs) as pool:
      list(pool.map(lambda job: run(args.root, job[0], job[1], args.steps), jobs))
  text, res = summarize(args.root, args.seeds, args.steps)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)
  plot(res, args.seeds, os.path.splitext(args.out)[0] + ".png")
  print(text)


if __name__ == "__main__":
  main()
