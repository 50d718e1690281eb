"""The methods study's second edition, run as ``bench/study_protocol.md`` fixes it.

  PYTHONPATH=. .venv/bin/python bench/methods_study2.py calibrate      # phase A, then its numbers
  PYTHONPATH=. .venv/bin/python bench/methods_study2.py run             # phase B (resumes)
  PYTHONPATH=. .venv/bin/python bench/methods_study2.py report          # the summary, any time
  PYTHONPATH=. .venv/bin/python bench/methods_study2.py run --only es countdown 3   # one cell

Cells are ``bench/methods_study.py``'s (one ``python -m jaxrl.main`` run each, under
``--root/TASK/ARM_sSEED``, the cells of a (task, seed) sharing one SFT warm start), with the
protocol's arms and settings: 400 steps, 60 training and 48 held-out questions per level,
32 samples per held-out question evaluated every 100 steps. A finished cell's record (its
evaluations, its per-step metrics in ``SERIES``, its machine and the jobs beside it) is appended to
``--records`` (in ``bench/results/``, so records survive the run directories); a cell found
there is not run again. Phase A's calibration (``calibration``) is written to
``--calibration`` (JSON and markdown) before phase B can start; phase B's arms read it. The
report (``study2_report``) computes every interval and verdict from the records alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import os
import shlex
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import study2_report, study_figures  # noqa: E402
from bench.methods_study import Study, cell_key, cell_record, run_cell  # noqa: E402
from bench.study_report import machine  # noqa: E402
from jaxrl.workdir.metric_writers import read_jsonl  # noqa: E402

# the code every cell of this harness runs (a study runs from one commit, e.g. a worktree of it)
COMMIT = subprocess.run(
  ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
).stdout.strip()
STEPS, EVAL_EVERY, EVAL_SAMPLES = 400, 100, 32
SETTINGS = ("task.num_train_per_level=60", "task.num_heldout_per_level=48")
TASKS = ("countdown", "arithmetic")  # primary, secondary (exploratory)
SEEDS = {"countdown": tuple(range(8)), "arithmetic": tuple(range(5))}
CALIBRATION_SEEDS = (0, 1, 2)
QUOTING = ("README.md", "docs/methods.md")  # the docs whose study numbers ``report`` renders
# DynaMO's own diagnostic, in the arms whose counts can differ from uniform: its allocation's
# gradient variance against uniform allocation at the same budget (training is unchanged by it).
DIAGNOSTICS = ("diagnostics.grad_variance_every=50", "diagnostics.grad_variance_draws=32")
# the per-step metrics a record keeps: the figures' and the protocol's
SERIES = (
  *study_figures.SERIES_KEYS,
  "epoch",
  "alloc_std",
  "clip_frac",
  "eepo_gate",
  "entropy_stage1",
  "entropy_stage2",
  "eepo_unlearn_tokens",
  "generated_tokens",
  "informative_frac",
  "reward",
)

# Phase A: ε_high fixed at the es preset's clip.c_min / clip.c_max bound the entropies ES reaches.
PHASE_A = {
  "baseline": ("grpo", ()),
  "es_floor": ("es", ("clip.method=fixed", "loss.eps_high=0.2")),
  "es_ceiling": ("es", ("clip.method=fixed", "loss.eps_high=0.4")),
}


def phase_b(es_target: float, eepo_alpha: float) -> dict:
  """The protocol's 13 arms on one task, with its calibrated ES target and EEPO gate."""
  eepo = (f"eepo.alpha={eepo_alpha}",)
  es = ("clip.method=adaptive", "clip.schedule=constant", f"clip.h_target={es_target}")
  return {
    "baseline": PHASE_A["baseline"],
    "e3": ("e3", ()),
    "e3_temperature": ("grpo", ("temperature.method=e3",)),
    "e3_allocation": ("grpo", ("allocation.method=e3",)),
    "dynamo": ("dynamo", DIAGNOSTICS),
    "dynamo_allocation": ("grpo", ("allocation.method=dynamo", *DIAGNOSTICS)),
    "dynamo_modulation": ("grpo", ("modulation.enabled=True",)),
    "eepo_paper": ("eepo", ("eepo.unlearn_clip=paper", *eepo)),
    "eepo": ("eepo", ("eepo.unlearn_clip=straight-through", *eepo)),
    "es": ("es", (f"clip.h_target={es_target}",)),
    "es_baseline": ("grpo", ("loss.mini_batches=2",)),
    "dapo": ("grpo", ("rollout.dynamic_sampling=True",)),
    # E3 (allocation and τ) + DynaMO's modulation + EEPO as the paper writes it + ES
    "all": ("all", ("eepo.unlearn_clip=paper", *eepo, *es, "loss.mini_batches=2", *DIAGNOSTICS)),
  }


