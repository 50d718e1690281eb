"""The methods study's markdown summary (bench/methods_study.py) from its cells' records."""

from __future__ import annotations

import os

import numpy as np

from bench.study_stats import at_budget, bootstrap_ci
from jaxrl.rl.passk import pass_at_k_array

LEVEL = 0.95


def machine(cpuinfo: str = "/proc/cpuinfo") -> str:
  """The CPU model and the vector extensions XLA compiles for (wall times depend on both)."""
  with open(cpuinfo) as f:
    lines = f.read().splitlines()

  def first(key):
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), "")

  flags = set(first("flags").split())
  ext = [f for f in ("avx2", "avx512f") if f in flags] + (
    ["amx"] if any(f.startswith("amx") for f in flags) else []
  )
  cores = sum(ln.startswith("processor") for ln in lines)
  return f"{first('model name') or 'unknown CPU'}, {cores} cores, {', '.join(ext) or 'no AVX2'}"


def scores(evaluation: dict, k: int) -> np.ndarray:
  """Per-question unbiased pass@k of one evaluation."""
  return pass_at_k_array(evaluation["num_samples"], evaluation["correct"], k)


def _ci(values_S, resamples: int) -> str:
  point, lower, upper = bootstrap_ci(values_S, resamples=resamples, level=LEVEL)
  return f"{100 * point:.1f} ({100 * lower:.1f}–{100 * upper:.1f})"


def budgets(recs_MxS: dict) -> dict:
  """Per seed that every method ran: the fewest tokens a method generated (the equal budget)."""
  seeds = set.intersection(*({r["seed"] for r in recs} for recs in recs_MxS.values()))
  return {
    s: min(r["tokens"] for recs in recs_MxS.values() for r in recs if r["seed"] == s)
    for s in sorted(seeds)
  }


def pass1_at(rec: dict, budget: float) -> np.ndarray:
  """The cell's per-question pass@1 after ``budget`` generated tokens, between its evaluations."""
  tokens_E = [e["tokens"] for e in rec["evals"]]
  return at_budget(tokens_E, [scores(e, 1) for e in rec["evals"]], budget)


def task_table(records: list[dict], resamples: int) -> list[str]:
  """One task's table: a row per method (and the SFT start), its cells' seeds pooled."""
  methods = list(dict.fromkeys(r["method"] for r in records))
  recs_MxS = {
    m: sorted((r for r in records if r["method"] == m), key=lambda r: r["seed"]) for m in methods
  }
  ks = [k for k in (1, 8, 32) if all(r["evals"][-1]["num_samples"] >= k for r in records)]
  budget_S = budgets(recs_MxS)
  head = [f"pass@{k}" for k in ks] + [
    "pass@1 at equal tokens",
    "zero-adv. share",
    "tokens generated",
    "RL wall time (s)",
  ]
  lines = [
    "| method | seeds | " + " | ".join(head) + " |",
    "|---|---|" + "---|" * len(head),
  ]
  start = recs_MxS[methods[0]]  # the warm start every method of a seed shares
  cells = [_ci([scores(r["evals"][0], k) for r in start], resamples) for k in ks]
  lines.append(f"| SFT start | {len(start)} | " + " | ".join(cells + ["", "", "", ""]) + " |")
  for m, recs in recs_MxS.items():
    cells = [_ci([scores(r["evals"][-1], k) for r in recs], resamples) for k in ks]
    matched = [pass1_at(r, budget_S[r["seed"]]) for r in recs if r["seed"] in budget_S]
    cells.append(_ci(matched, resamples) if matched else "—")
    cells.append(f"{100 * np.mean([r['zero_adv_share'] for r in recs]):.1f}%")
    cells.append(f"{np.mean([r['tokens'] for r in recs]):,.0f}")
    cells.append(f"{np.mean([r['rl_seconds'] for r in recs]):.0f}")
    lines.append(f"| {m} | {len(recs)} | " + " | ".join(cells) + " |")
  lines.append(
    "\nEqual-token budget per seed (the method that generated fewest tokens): "
    + ", ".join(f"seed {s}: {b:,.0f}" for s, b in budget_S.items())
  )
  return lines


