"""Does a policy trained with ``tiny:rm``'s reward model learn the task? Held-out verifier accuracy.

  PYTHONPATH=. nice -n 10 .venv/bin/python bench/rm_outcome.py --seeds 0 1 2 --jobs 2 \
    --verifier-root runs/packing_outcome

Protocol (fixed before the runs). Arms, each ``configs/tiny.py`` (300 RL steps, GRPO):
``verifier``, the defaults (``make run``: the verifier's reward alone); ``rm``, ``configs/tiny.py:rm``
(``reward.terms = "verifier, model:tiny-rm*0.5"``, normalise-then-sum: the verifier joined by the
reward model ``jaxrl/tasks/rewards/train_rm.py`` trains in code); ``rm_only``, ``tiny:rm`` with
``reward.terms = "model:tiny-rm"`` (the policy never sees the verifier: what the reward model alone
teaches). Seeds 0, 1, 2; a seed's arms share its SFT warm start, the verifier run's (``sft/`` copied,
``bench/tiny_runs.py``), so they start RL from the same policy. The verifier arm's runs are those of
``bench/packing_outcome.py``'s packed arm when ``--verifier-root`` names them (the same config:
``loss.packing`` is on by default); a finished run is only read. Runs are ordered ``verifier``,
``rm``, ``rm_only`` (the first arms first if time runs out); finished runs are skipped.

Metrics: held-out pass@1, pass@8 and greedy accuracy over all levels, read by the verifier (whatever
the training reward), at the warm start (``eval_sft.json``) and after RL (``eval_step300.json``);
the gain is after − before, in points. Also the reward model's held-out pairwise accuracy
(``tiny_rm.json``).

Decision rule: an arm learns when its mean pass@1 gain over seeds is > 0 and every seed's gain is
> 0. Each reward-model arm is then compared to the verifier arm: its mean pass@1 after RL is below,
within or above the verifier runs' range over seeds (min–max). Writes --out (markdown) and the
runs' figures as JSON lines beside it.
"""

from __future__ import annotations

import concurrent.futures as cf
import glob
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import tiny_runs  # noqa: E402
from bench.study_report import machine  # noqa: E402

# arm -> (config, overrides); the verifier arm makes each seed's warm start
ARMS = {
  "verifier": ("configs/tiny.py", ()),
  "rm": ("configs/tiny.py:rm", ()),
  "rm_only": ("configs/tiny.py:rm", ("reward.terms=model:tiny-rm",)),
}
METRICS = ("pass1", "pass8", "greedy")
STEPS = 300  # configs/tiny.py's


def workdir(arm: str, seed: int, root: str, verifier_root: str) -> str:
  if arm == "verifier":
    return os.path.join(verifier_root, f"packed_s{seed}")
  return os.path.join(root, f"{arm}_s{seed}")


def run(arm: str, seed: int, steps: int, root: str, verifier_root: str) -> str:
  where = workdir(arm, seed, root, verifier_root)
  warm = None if arm == "verifier" else workdir("verifier", seed, root, verifier_root)
  config, overrides = ARMS[arm]
  return tiny_runs.ensure_run(config, where, seed, steps, warm, *overrides)


def _json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def outcome(where: str, steps: int) -> dict:
  """Held-out accuracy at the warm start and after RL, and the reward model's pairwise accuracy
  (None without one)."""
  before = _json(os.path.join(where, "eval_sft.json"))
  after = _json(os.path.join(where, f"eval_step{steps}.json"))

  def figures(e: dict, prefix: str) -> dict:
    return {
      f"{prefix}pass1": e["pass_at"]["1"]["all"],
      f"{prefix}pass8": e["pass_at"]["8"]["all"],
      f"{prefix}greedy": e["greedy"]["all"],
    }

  reports = glob.glob(os.path.join(where, "tiny-rm-*", "tiny_rm.json"))
  rm_acc = _json(reports[0]).get("heldout_pairwise_accuracy") if reports else None
  return {**figures(after, ""), **figures(before, "sft_"), "rm_pairwise_accuracy": rm_acc}


def verdict(by_arm: dict[str, list[dict]]) -> dict[str, dict]:
  """Per arm: whether it learns (mean pass@1 gain > 0, every seed's > 0) and, for a reward-model
  arm, where its mean pass@1 lies against the verifier arm's min–max."""
  out = {}
  verifier = [r["pass1"] for r in by_arm.get("verifier", [])]
  for arm, rows in by_arm.items():
    gains = [r["pass1"] - r["sft_pass1"] for r in rows]
    got = {"learns": bool(gains) and np.mean(gains) > 0 and min(gains) > 0}
    if arm != "verifier" and verifier and rows:
      mean = float(np.mean([r["pass1"] for r in rows]))
      got["vs_verifier"] = (
        "below" if mean < min(verifier) else "above" if mean > max(verifier) else "within"
      )
    out[arm] = got
  return out


