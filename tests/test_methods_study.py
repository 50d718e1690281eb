"""bench/methods_study.py: cells read from run directories (with the papers' per-step metrics), the
summary's numbers, its figures (bench/study_figures.py), the command of a cell, the methods' configs;
fast tests on hand-written runs, and one slow end-to-end study of real tiny runs."""

import dataclasses
import json
import os
import shlex

import pytest
from run_helpers import tiny_config

from bench import methods_study, study_figures, study_report
from bench.methods_study import Study
from jaxrl.methods.registry import CLIPS

STUDY = Study(root="runs/s", steps=4, eval_every=2, eval_samples=4)


def fake_run(workdir, tokens_T, correct_by_step, metrics_T=None):
  """A finished run: metrics rows of ``tokens_T`` generated tokens and the step's ``metrics_T``
  (step 3 logged twice, as a resumed run does: the later row counts), and per evaluated step the
  correct counts of 4 samples per question, by level."""
  os.makedirs(workdir)
  rows = [
    dict(step=i + 1, generated_tokens=t, step_time=2.0, informative_frac=0.25, **m)
    for i, (t, m) in enumerate(zip(tokens_T, metrics_T or [{}] * len(tokens_T)))
  ]
  rows.insert(
    2, dict(rows[2], generated_tokens=999.0, frac_all_wrong=0.999)
  )  # the row of the run stopped in step 3
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  for step, correct in correct_by_step.items():
    name = "eval_sft.json" if step == 0 else f"eval_step{step}.json"
    with open(os.path.join(workdir, name), "w") as f:
      json.dump({"questions": {"num_samples": 4, "correct": correct}}, f)


def test_cell_record_reads_tokens_evaluations_and_step_metrics(tmp_path):
  study = Study(str(tmp_path), 4, 2, 4)
  workdir = study.workdir("dapo", "arithmetic", 1)
  # Levels "10" and "2" in JSON: ordered as numbers, not as strings.
  fake_run(
    workdir, [10.0, 20.0, 30.0, 40.0], {0: {"10": [1], "2": [0, 4]}, 4: {"10": [3], "2": [2, 4]}}
  )
  rec = methods_study.cell_record(study, "dapo", "arithmetic", 1)
  assert rec["config"] == "configs/tiny.py:grpo"
  assert rec["overrides"] == [
    "rollout.dynamic_sampling=True",
    "eval.num_samples=4",
    "eval.ks=1",
    "eval.every=2",
  ]
  assert rec["tokens"] == 100.0 and rec["rl_seconds"] == 8.0 and rec["zero_adv_share"] == 0.75
  assert rec["evals"] == [
    dict(step=0, tokens=0.0, num_samples=4, correct=[0, 4, 1]),
    dict(step=4, tokens=100.0, num_samples=4, correct=[2, 4, 3]),
  ]


def _record(method, seed, evals, tokens, series=None, task="arithmetic", num_samples=4):
  rec = dict(
    method=method,
    task=task,
    seed=seed,
    steps=4,
    tokens=tokens,
    rl_seconds=8.0,
    zero_adv_share=0.5,
    evals=[dict(step=s, tokens=t, num_samples=num_samples, correct=c) for s, t, c in evals],
  )
  return rec if series is None else dict(rec, series=series)


def test_cell_record_keeps_the_papers_per_step_metrics(tmp_path):
  """Rounded to 4 significant digits; NaN (written "nan") and steps without the metric as None;
  metrics the run never gave a value (never logged, NaN throughout) left out."""
  study = Study(str(tmp_path), 4, 2, 4)
  metrics_T = [
    dict(frac_all_wrong=0.5, eepo_entropy_ratio="nan", clip_target="nan"),
    dict(frac_all_wrong=0.123456, eepo_entropy_ratio=1.5, clip_target="nan"),
    dict(frac_all_wrong=0.25, eepo_entropy_ratio="nan", clip_target="nan"),
    dict(frac_all_wrong=0.0, eepo_entropy_ratio=0.9, clip_target="nan"),
  ]
  metrics_T[1]["dynamo_grad_var_ratio"] = 0.75  # measured on step 2 only
  fake_run(
    study.workdir("eepo", "arithmetic", 0), [1.0] * 4, {0: {"1": [1]}, 4: {"1": [2]}}, metrics_T
  )
  rec = methods_study.cell_record(study, "eepo", "arithmetic", 0)
  assert rec["series"] == {
    "frac_all_wrong": [0.5, 0.1235, 0.25, 0.0],
    "dynamo_grad_var_ratio": [None, 0.75, None, None],
    "eepo_entropy_ratio": [None, 1.5, None, 0.9],
  }
  json.dumps(rec, allow_nan=False)  # a plain JSON line


