"""bench/methods_study2.py and study2_report.py: the second edition's arms are the protocol's, its
calibration, mechanism figures, paired comparisons and verdicts follow bench/study_protocol.md on
records made up here."""

import json
import os
import re
import shlex

import numpy as np
import pytest

from bench import methods_study2, study2_report
from jaxrl.workdir.metric_writers import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 400


def _rec(method, seed, *, correct=(16, 16), series=None, task="countdown"):
  """A cell record: one final evaluation of two questions with ``correct`` of 32 samples right."""
  base = {
    "epoch": [0] * 30 + [1] * (STEPS - 30),
    "alloc_std": [0.0] * STEPS,
    "entropy_rollout": [0.5] * STEPS,
    "clip_frac": [0.0] * STEPS,
  }
  return dict(
    method=method,
    task=task,
    seed=seed,
    steps=STEPS,
    machine="m",
    evals=[dict(step=STEPS, tokens=1.0, num_samples=32, correct=list(correct))],
    series={**base, **(series or {})},
  )


def test_the_arms_are_the_protocols_table():
  with open(os.path.join(ROOT, "bench", "study_protocol.md")) as f:
    text = f.read()
  table = text.split("## Phase B: arms")[1].split("## Metrics")[0]
  named = re.findall(r"^\| `([a-z0-9_]+)` \|", table, re.M)
  assert named == list(methods_study2.phase_b(0.3, 0.5))
  arms = methods_study2.phase_b(0.312, 0.456)
  assert "clip.h_target=0.312" in arms["es"][1] and "eepo.alpha=0.456" in arms["eepo_paper"][1]
  assert "eepo.unlearn_clip=paper" in arms["eepo_paper"][1]
  assert "eepo.unlearn_clip=straight-through" in arms["eepo"][1]
  with_diagnostic = {a for a, (_, o) in arms.items() if methods_study2.DIAGNOSTICS[0] in o}
  assert with_diagnostic == {"dynamo", "dynamo_allocation", "all"}


def test_calibration_takes_the_midpoint_of_the_feasible_range_and_a_tenth_below_early_entropy():
  floor = [_rec("es_floor", s, series={"entropy_rollout": [9.0] * 300 + [0.30 + s / 100] * 100})
           for s in range(3)]  # fmt: skip
  ceiling = [_rec("es_ceiling", s, series={"entropy_rollout": [0.40] * STEPS}) for s in range(3)]
  early = [_rec("baseline", s, series={"entropy_rollout": [1.0 + s] * 50 + [0.1] * 350})
           for s in range(3)]  # fmt: skip
  cal = study2_report.calibrate({"es_floor": floor, "es_ceiling": ceiling, "baseline": early})
  # floor: the last 100 steps only, mean over seeds 0.31; ceiling 0.40; midpoint 0.355
  assert cal["h_floor"] == pytest.approx(0.31) and cal["h_ceiling"] == pytest.approx(0.40)
  assert cal["es_target"] == 0.355 and cal["es_testable"]
  assert cal["baseline_early_median"] == 2.0 and cal["eepo_alpha"] == 1.8  # median of 150 values
  narrow = [_rec("es_ceiling", s, series={"entropy_rollout": [0.315] * STEPS}) for s in range(3)]
  assert not study2_report.calibrate({"es_floor": floor, "es_ceiling": narrow, "baseline": early})[
    "es_testable"
  ]


def test_allocation_counts_only_the_steps_after_the_first_pass():
  std = [1.0] * 30 + [0.0] * 185 + [2.0] * 185  # uneven in the first pass: not counted
  share, spread = study2_report.allocation_acted(_rec("e3", 0, series={"alloc_std": std}))
  assert share == pytest.approx(185 / 370) and spread == 2.0
  share, spread = study2_report.allocation_acted(_rec("baseline", 0))
  assert share == 0.0 and np.isnan(spread)


def test_tracking_error_reads_steps_201_to_400_and_ratios_only_uneven_steps():
  h = [5.0] * 200 + [0.3, 0.5] * 100
  assert study2_report.tracking_error(_rec("es", 0, series={"entropy_rollout": h}), 0.4) == (
    pytest.approx(0.1)
  )
  ratio = [None] * STEPS
  ratio[49], ratio[99] = 0.8, 0.6
  std = [0.0] * STEPS
  std[99] = 1.0  # step 50's counts were uniform: its ratio compares uniform with uniform
  rec = _rec("dynamo", 0, series={"dynamo_grad_var_ratio": ratio, "alloc_std": std})
  np.testing.assert_array_equal(study2_report.grad_var_ratios(rec), [0.6])


