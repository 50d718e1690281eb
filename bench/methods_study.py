"""The methods study: baselines and the four papers' methods × seeds × tasks on the tiny model,
with 95% bootstrap intervals, at equal rollouts per step and at equal generated tokens.

  PYTHONPATH=. .venv/bin/python bench/methods_study.py --steps 200 --jobs 2
  PYTHONPATH=. .venv/bin/python bench/methods_study.py --tasks arithmetic countdown
  PYTHONPATH=. .venv/bin/python bench/methods_study.py --only dapo arithmetic 3   # one cell

Each cell (method, task, seed) is one ``python -m jaxrl.main --config=configs/tiny.py:PRESET``
run under ``--root/TASK/METHOD_sSEED``; the cells of a (task, seed) share one SFT warm start (the
first method's). Every run evaluates held-out pass@k with ``eval.num_samples`` samples per
question (32 by default, for pass@32) every ``--eval-every`` steps, keeping each question's
correct count. A finished cell is summarised as one JSON line in ``--root/cells.jsonl`` and kept:
the command resumes (a stopped run resumes from its checkpoint). ``--out`` gets the markdown
summary (study_report.py), beside it the JSON lines of the study's cells and, in ``STEM_figures/``,
one figure per paper and task of the paper's own per-step metric (study_figures.py); the summary
includes ``STEM_findings.md``, what the tables mean, written by hand, when it exists.

Methods (``METHODS``): ``grpo`` is plain GRPO, the loss's denominator counting every token
(``loss.informative_only=False``); ``informative_only`` is ``configs/tiny.py:grpo`` as it is (the
denominator counts only the groups with a learning signal: DAPO's filter without resampling);
``dapo`` adds DAPO's dynamic sampling (``rollout.dynamic_sampling``: rounds until B informative
groups); ``e3``, ``dynamo``, ``eepo``, ``es`` and ``all`` are the presets of ``configs/tiny.py``.
Every method but ``grpo`` keeps the presets' informative-only denominator, so its matched
baseline (``BASELINE``) is ``informative_only``: the summary pairs each method against it, seed by
seed (``grpo`` then measures the denominator alone).
Two more methods bound what ES's controller can reach: ``es_floor`` and ``es_ceiling`` are the
``es`` preset with ε_high fixed (``clip.method=fixed``, ``loss.eps_high``) at the preset's
``clip.c_min`` / ``clip.c_max``. The entropies they reach are the feasible range: a target outside
it cannot be tracked however the controller steers. Two more ablate EEPO: ``eepo_fires`` (its
gate fires every step) and ``eepo_fires_old_from_policy`` (and stage 2's ℓ_old is from θ, not θ').
These four are not run by default, and are summarised apart (each table's equal-token budget is
its own methods' fewest tokens):

  PYTHONPATH=. .venv/bin/python bench/methods_study.py --methods grpo informative_only es \
    es_floor es_ceiling --seeds 0 1 2 --out bench/results/methods_study_es.md
  PYTHONPATH=. .venv/bin/python bench/methods_study.py --methods grpo informative_only eepo \
    eepo_fires eepo_fires_old_from_policy --seeds 0 1 2 --out bench/results/methods_study_eepo.md

Tasks (``TASKS``): the arithmetic task, and ``countdown`` (the variant ``configs/tiny.py:…,countdown``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import glob
import json
import math
import os
import re
import shlex
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import study_figures, study_report, tiny_runs  # noqa: E402
from bench.study_stats import cumulative_tokens  # noqa: E402
from jaxrl.workdir.metric_writers import read_jsonl  # noqa: E402

# name -> (configs/tiny.py preset, --config overrides)
METHODS = {
  "grpo": ("grpo", ("loss.informative_only=False",)),
  "informative_only": ("grpo", ()),
  "dapo": ("grpo", ("rollout.dynamic_sampling=True",)),
  "e3": ("e3", ()),
  # DynaMO's own metric: its allocation's gradient variance against uniform allocation at the
  # same budget, measured every 25 steps (the training is bit-identical with it on).
  "dynamo": ("dynamo", ("diagnostics.grad_variance_every=25",)),
  "eepo": ("eepo", ()),
  "es": ("es", ()),
  "all": ("all", ("diagnostics.grad_variance_every=25",)),
  # ε_high fixed at the es preset's clip.c_min / clip.c_max (configs/tiny.py keeps the schema's)
  "es_floor": ("es", ("clip.method=fixed", "loss.eps_high=0.2")),
  "es_ceiling": ("es", ("clip.method=fixed", "loss.eps_high=0.4")),
  # EEPO with its gate firing every step (α above any entropy: the forgetting step's own effect,
  # where the paper's α = 0.3 may never fire), and with stage 2's ℓ_old from θ rather than the
  # rollout copy θ' it was sampled from (the ratio is then 1 on those tokens, not π_θ/π_θ')
  "eepo_fires": ("eepo", ("eepo.alpha=100.0",)),
  "eepo_fires_old_from_policy": ("eepo", ("eepo.alpha=100.0", "eepo.old_logp_from=policy")),
}
BASELINE = "informative_only"  # the loss every other method but grpo keeps
ABLATIONS = ("es_floor", "es_ceiling", "eepo_fires", "eepo_fires_old_from_policy")
DEFAULT_METHODS = [m for m in METHODS if m not in ABLATIONS]
TASKS = {"arithmetic": "", "countdown": "countdown"}  # name -> variant of configs/tiny.py
KS = (1, 8, 32)
CELLS = "cells.jsonl"


@dataclasses.dataclass(frozen=True)
class Study:
  """What every cell of a study shares: where runs go, their length and their evaluation."""

  root: str
  steps: int
  eval_every: int
  eval_samples: int
  variant: str = ""  # one more variant of configs/tiny.py for every cell (a size: "test")
  # name -> (configs/tiny.py preset, --config overrides): the study's arms
  arms: dict = dataclasses.field(default_factory=lambda: METHODS)
  settings: tuple[str, ...] = ()  # --config overrides every cell shares, before its arm's
  script: str = "bench/methods_study.py"  # the command that runs one cell (``command``)
  series_keys: tuple[str, ...] = study_figures.SERIES_KEYS  # per-step metrics a record keeps
  records: str = ""  # where finished cells' records go ("": ROOT/cells.jsonl)

  def config(self, method: str, task: str) -> str:
    parts = [self.arms[method][0], TASKS[task], self.variant]
    return "configs/tiny.py:" + ",".join(p for p in parts if p)

  def overrides(self, method: str) -> tuple[str, ...]:
    ks = ",".join(str(k) for k in KS if k <= self.eval_samples)
    evaluation = (f"eval.num_samples={self.eval_samples}", f"eval.ks={ks}")
    return (*self.settings, *self.arms[method][1], *evaluation, f"eval.every={self.eval_every}")

  def workdir(self, method: str, task: str, seed: int) -> str:
    return os.path.join(self.root, task, f"{method}_s{seed}")

  def command(self, method: str, task: str, seed: int, root: str | None = None) -> str:
    """The command line that runs this one cell (under ``root``: by default this study's)."""
    args = [
      self.script, "--root", root or self.root, "--steps", str(self.steps),
      "--eval-every", str(self.eval_every), "--eval-samples", str(self.eval_samples),
      *(["--variant", self.variant] if self.variant else []), "--only", method, task, str(seed),
    ]  # fmt: skip
    return "PYTHONPATH=. .venv/bin/python " + shlex.join(args)


def run_cell(study: Study, method: str, task: str, seed: int) -> str:
  """Trains the cell unless it is finished, from the warm start of the (task, seed) when one of
  its cells has made it."""
  made = (study.workdir(m, task, seed) for m in study.arms)
  warm = next((w for w in made if os.path.exists(os.path.join(w, "eval_sft.json"))), None)
  workdir = study.workdir(method, task, seed)
  config, overrides = study.config(method, task), study.overrides(method)
  return tiny_runs.ensure_run(config, workdir, seed, study.steps, warm, *overrides)


def cell_key(study: Study, method: str, task: str, seed: int) -> dict:
  """What a cell's record must match to stand for the cell in this study."""
  return dict(
    method=method,
    task=task,
    seed=seed,
    steps=study.steps,
    config=study.config(method, task),
    overrides=list(study.overrides(method)),
  )


def cell_record(study: Study, method: str, task: str, seed: int, jobs: int = 1) -> dict:
  """A finished cell as one JSON line: per evaluation its step, the tokens generated before it and
  each held-out question's correct count (levels in order); the run's generated tokens, RL wall
  time (the steps' own, without evaluation and the warm start) and zero-advantage share; the
  papers' per-step metrics (``step_series``) for the figures; the machine and how many cells ran
  at once (a study's cells may come from several machines: wall times compare within one)."""
  workdir = study.workdir(method, task, seed)
  by_step = {r["step"]: r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))}
  rows = [by_step[s] for s in range(1, study.steps + 1)]  # a resumed run logs a step again
  tokens_T = [r["generated_tokens"] for r in rows]
  names = {0: "eval_sft.json"}
  for path in glob.glob(os.path.join(workdir, "eval_step*.json")):
    step = int(re.fullmatch(r"eval_step(\d+)\.json", os.path.basename(path)).group(1))
    if step <= study.steps:
      names[step] = os.path.basename(path)
  steps = sorted(names)
  evals = []
  for step, tokens in zip(steps, cumulative_tokens(tokens_T, steps)):
    with open(os.path.join(workdir, names[step])) as f:
      questions = json.load(f)["questions"]
    correct = [
      c for lvl in sorted(questions["correct"], key=int) for c in questions["correct"][lvl]
    ]
    evals.append(
      dict(step=step, tokens=float(tokens), num_samples=questions["num_samples"], correct=correct)
    )
  return dict(
    **cell_key(study, method, task, seed),
    tokens=float(sum(tokens_T)),
    rl_seconds=float(sum(r["step_time"] for r in rows)),
    zero_adv_share=1.0 - sum(r["informative_frac"] for r in rows) / len(rows),
    evals=evals,
    series=step_series(rows, study.series_keys),
    machine=study_report.machine(),
    jobs=jobs,
  )