def _pct(values) -> str:
  v = 100 * np.asarray(values)
  return f"{v.mean():.1f} ({v.min():.1f}–{v.max():.1f})"


def summarize(by_arm: dict[str, list[dict]], seeds: dict[str, list[int]], asked, steps: int) -> str:
  """The markdown report of the finished runs (``seeds``: each arm's; ``asked``: those run)."""
  ok = verdict(by_arm)
  lines = [
    "# What tiny:rm's reward model teaches the policy: held-out verifier accuracy",
    "",
    f"`configs/tiny.py` ({steps} RL steps): `verifier` its defaults, `rm` `tiny:rm` (verifier + "
    "`model:tiny-rm*0.5`, normalise-then-sum), `rm_only` `tiny:rm` with `reward.terms=model:tiny-rm`;"
    " each seed's arms from one SFT warm start. Held-out accuracy (%) over all levels, read by the "
    "verifier: mean (min–max) over seeds. Rule (bench/rm_outcome.py): an arm learns when its mean "
    "pass@1 gain is > 0 and every seed's is > 0; a reward-model arm's mean pass@1 after RL is "
    f"placed against the verifier arm's range. Machine: {machine()}. Command: `PYTHONPATH=. "
    f".venv/bin/python bench/rm_outcome.py --seeds {' '.join(map(str, asked))}`.",
    "",
    "| arm | seeds | pass@1 before | pass@1 after | pass@8 after | greedy after | pass@1 gain "
    "per seed (points) | learns | vs verifier |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for arm, rows in by_arm.items():
    if not rows:
      lines.append(f"| {arm} | none finished | | | | | | | |")
      continue
    gains = ", ".join(f"{100 * (r['pass1'] - r['sft_pass1']):+.1f}" for r in rows)
    cells = " | ".join(
      [_pct([r["sft_pass1"] for r in rows])] + [_pct([r[m] for r in rows]) for m in METRICS]
    )
    learns = "yes" if ok[arm]["learns"] else "no"
    lines.append(
      f"| {arm} | {', '.join(map(str, seeds[arm]))} | {cells} | {gains} | {learns} | "
      f"{ok[arm].get('vs_verifier', '—')} |"
    )
  rm_acc = {r["rm_pairwise_accuracy"] for rows in by_arm.values() for r in rows}
  rm_acc.discard(None)
  if rm_acc:
    lines += [
      "",
      "The reward model's held-out pairwise accuracy: "
      + ", ".join(f"{a:.3f}" for a in sorted(rm_acc))
      + " (0.5 is chance).",
    ]
  missing = [f"{a} s{s}" for a in ARMS for s in asked if s not in seeds[a]]
  if missing:
    lines += ["", f"Not finished (left out): {', '.join(missing)}."]
  return "\n".join(lines) + "\n"


def run_all(args) -> None:
  """The verifier runs first (each makes its seed's warm start), then the others in arm order; a
  failed run is reported (its log: ``WORKDIR.log``) and the others still run."""
  later = [(arm, s) for arm in ARMS if arm != "verifier" for s in args.seeds]
  for jobs in ([("verifier", s) for s in args.seeds], later):
    with cf.ThreadPoolExecutor(args.jobs) as pool:
      futures = {
        pool.submit(run, a, s, args.steps, args.root, args.verifier_root): (a, s) for a, s in jobs
      }
      for f in cf.as_completed(futures):
        if f.exception() is not None:
          print(f"{futures[f]} failed: {f.exception()}", file=sys.stderr)


def main() -> None:
  ap = tiny_runs.evidence_parser(STEPS, "runs/rm_outcome", "bench/results/rm_outcome.md")
  ap.add_argument("--verifier-root", default="runs/packing_outcome")
  args = ap.parse_args()
  os.makedirs(args.root, exist_ok=True)
  if not args.summarize_only:
    run_all(args)
  by_arm, seeds = {}, {}
  for arm in ARMS:
    where = [(s, workdir(arm, s, args.root, args.verifier_root)) for s in args.seeds]
    done = [(s, w) for s, w in where if tiny_runs.finished(w, args.steps)]
    by_arm[arm], seeds[arm] = [outcome(w, args.steps) for _, w in done], [s for s, _ in done]
  with open(args.out, "w") as f:
    f.write(summarize(by_arm, seeds, args.seeds, args.steps))
  with open(os.path.splitext(args.out)[0] + ".jsonl", "w") as f:
    for arm, rows in by_arm.items():
      for seed, r in zip(seeds[arm], rows):
        f.write(json.dumps({"arm": arm, "seed": seed, "steps": args.steps, **r}) + "\n")
  print(open(args.out).read())


if __name__ == "__main__":
  main()
