"""One training run of the tiny task as a subprocess, for the evidence benchmarks.

Runs of one seed share its SFT warm start: the first run computes it, the others copy its cache
(``sft/`` holds the base alone, whatever the run trains after it), its tokenizer and its SFT
evaluation, so every setting starts RL from the same policy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finished(workdir: str, steps: int) -> bool:
  return os.path.exists(os.path.join(workdir, f"eval_step{steps}.json"))


def share_warm_start(shared: str, workdir: str) -> None:
  """Copies run ``shared``'s warm start into ``workdir`` unless it is there already."""
  if workdir == shared or os.path.exists(os.path.join(workdir, "sft")):
    return
  os.makedirs(workdir, exist_ok=True)
  for name in ("sft", "tokenizer"):
    shutil.copytree(os.path.join(shared, name), os.path.join(workdir, name))
  shutil.copy(os.path.join(shared, "eval_sft.json"), workdir)


def train(config: str, workdir: str, seed: int, steps: int, log_path: str, *overrides: str):
  """``python -m jaxrl.main --config=CONFIG`` with ``--config.KEY=VALUE`` overrides; its output goes
  to ``log_path``; a failed run raises."""
  cmd = [
    sys.executable, "-m", "jaxrl.main", f"--config={config}", f"--workdir={workdir}",
    f"--config.seed={seed}", f"--config.steps={steps}", "--config.log.progress=False",
    *(f"--config.{o}" for o in overrides),
  ]  # fmt: skip
  with open(log_path, "w") as log:
    subprocess.run(
      cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=log, stderr=log, check=True
    )


def ensure_run(
  config: str, workdir: str, seed: int, steps: int, warm_start: str | None, *overrides: str
) -> str:
  """``workdir`` trained by ``train`` unless it is finished (a stopped run resumes); its warm start
  copied first from the run ``warm_start`` (None: computed by the run itself)."""
  if not finished(workdir, steps):
    os.makedirs(os.path.dirname(workdir) or ".", exist_ok=True)
    if warm_start is not None:
      share_warm_start(warm_start, workdir)
    train(config, workdir, seed, steps, workdir + ".log", *overrides)
  return workdir


def evidence_parser(steps: int, root: str, out: str, seeds=(0, 1, 2)) -> argparse.ArgumentParser:
  """The command line the evidence benchmarks share: runs (steps, seeds, parallel jobs) under
  ``--root``, a summary to ``--out``; ``--summarize-only`` reads finished runs."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=steps)
  ap.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
  ap.add_argument("--jobs", type=int, default=2)  # runs at a time (each mostly on one core)
  ap.add_argument("--root", default=root)
  ap.add_argument("--out", default=out)
  ap.add_argument("--summarize-only", action="store_true")
  return ap


def evidence_args(steps: int, root: str, out: str) -> argparse.Namespace:
  """``evidence_parser``'s arguments, ``--root`` made."""
  args = evidence_parser(steps, root, out).parse_args()
  os.makedirs(args.root, exist_ok=True)
  return args