def _value(v) -> float | None:
  """A metric as the record keeps it: 4 significant digits; None for NaN (written "nan") or
  absent."""
  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
    return float(f"{v:.4g}")
  return None


def step_series(rows: list[dict], keys=study_figures.SERIES_KEYS) -> dict:
  """Per metric of ``keys``, its value at each of the steps ``rows`` (1..T); a metric the run
  never gave a value is left out."""
  series = {key: [_value(r.get(key)) for r in rows] for key in keys}
  return {k: v for k, v in series.items() if any(x is not None for x in v)}


class Cells:
  """``root/cells.jsonl``: the records of finished cells, appended as cells finish (by several
  threads)."""

  def __init__(self, study: Study):
    path = study.records or os.path.join(study.root, CELLS)
    self.study, self.path, self.lock = study, path, threading.Lock()
    self.records = read_jsonl(self.path) if os.path.exists(self.path) else []

  def find(self, cell: tuple) -> dict | None:
    key = cell_key(self.study, *cell)
    found = [r for r in self.records if all(r[k] == v for k, v in key.items())]
    return found[-1] if found else None

  def add(self, rec: dict) -> None:
    with self.lock:
      self.records.append(rec)
      with open(self.path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def study_cell(study: Study, cells: Cells, cell: tuple, again: bool = False, jobs: int = 1) -> dict:
  """The cell's record: kept from ``cells`` unless ``again``, else trained (or read) and added."""
  if not again and (rec := cells.find(cell)) is not None:
    return rec
  run_cell(study, *cell)
  rec = cell_record(study, *cell, jobs=jobs)
  cells.add(rec)
  return rec


def run_study(study: Study, methods, tasks, seeds, jobs: int) -> list[dict]:
  """Every cell, ``jobs`` at a time: first one cell per (task, seed), which makes its warm start."""
  cells = Cells(study)
  first = [(methods[0], t, s) for t in tasks for s in seeds]
  rest = [(m, t, s) for t in tasks for s in seeds for m in methods[1:]]
  with cf.ThreadPoolExecutor(jobs) as pool:
    records = list(pool.map(lambda c: study_cell(study, cells, c, jobs=jobs), first))
    records += list(pool.map(lambda c: study_cell(study, cells, c, jobs=jobs), rest))
  return records


def findings(out: str) -> str:
  """The hand-written findings the summary ``out`` carries: ``STEM_findings.md`` beside it ('' if
  there is none), so summarising again keeps them."""
  path = os.path.splitext(out)[0] + "_findings.md"
  if not os.path.exists(path):
    return ""
  with open(path) as f:
    return f.read()


def parse_args(argv=None):
  ap = tiny_runs.evidence_parser(
    200, "runs/methods_study", "bench/results/methods_study.md", seeds=range(5)
  )
  ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
  ap.add_argument("--tasks", nargs="+", default=["arithmetic"], choices=list(TASKS))
  ap.add_argument("--eval-every", type=int, default=50)
  ap.add_argument("--eval-samples", type=int, default=32)
  ap.add_argument("--variant", default="", help="one more configs/tiny.py variant, e.g. test")
  ap.add_argument("--resamples", type=int, default=2000, help="bootstrap replicates")
  ap.add_argument(
    "--only", nargs=3, metavar=("METHOD", "TASK", "SEED"), help="run (or resume) this cell alone"
  )
  args = ap.parse_args(argv)
  os.makedirs(args.root, exist_ok=True)
  return args


def main(argv=None):
  args = parse_args(argv)
  study = Study(args.root, args.steps, args.eval_every, args.eval_samples, args.variant)
  if args.only:
    method, task, seed = args.only
    rec = study_cell(study, Cells(study), (method, task, int(seed)), again=True)
    print(study_report.cell_line(rec))
    return
  if args.summarize_only:
    cells = Cells(study)
    cell_ids = [(m, t, s) for t in args.tasks for s in args.seeds for m in args.methods]
    records = [r for c in cell_ids if (r := cells.find(c)) is not None]
  else:
    records = run_study(study, args.methods, args.tasks, args.seeds, args.jobs)
  out_dir = os.path.dirname(args.out) or "."
  written = study_figures.figures(records, os.path.splitext(args.out)[0] + "_figures")
  figs = [os.path.relpath(p, out_dir) for p in written]  # links relative to the markdown
  text = study_report.report(
    study, records, args.resamples, figs, findings(args.out), baseline=BASELINE
  )
  os.makedirs(out_dir, exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)
  with open(os.path.splitext(args.out)[0] + ".jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  print(text)


if __name__ == "__main__":
  main()
