"""What `make run` prints and how long it takes: the README's first table, from a run made here.

  PYTHONPATH=. .venv/bin/python bench/make_run.py

Runs `make run`'s command (``python -m jaxrl.main --config=configs/tiny.py``, seed 0) in a fresh
``--workdir`` (the venv already set up) and times it from start to exit; writes
``results/make_run.md``: the machine, the wall time, the commit and the held-out table the run
printed. README.md quotes the table and the time; ``tests/test_docs.py`` keeps them equal. Run it
with nothing else on the cores: the time is the one figure here a neighbour changes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.study_report import machine  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "make_run.md")


def table(results_md: str) -> str:
  """The held-out table of a run's ``results.md``: its lines that start with ``|``."""
  with open(results_md) as f:
    return "\n".join(line for line in f.read().splitlines() if line.startswith("|"))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default="runs/make_run")
  args = ap.parse_args()
  shutil.rmtree(
    args.workdir, ignore_errors=True
  )  # the time of a run from scratch, warm start included
  cmd = [
    sys.executable,
    "-m",
    "jaxrl.main",
    "--config=configs/tiny.py",
    f"--workdir={args.workdir}",
  ]
  start = time.monotonic()
  subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
  minutes = (time.monotonic() - start) / 60
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  text = (
    "# `make run`: the held-out table and the time\n\n"
    f"`python -m jaxrl.main --config=configs/tiny.py` (seed 0) from an empty workdir: "
    f"**{minutes:.1f} minutes** on {machine()}, commit {commit}. Command: "
    "`PYTHONPATH=. .venv/bin/python bench/make_run.py`.\n\n"
    f"{table(os.path.join(args.workdir, 'results.md'))}\n"
  )
  with open(RESULTS, "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
