"""bench/methods_study.py: cells read from run directories, the summary's numbers, the command of a
cell; fast tests on hand-written runs, and one slow end-to-end study of real tiny runs."""

import json
import os
import shlex

import pytest

from bench import methods_study, study_report
from bench.methods_study import Study

STUDY = Study(root="runs/s", steps=4, eval_every=2, eval_samples=4)


def fake_run(workdir, tokens_T, correct_by_step):
  """A finished run: metrics rows of ``tokens_T`` generated tokens (step 3 logged twice, as a
  resumed run does: the later row counts), and per evaluated step the correct counts of 4
  samples per question, by level."""
  os.makedirs(workdir)
  rows = [
    dict(step=i + 1, generated_tokens=t, step_time=2.0, informative_frac=0.25)
    for i, t in enumerate(tokens_T)
  ]
  rows.insert(2, dict(rows[2], generated_tokens=999.0))  # the row of the run stopped in step 3
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


def _record(method, seed, evals, tokens):
  return dict(
    method=method,
    task="arithmetic",
    seed=seed,
    steps=4,
    tokens=tokens,
    rl_seconds=8.0,
    zero_adv_share=0.5,
    evals=[dict(step=s, tokens=t, num_samples=4, correct=c) for s, t, c in evals],
  )


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
    assert json.loads(f.readlines()[-1]) == records[1]