def study(root: str, records: str, arms: dict, steps: int = STEPS, variant: str = "") -> Study:
  """The protocol's cells of ``arms`` (``steps`` and ``variant``: a shorter, smaller smoke run)."""
  return Study(
    root,
    steps,
    EVAL_EVERY,
    EVAL_SAMPLES,
    variant,
    arms=arms,
    settings=SETTINGS,
    script="bench/methods_study2.py",
    series_keys=SERIES,
    records=records,
  )


def command(st: Study, arm: str, task: str, seed: int) -> str:
  """The command line that reruns this one cell (``run --only``)."""
  extra = ["--steps", str(st.steps)] if st.steps != STEPS else []
  extra += ["--variant", st.variant] if st.variant else []
  args = ["bench/methods_study2.py", "run", "--root", st.root, *extra, "--only", arm, task, seed]
  return "PYTHONPATH=. .venv/bin/python " + shlex.join(map(str, args))


def warm_start_made(root: str, task: str, seed: int) -> bool:
  """Whether a cell of (task, seed) has made the SFT warm start the others copy."""
  return bool(glob.glob(os.path.join(root, task, f"*_s{seed}", "eval_sft.json")))


def run_cells(items: list[tuple[Study, tuple]], jobs: int) -> list[dict]:
  """Each (study, cell) unless its record exists, ``jobs`` at a time, in the order given, except
  that a (task, seed) without a warm start runs one cell alone first (which makes it)."""
  write = threading.Lock()
  known = read_jsonl(items[0][0].records) if os.path.exists(items[0][0].records) else []
  done = {i: rec for i, (st, cell) in enumerate(items) if (rec := _find(known, st, cell))}
  pending = [i for i in range(len(items)) if i not in done]
  starting: set = set()  # (task, seed) whose first cell is making the warm start
  turn = threading.Condition()

  def take() -> int | None:
    with turn:
      while pending:
        for i in pending:
          st, (_, task, seed) = items[i]
          if warm_start_made(st.root, task, seed) or (task, seed) not in starting:
            pending.remove(i)
            if not warm_start_made(st.root, task, seed):
              starting.add((task, seed))
            return i
        turn.wait()
      return None

  def worker():
    while (i := take()) is not None:
      st, cell = items[i]
      try:
        run_cell(st, *cell)
        rec = cell_record(st, *cell, jobs=jobs)
        rec.update(commit=COMMIT, command=command(st, *cell))
        with write, open(st.records, "a") as f:
          f.write(json.dumps(rec) + "\n")
        done[i] = rec
        print(f"finished {cell} on {machine()}", flush=True)
      finally:
        with turn:
          starting.discard(cell[1:])
          turn.notify_all()

  with cf.ThreadPoolExecutor(jobs) as pool:
    for f in [pool.submit(worker) for _ in range(jobs)]:
      f.result()
  return [done[i] for i in sorted(done)]


def _find(records: list[dict], st: Study, cell: tuple) -> dict | None:
  key = cell_key(st, *cell)
  found = [r for r in records if all(r.get(k) == v for k, v in key.items())]
  return found[-1] if found else None