def _series(steps=4, **values):
  """A record's ``series``: each metric constant over ``steps`` steps (None: NaN)."""
  return {k: [v] * steps for k, v in values.items()}


def _evals(correct_end):
  return [(0, 0.0, [8, 8]), (4, 100.0, correct_end)]


def figure_records() -> list[dict]:
  """Two seeds of every method whose paper has a figure, on arithmetic; on countdown an e3 cell
  and an older record without series."""
  e3 = dict(frac_all_wrong=0.3, entropy_rel_init=0.9)
  es = dict(entropy_rollout=0.3, clip_target=0.25, clip_saturated=1.0, eps_high=0.4)
  cells = {
    "grpo": dict(frac_all_wrong=0.4, eps_high=0.28),
    "e3": e3,
    "dynamo": dict(frac_all_wrong=0.4, dynamo_grad_var_ratio=0.8),
    "eepo": dict(frac_all_wrong=0.4, eepo_entropy_ratio=1.2),
    "es": es,
    "es_floor": dict(entropy_rollout=0.2, eps_high=0.2),
    "es_ceiling": dict(entropy_rollout=0.35, eps_high=0.4),
  }
  records = [
    _record(m, s, _evals([16, 8 + s]), 100.0, _series(**v), num_samples=32)
    for m, v in cells.items()
    for s in (0, 1)
  ]
  records[-1]["series"]["entropy_rollout"][1] = None  # a step a seed has no value on
  return records + [
    _record("e3", 0, _evals([16, 8]), 100.0, _series(**e3), task="countdown", num_samples=32),
    _record("grpo", 0, _evals([16, 8]), 100.0, task="countdown", num_samples=32),
  ]


def test_figures_are_drawn_for_the_papers_whose_metrics_the_records_carry(tmp_path):
  out = str(tmp_path / "figs")
  written = study_figures.figures(figure_records(), out)
  names = ["arithmetic_e3", "arithmetic_dynamo", "arithmetic_eepo", "arithmetic_es", "countdown_e3"]
  assert written == [os.path.join(out, n + ".png") for n in names]
  for path in written:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert study_figures.seed_stats(figure_records(), "es_ceiling", "entropy_rollout")[1][1] == 0.35


def test_older_records_without_series_report_and_draw_nothing(tmp_path):
  old = [_record(m, 0, _evals([16, c]), 100.0, num_samples=32) for m, c in (("grpo", 8), ("e3", 9))]
  assert study_figures.figures(old, str(tmp_path / "figs")) == []
  assert not os.path.exists(tmp_path / "figs")
  text = study_report.report(STUDY, old, resamples=10)
  assert "| e3 | 1 |" in text and "## Figures" not in text


def test_the_summary_links_the_figures_and_carries_the_findings_written_beside_it(tmp_path):
  """--summarize-only over hand-written cells: the figures in STEM_figures/, a line per figure."""
  study = Study(str(tmp_path / "study"), 4, 2, 4)
  cells = methods_study.Cells(study)
  for method, ratio in (("grpo", "nan"), ("e3", 0.8)):
    metrics_T = [dict(frac_all_wrong=0.5, entropy_rel_init=ratio)] * 4
    fake_run(
      study.workdir(method, "arithmetic", 0), [1.0] * 4, {0: {"1": [1]}, 4: {"1": [2]}}, metrics_T
    )
    cells.add(methods_study.cell_record(study, method, "arithmetic", 0))
  out = str(tmp_path / "out" / "study.md")
  os.makedirs(tmp_path / "out")
  with open(tmp_path / "out" / "study_findings.md", "w") as f:
    f.write("E3 keeps its entropy.\n")
  methods_study.main([
    "--root", study.root, "--out", out, "--steps", "4", "--eval-every", "2", "--eval-samples", "4",
    "--methods", "grpo", "e3", "--seeds", "0", "--summarize-only",
  ])  # fmt: skip
  assert os.path.exists(tmp_path / "out" / "study_figures" / "arithmetic_e3.png")
  text = open(out).read()
  assert "![arithmetic_e3](study_figures/arithmetic_e3.png)" in text
  assert "## Findings\n\nE3 keeps its entropy.\n" in text  # the hand-written file, kept
  assert "dynamo" not in text.split("## Figures")[1].split("##")[0]