def paired_table(records: list[dict], baseline: str, resamples: int) -> list[str]:
  """Each method against ``baseline`` on the seeds both ran: per seed, the per-question
  differences of the final pass@k and of pass@1 at the seed's equal-token budget (a seed's
  methods share its warm start and held-out questions, so the difference removes what they
  share), bootstrapped as the scores are. Nothing without the baseline's cells."""
  by_seed = {r["seed"]: r for r in records if r["method"] == baseline}
  methods = [m for m in dict.fromkeys(r["method"] for r in records) if m != baseline]
  if not by_seed or not methods:
    return []
  ks = [k for k in (1, 32) if all(r["evals"][-1]["num_samples"] >= k for r in records)]
  recs_MxS = {m: [r for r in records if r["method"] == m] for m in (baseline, *methods)}
  budget_S = budgets(recs_MxS)
  head = [f"Δ pass@{k}" for k in ks] + ["Δ pass@1 at equal tokens"]
  lines = [
    f"\nPaired against `{baseline}` (method − {baseline}, points; seeds both ran):\n",
    "| method | seeds | " + " | ".join(head) + " |",
    "|---|---|" + "---|" * len(head),
  ]
  for m in methods:
    pairs = [(r, by_seed[r["seed"]]) for r in recs_MxS[m] if r["seed"] in by_seed]
    if not pairs:
      continue
    cells = [
      _ci([scores(r["evals"][-1], k) - scores(b["evals"][-1], k) for r, b in pairs], resamples)
      for k in ks
    ]
    matched = [
      pass1_at(r, budget_S[r["seed"]]) - pass1_at(b, budget_S[r["seed"]])
      for r, b in pairs
      if r["seed"] in budget_S
    ]
    cells.append(_ci(matched, resamples) if matched else "—")
    lines.append(f"| {m} | {len(pairs)} | " + " | ".join(cells) + " |")
  return lines


def cell_line(rec: dict) -> str:
  """One cell in a line: held-out pass@1 before and after RL, tokens, RL wall time."""
  before, after = (100 * scores(rec["evals"][i], 1).mean() for i in (0, -1))
  return (
    f"{rec['method']} {rec['task']} seed {rec['seed']}: pass@1 {before:.1f} → {after:.1f} "
    f"after {rec['steps']} steps, {rec['tokens']:,.0f} tokens generated, "
    f"{rec['rl_seconds']:.0f} s of RL steps"
  )


def figure_lines(figures) -> list[str]:
  """A line per figure (paths relative to the summary), named by its file: TASK_PAPER.png."""
  if not figures:
    return []
  lines = ["\n## Figures\n", "Each paper's own per-step metric, mean over seeds, band min–max:\n"]
  return lines + [f"![{os.path.splitext(os.path.basename(p))[0]}]({p})\n" for p in figures]


def machines(records: list[dict]) -> str:
  """Where a task's cells ran: each machine with how many cells ran at once there (records made
  before the records kept it name no machine)."""
  seen = dict.fromkeys((r.get("machine", "unrecorded"), r.get("jobs", "?")) for r in records)
  return "; ".join(f"{m}, {j} run(s) at a time" for m, j in seen)


def report(
  study,
  records: list[dict],
  resamples: int = 2000,
  figures=(),
  findings: str = "",
  baseline: str = "",
) -> str:
  """The whole summary: how it was measured, a table per task (and each method paired against
  ``baseline``), ``findings`` (what the tables mean, written by hand), links to the ``figures``
  (paths relative to the summary), the command of every cell."""
  tasks = list(dict.fromkeys(r["task"] for r in records))
  seeds = sorted({r["seed"] for r in records})
  lines = [
    f"# Methods study: {study.steps} RL steps, seeds {seeds}\n",
    f"Held-out evaluation every {study.eval_every} steps and after the last, "
    f"{study.eval_samples} samples per question at τ = 1: unbiased pass@k per question, the mean "
    "over questions and then over seeds, with its "
    f"{100 * LEVEL:.0f}% bootstrap interval ({resamples} replicates: seeds drawn with replacement, "
    "then each drawn seed's questions with replacement; bench/study_stats.py).\n",
    "Two compute matchings. Equal rollouts per step (the columns pass@k: what the runs do, "
    "batch_questions × group_size rollouts per step; `dapo` draws more rounds per step, "
    "`eepo` and `all` spend a forgetting update): held-out pass@k after the last step. Equal "
    "generated tokens (the column pass@1 at equal tokens): per seed, the budget is the total "
    "`generated_tokens` (every sampled model token, dropped dynamic-sampling rounds included) "
    "of the method that generated fewest; each method's per-question pass@1 is interpolated "
    "linearly between the two evaluations whose cumulative tokens enclose the budget (the SFT "
    "evaluation at 0 tokens), then bootstrapped as above.\n",
    "Zero-adv. share: the trained rollouts in groups whose rewards are all equal (1 − "
    "`informative_frac`), mean over steps and seeds. Tokens generated and RL wall time (the "
    "steps' own `step_time`, without the warm start and the evaluations): mean over seeds.\n",
  ]
  for task in tasks:
    recs = [r for r in records if r["task"] == task]
    lines.append(f"\n## {task}\n")
    lines.append(f"Machine: {machines(recs)}. Wall times compare within one machine.\n")
    lines += task_table(recs, resamples)
    lines += paired_table(recs, baseline, resamples) if baseline else []
  if findings.strip():
    lines += ["\n## Findings\n", findings.strip() + "\n"]
  lines += figure_lines(figures)
  rerun = study.root.rstrip("/") + "-rerun"
  lines += [
    "\n## Rerunning a cell\n",
    f"Each command trains its cell from scratch under `{rerun}` (under the study's own root a "
    "finished cell is read, not trained again) and prints its result line:\n",
    "```",
    *(study.command(r["method"], r["task"], r["seed"], rerun) for r in records),
    "```",
  ]
  return "\n".join(lines) + "\n"