def calibration(records: list[dict], task: str) -> dict:
  """Phase A's two numbers for ``task`` from its records (``study2_report.calibrate``)."""
  mine = [r for r in records if r["task"] == task and r["seed"] in CALIBRATION_SEEDS]
  return study2_report.calibrate({arm: [r for r in mine if r["method"] == arm] for arm in PHASE_A})


def write_calibration(path: str, cal: dict) -> None:
  with open(path + ".json", "w") as f:
    json.dump(cal, f, indent=1)
  with open(path + ".md", "w") as f:
    f.write(study2_report.calibration_text(cal))


def read_calibration(path: str) -> dict:
  if not os.path.exists(path + ".json"):
    raise SystemExit(f"{path}.json is missing: run phase A first (methods_study2.py calibrate)")
  with open(path + ".json") as f:
    return json.load(f)


def arms_for(cal: dict, task: str) -> dict:
  return phase_b(cal[task]["es_target"], cal[task]["eepo_alpha"])


def parse_args(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("phase", choices=("calibrate", "run", "report"))
  ap.add_argument("--root", default="runs/methods_study2")
  ap.add_argument("--records", default="bench/results/methods_study2_cells.jsonl")
  ap.add_argument("--calibration", default="bench/results/methods_study_calibration")
  ap.add_argument("--out", default="bench/results/methods_study2.md")
  ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
  ap.add_argument("--arms", nargs="+", help="phase B's arms to run (default: all 13)")
  ap.add_argument("--seeds", type=int, nargs="+", help="default: the protocol's per task")
  ap.add_argument("--jobs", type=int, default=2)
  ap.add_argument("--only", nargs=3, metavar=("ARM", "TASK", "SEED"))
  ap.add_argument("--steps", type=int, default=STEPS, help="the protocol's; fewer: a smoke run")
  ap.add_argument("--variant", default="", help="a configs/tiny.py size for a smoke run: test")
  return ap.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.root, exist_ok=True)
  if args.phase == "calibrate":
    cells = [
      (study(args.root, args.records, PHASE_A, args.steps, args.variant), (arm, task, seed))
      for task in args.tasks
      for seed in args.seeds or CALIBRATION_SEEDS
      for arm in PHASE_A
    ]
    records = run_cells(cells, args.jobs)
    cal = read_calibration(args.calibration) if os.path.exists(args.calibration + ".json") else {}
    cal.update({t: calibration(records, t) for t in args.tasks})  # a task's own, once
    write_calibration(args.calibration, cal)
    return
  if args.phase == "run" and args.only:  # a phase-A cell too, before the calibration exists
    arm, task, seed = args.only
    cal = read_calibration(args.calibration) if arm not in PHASE_A else None
    arms = {**PHASE_A, **(arms_for(cal, task) if cal else {})}
    run_cells(
      [(study(args.root, args.records, arms, args.steps, args.variant), (arm, task, int(seed)))], 1
    )
    return
  if args.phase == "run":  # seed by seed, primary first: a seed's comparisons complete together
    cal = read_calibration(args.calibration)
    cells = [
      (study(args.root, args.records, arms_for(cal, task), args.steps, args.variant), cell)
      for task in args.tasks
      for seed in args.seeds or SEEDS[task]
      for cell in ((arm, task, seed) for arm in args.arms or arms_for(cal, task))
    ]
    run_cells(cells, args.jobs)
    return
  cal = read_calibration(args.calibration) if os.path.exists(args.calibration + ".json") else {}
  records = read_jsonl(args.records) if os.path.exists(args.records) else []
  # a task not calibrated yet shows its phase-A arms
  arms = {t: arms_for(cal, t) if t in cal else PHASE_A for t in args.tasks}
  text = study2_report.report(records, cal, arms)
  with open(args.out, "w") as f:
    f.write(text)
  for doc in QUOTING:  # the docs quote the records' numbers, rendered here
    with open(os.path.join(ROOT, doc)) as f:
      old = f.read()
    with open(os.path.join(ROOT, doc), "w") as f:
      f.write(study2_report.replace_quoted(old, study2_report.quoted(records, cal)))
  print(text)


if __name__ == "__main__":
  main()