def test_the_ablations_change_one_setting_of_their_preset_and_run_only_when_asked(tmp_path):
  assert methods_study.parse_args(["--root", str(tmp_path)]).methods == [
    "grpo", "informative_only", "dapo", "e3", "dynamo", "eepo", "es", "all",
  ]  # fmt: skip
  es = tiny_config("es").clip
  for method, bound in (("es_floor", es.c_min), ("es_ceiling", es.c_max)):
    preset, overrides = methods_study.METHODS[method]
    assert (preset, overrides) == ("es", ("clip.method=fixed", f"loss.eps_high={bound}"))
    cfg = tiny_config(
      "es", **{"clip.method": "fixed", "loss.eps_high": float(overrides[1].split("=")[1])}
    )
    clip = CLIPS[cfg.clip.method](cfg.clip, eps_high=cfg.loss.eps_high, steps=cfg.steps)
    assert float(clip.current(clip.init())) == pytest.approx(bound)  # a fixed clip is eps_high
    assert cfg.loss.mini_batches == tiny_config("es").loss.mini_batches  # the rest is es's
  eepo = tiny_config("eepo").eepo
  for method, changed in (
    ("eepo_fires", dict(alpha=100.0)),
    ("eepo_fires_old_from_policy", dict(alpha=100.0, old_logp_from="policy")),
  ):
    preset, overrides = methods_study.METHODS[method]
    fields = {f"eepo.{k}": v for k, v in changed.items()}
    assert preset == "eepo" and overrides == tuple(f"{k}={v}" for k, v in fields.items())
    assert tiny_config(preset, **fields).eepo == dataclasses.replace(eepo, **changed)


def test_report_matches_pass_at_k_and_the_equal_token_budget():
  """Two questions alike, one seed (the intervals collapse to the value). ``short`` generates 150
  tokens and ends with every sample right; ``long`` generates 200, half its samples right up to
  100 tokens and all at 200: at the equal budget of 150 tokens, halfway, pass@1 is 75%."""
  short = _record("short", 0, [(0, 0.0, [2, 2]), (4, 150.0, [4, 4])], 150.0)
  long = _record("long", 0, [(0, 0.0, [2, 2]), (2, 100.0, [2, 2]), (4, 200.0, [4, 4])], 200.0)
  text = study_report.report(STUDY, [short, long], resamples=100)
  assert "| SFT start | 1 | 50.0 (50.0–50.0) |" in text
  assert "| short | 1 | 100.0 (100.0–100.0) | 100.0 (100.0–100.0) | 50.0% | 150 | 8 |" in text
  assert "| long | 1 | 100.0 (100.0–100.0) | 75.0 (75.0–75.0) | 50.0% | 200 | 8 |" in text
  assert "seed 0: 150" in text
  assert STUDY.command("long", "arithmetic", 0, "runs/s-rerun") in text


def test_methods_are_paired_against_the_baseline_seed_by_seed():
  """Per seed, the per-question differences. Seed 0: ``m`` gains 1/4 on each of two questions
  (Δ 25 points); seed 1: it loses 2/4 on one, gains 2/4 on the other (Δ 0): the mean is 12.5.
  Resampling seeds and then questions, a replicate lies between −50 (seed 1 twice, its loss drawn
  for every question) and 50. A seed the baseline did not run is left out of the pairs; without
  the baseline there is no table."""
  base = [_record("b", s, [(0, 0.0, [2, 2]), (4, 10.0, [2, 2])], 10.0) for s in (0, 1)]
  m = [
    _record("m", 0, [(0, 0.0, [2, 2]), (4, 10.0, [3, 3])], 10.0),
    _record("m", 1, [(0, 0.0, [2, 2]), (4, 10.0, [0, 4])], 10.0),
    _record("m", 2, [(0, 0.0, [2, 2]), (4, 10.0, [4, 4])], 10.0),
  ]
  lines = study_report.paired_table(base + m, "b", resamples=400)
  assert lines[0].startswith("\nPaired against `b`")
  assert lines[1] == "| method | seeds | Δ pass@1 | Δ pass@1 at equal tokens |"
  row = lines[3].removesuffix(" |").split(" | ")
  assert row[:2] == ["| m", "2"] and row[2] == row[3]  # equal tokens: the final evaluation
  point, interval = row[2].split(" ", 1)
  lower, upper = map(float, interval.strip("()").split("–"))
  assert float(point) == 12.5 and -50.0 <= lower < 12.5 < upper <= 50.0
  assert study_report.paired_table(m, "b", resamples=10) == []
  text = study_report.report(STUDY, base + m, resamples=10, baseline="b")
  assert "Paired against `b`" in text and "Paired" not in study_report.report(STUDY, base + m)


