"""The packed update against the padded one on the embedded default (``make run``) and its
presets, over seeds.

  PYTHONPATH=. .venv/bin/python bench/packing_outcome.py --seeds 0 1 2 --jobs 2
  PYTHONPATH=. .venv/bin/python bench/packing_outcome.py --config configs/tiny.py:e3

Protocol (fixed before the runs): ``configs/tiny.py`` at its defaults (300 RL steps), or one of its
presets (``--config configs/tiny.py:PRESET``: runs under ``--root``/PRESET, the table in
``results/packing_outcome_PRESET.md``; the presets change no SFT setting, so every run of a seed
starts RL from ``make run``'s packed run's warm start), once with
``loss.packing=true`` (the default) and once with ``loss.packing=false``, for each seed; a seed's
two runs share its SFT warm start (the packed run computes it), so they start RL from the same
policy and differ only in the update's layout, which changes float rounding and nothing else
(tests/test_packing.py). Metrics: held-out pass@1, pass@8 and greedy accuracy over all levels after
RL. Decision rule: the packed update leaves the outcome unchanged when, for each metric, the mean
over seeds of the packed runs lies within the padded runs' range over seeds (min–max). Per-seed
differences are reported beside it. Update seconds are medians over a run's steps while another
run may share the machine: indicative only (``bench/padding.py`` has the quiet ratios).
Resumable: finished runs are skipped. Writes --out (markdown) and the runs' figures as JSON lines
beside it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import lora_evidence, tiny_runs  # noqa: E402
from bench.study_report import machine  # noqa: E402

ARMS = {"packed": "loss.packing=true", "padded": "loss.packing=false"}
METRICS = ("pass1", "pass8", "greedy")
STEPS = 300  # configs/tiny.py's


DEFAULT = "configs/tiny.py"


def run(config: str, arm: str, seed: int, steps: int, root: str, warm_root: str) -> str:
  workdir = os.path.join(root, f"{arm}_s{seed}")
  shared = os.path.join(warm_root, f"packed_s{seed}")
  warm = None if workdir == shared else shared
  return tiny_runs.ensure_run(config, workdir, seed, steps, warm, ARMS[arm])


def verdict(by_arm: dict[str, list[dict]]) -> dict[str, bool]:
  """Per metric: the packed runs' mean over seeds within the padded runs' min–max."""
  out = {}
  for m in METRICS:
    padded = [r[m] for r in by_arm["padded"]]
    mean = float(np.mean([r[m] for r in by_arm["packed"]]))
    out[m] = min(padded) <= mean <= max(padded)
  return out


def summarize(by_arm: dict[str, list[dict]], seeds, steps: int, config: str = DEFAULT) -> str:
  def pct(values):
    v = 100 * np.asarray(values)
    return f"{v.mean():.1f} ({v.min():.1f}–{v.max():.1f})"

  ok = verdict(by_arm)
  lines = [
    f"# The packed update and {'`make run`' if config == DEFAULT else f'`{config}`'}'s outcome",
    "",
    f"`{config}` ({steps} RL steps), `loss.packing` true and false, seeds "
    f"{', '.join(map(str, seeds))}, each seed's two runs from one SFT warm start. Held-out accuracy "
    "(%) over all levels after RL: mean (min–max) over seeds. Rule (bench/packing_outcome.py): "
    "unchanged when the packed mean lies within the padded range, metric by metric. Machine: "
    f"{machine()}. Command: `PYTHONPATH=. .venv/bin/python bench/packing_outcome.py "
    + (f"--config {config} " if config != DEFAULT else "")
    + f"--seeds {' '.join(map(str, seeds))}`.",
    "",
    "| arm | pass@1 | pass@8 | greedy | pass@1 per seed | update s/step (median, shared machine) |",
    "|---|---|---|---|---|---|",
  ]
  for arm, rows in by_arm.items():
    per_seed = ", ".join(f"{100 * r['pass1']:.1f}" for r in rows)
    update = np.median([r["update_s"] for r in rows])
    cells = " | ".join(pct([r[m] for r in rows]) for m in METRICS)
    lines.append(f"| {arm} | {cells} | {per_seed} | {update:.3f} |")
  diffs = {m: [100 * (a[m] - b[m]) for a, b in zip(*by_arm.values())] for m in METRICS}
  lines += [
    "",
    "Packed − padded per seed (points): "
    + "; ".join(f"{m} " + ", ".join(f"{d:+.1f}" for d in diffs[m]) for m in METRICS)
    + ".",
    "",
    "Verdict: "
    + ", ".join(f"{m} {'within' if ok[m] else 'OUTSIDE'} the padded range" for m in METRICS)
    + f" → **{'unchanged' if all(ok.values()) else 'changed'}**.",
  ]
  return "\n".join(lines) + "\n"


def parse_args():
  parser = tiny_runs.evidence_parser(
    STEPS, "runs/packing_outcome", "bench/results/packing_outcome.md"
  )
  parser.add_argument("--config", default=DEFAULT, help="configs/tiny.py or configs/tiny.py:PRESET")
  args = parser.parse_args()
  args.warm_root = args.root  # make run's packed runs make each seed's warm start
  if args.config != DEFAULT:  # a preset's runs and table apart from make run's
    preset = args.config.partition(":")[2]
    args.root = os.path.join(args.root, preset)
    stem, ext = os.path.splitext(args.out)
    args.out = f"{stem}_{preset}{ext}"
  os.makedirs(args.root, exist_ok=True)
  return args


def main() -> None:
  args = parse_args()
  if not args.summarize_only:
    for arm in ARMS:  # the packed runs first: make run's make each seed's warm start
      with cf.ThreadPoolExecutor(args.jobs) as pool:
        jobs = [
          pool.submit(run, args.config, arm, s, args.steps, args.root, args.warm_root)
          for s in args.seeds
        ]
        for f in jobs:
          f.result()
  by_arm = {
    arm: [
      lora_evidence.result(os.path.join(args.root, f"{arm}_s{s}"), args.steps) for s in args.seeds
    ]
    for arm in ARMS
  }
  with open(args.out, "w") as f:
    f.write(summarize(by_arm, args.seeds, args.steps, args.config))
  with open(os.path.splitext(args.out)[0] + ".jsonl", "w") as f:
    for arm, rows in by_arm.items():
      for seed, r in zip(args.seeds, rows):
        f.write(json.dumps({"arm": arm, "seed": seed, "steps": args.steps, **r}) + "\n")
  print(open(args.out).read())


if __name__ == "__main__":
  main()