def test_primaries_pair_seeds_apply_holm_and_need_the_mechanism_to_act():
  seeds = range(8)
  recs = [_rec("baseline", s, correct=(10, 10)) for s in seeds]
  # E3: +3 to +4 of 32 on both questions every seed: a clear gain
  recs += [_rec("e3", s, correct=(13 + s % 2, 13)) for s in seeds]
  # DynaMO: ±1 around the baseline: no effect
  recs += [_rec("dynamo", s, correct=(10 + (1 if s % 2 else -1), 10)) for s in seeds]
  recs += [_rec("eepo_paper", s, series={"eepo_gate": [0.0] * STEPS}) for s in seeds]
  recs += [_rec("es", s, series={"clip_frac": [0.1] * STEPS}) for s in seeds]
  cal = dict(es_target=0.5, es_testable=True, h_floor=0.4, h_ceiling=0.6)
  prim = study2_report.primaries(recs, cal)
  assert prim["P1"]["seeds"] == list(seeds) and prim["P1"]["rejects"]
  # per seed: pass@1 (13 + s % 2 + 13) / 64 against 20 / 64
  assert prim["P1"]["mean"] == pytest.approx(np.mean([(6 + s % 2) / 64 for s in seeds]))
  assert not prim["P2"]["rejects"]
  assert prim["P1"]["p_holm"] >= prim["P1"]["p"]
  text = "\n".join(study2_report.verdicts(recs, cal))
  assert re.search(r"\| P1 \| `e3` .*\| reproduced \|", text)
  assert re.search(r"\| P2 \| `dynamo` .*\| not reproduced \|", text)
  assert re.search(
    r"\| P3 \| `eepo_paper` .*not testable here \(gate fired on 0.0% of steps\)", text
  )
  # ES: entropy on target in both arms, no difference: testable (clip binds), not reproduced
  assert re.search(r"\| P4 \| `es` .*\| not reproduced \|", text)


def test_a_cells_command_reruns_it_alone():
  st = methods_study2.study("runs/x", "runs/x/cells.jsonl", methods_study2.PHASE_A)
  cmd = methods_study2.command(st, "es_floor", "countdown", 2)
  argv = shlex.split(cmd)[3:]  # after PYTHONPATH=. .venv/bin/python bench/methods_study2.py
  args = methods_study2.parse_args(argv)
  assert (args.phase, args.root, args.only, args.steps) == (
    "run",
    "runs/x",
    ["es_floor", "countdown", "2"],
    400,
  )


def test_the_docs_quote_the_study_as_its_records_say():
  """README.md and docs/methods.md carry the study's numbers as ``report`` renders them from the
  committed records: a record added without rendering again, or an edited number, fails here."""
  results = os.path.join(ROOT, "bench", "results")
  records_path = os.path.join(results, "methods_study2_cells.jsonl")
  records = read_jsonl(records_path) if os.path.exists(records_path) else []
  cal_path = os.path.join(results, "methods_study_calibration.json")
  cal = json.load(open(cal_path)) if os.path.exists(cal_path) else {}
  block = study2_report.quoted(records, cal)
  for doc in methods_study2.QUOTING:
    with open(os.path.join(ROOT, doc)) as f:
      text = f.read()
    assert study2_report.replace_quoted(text, block) == text, doc


def test_the_quoted_verdicts_follow_the_records():
  seeds = range(3)
  recs = [_rec("baseline", s, correct=(10, 10)) for s in seeds]
  recs += [_rec("e3", s, correct=(14, 14 + s)) for s in seeds]
  cal = {
    "countdown": dict(es_target=0.5, es_testable=True, h_floor=0.4, h_ceiling=0.6, eepo_alpha=1.2)
  }
  text = study2_report.quoted(recs, cal)
  assert "ES's target 0.500 (reachable: 0.400–0.600), EEPO's α 1.200" in text
  assert "- **E3** (`e3`, pass@1): Δ +14.1 [" in text  # (8 + s) / 64 over seeds 0–2: 9/64
  assert "3 of 8 seeds so far: no verdict yet." in text  # the rule reads all 8 seeds
  assert "- **DynaMO** (`dynamo`, pass@1): 0 seed(s) so far." in text
  assert study2_report.quoted(recs, {}).startswith("Phase A (calibration) is under way")


def test_compute_counts_the_forgetting_step_and_the_updates_beyond_the_first():
  series = {"generated_tokens": [100.0] * STEPS, "eepo_unlearn_tokens": [0.0, 40.0] * (STEPS // 2)}
  rec = _rec("eepo", 0, series=series)
  assert study2_report.compute(rec) == dict(generated=40000.0, unlearn=8000.0, extra_updates=0.0)
  es = {**_rec("es", 0, series=series), "config": "configs/tiny.py:es,countdown"}
  assert study2_report.compute(es)["extra_updates"] == 20000.0  # the second of 2 mini-batches
  es_baseline = {**_rec("es_baseline", 0, series=series), "overrides": ["loss.mini_batches=2"]}
  assert study2_report.compute(es_baseline)["extra_updates"] == 20000.0