def test_each_task_names_the_machines_its_cells_ran_on():
  """A study may be run in parts on different machines: each task's section names its own, so
  wall times are compared only within one."""
  evals = [(0, 0.0, [2, 2]), (4, 10.0, [4, 4])]
  a = dict(_record("grpo", 0, evals, 10.0), machine="CPU A, 2 cores, avx2", jobs=2)
  b = dict(_record("e3", 0, evals, 10.0), machine="CPU B, 2 cores, avx2, avx512f", jobs=1)
  c = dict(_record("grpo", 0, evals, 10.0, task="countdown"), machine="CPU B, 2 cores", jobs=2)
  text = study_report.report(STUDY, [a, b, c], resamples=10)
  arithmetic, countdown = text.split("## arithmetic")[1].split("## countdown")
  both = "CPU A, 2 cores, avx2, 2 run(s) at a time; CPU B, 2 cores, avx2, avx512f, 1 run(s) at a"
  assert f"Machine: {both} time." in arithmetic
  assert "Machine: CPU B, 2 cores, 2 run(s) at a time." in countdown
  assert "Machine: unrecorded" in study_report.report(STUDY, [_record("m", 0, evals, 1.0)])


def test_report_adds_pass_at_k_for_every_k_the_samples_allow():
  rec = _record("m", 0, [(0, 0.0, [0, 2]), (4, 10.0, [1, 2])], 10.0)
  rec["evals"] = [dict(e, num_samples=32) for e in rec["evals"]]
  head = next(
    ln for ln in study_report.report(STUDY, [rec]).splitlines() if ln.startswith("| method")
  )
  assert head.startswith("| method | seeds | pass@1 | pass@8 | pass@32 | pass@1 at equal tokens |")


def test_a_cells_command_parses_back_to_its_study_and_cell():
  study = Study("runs/x", 200, 50, 32, variant="test")
  argv = shlex.split(study.command("e3", "countdown", 3))[3:]
  args = methods_study.parse_args(argv)
  assert Study(args.root, args.steps, args.eval_every, args.eval_samples, args.variant) == study
  assert args.only == ["e3", "countdown", "3"]
  assert study.config("e3", "countdown") == "configs/tiny.py:e3,countdown,test"
  assert study.config("grpo", "arithmetic") == "configs/tiny.py:grpo,test"


def test_machine_names_the_cpu_and_its_vector_extensions(tmp_path):
  cpuinfo = tmp_path / "cpuinfo"
  entry = "processor\t: {}\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_tile\n\n"
  cpuinfo.write_text(entry.format(0) + entry.format(1))
  assert study_report.machine(str(cpuinfo)) == "Some Xeon, 2 cores, avx2, avx512f, amx"


@pytest.mark.slow  # about 60 s on 2 busy cores: two tiny runs of two steps, three evaluations each
def test_a_study_runs_resumes_and_reruns_one_cell(tmp_path):
  """Two methods × one seed of configs/tiny.py:test, 32 samples per held-out question: the cells
  sharing one warm start, the summary and its JSON lines; a second call reads the finished cells
  (nothing trained); --only re-reads the cell from its run directory."""
  root, out = str(tmp_path / "study"), str(tmp_path / "study.md")
  argv = ["--root", root, "--out", out, "--steps", "2", "--eval-every", "1", "--variant", "test"]
  argv += ["--methods", "grpo", "es", "--seeds", "0"]
  methods_study.main(argv)
  with open(os.path.join(root, "cells.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [(r["method"], [e["step"] for e in r["evals"]]) for r in records] == [
    ("grpo", [0, 1, 2]),
    ("es", [0, 1, 2]),
  ]
  sft = [r["evals"][0] for r in records]
  assert sft[0] == sft[1] and sft[0]["num_samples"] == 32  # the shared warm start, evaluated once
  assert all(r["tokens"] == r["evals"][-1]["tokens"] > 0 for r in records)
  text = open(out).read()
  assert "| grpo | 1 |" in text and "| es | 1 |" in text and "pass@32" in text
  mtime = os.path.getmtime(os.path.join(root, "arithmetic", "es_s0", "metrics.jsonl"))
  methods_study.main(argv)
  assert open(out).read().split("## arithmetic")[1] == text.split("## arithmetic")[1]
  methods_study.main(argv[:-5] + ["--only", "es", "arithmetic", "0"])
  assert os.path.getmtime(os.path.join(root, "arithmetic", "es_s0", "metrics.jsonl")) == mtime
  with open(os.path.join(root, "cells.jsonl")) as f:
    again = json.loads(f.readlines()[-1])
  assert again == dict(records[1], jobs=1)  # the same record, from a cell run alone
