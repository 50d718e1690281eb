"""How the peer comparisons grow with the work: model size × response length, with peak memory.

Runs ``train_step_vs_torch.py`` and ``sampler_vs_hf.py`` once per point of the matrix (sizes 5m,
50m, 0.5b; response lengths 128, 512, 2048), appending each result to ``bench/results/
scaling.jsonl``; a point already in that file is skipped, so an interrupted sweep resumes where it
stopped. ``--report`` renders ``bench/results/scaling.md`` from the records (every point measured
so far, and the ones still missing).

The work per point: ``rows_at(size, length)`` rows of 32 prompt tokens and the response length
(the train step) or new tokens (the sampler, G = min(8, rows) per prompt). Rows shrink with the
model so one 0.5B update fits beside torch's in 24 GiB and the sweep finishes in hours, not days;
at 2,048 tokens a quarter of them (about the tokens per step of the 512 points: torch's eager
attention keeps [rows, heads, T, T] probabilities per layer for its backward). The 0.5B points
run one side at a time (``--sequential``: both workers do not fit at once). From 512 tokens on the
0.5B train step recomputes each layer in its backward on both sides (``--remat full``; without it
the 512-token step did not fit in 24 GiB).

    PYTHONPATH=. .venv/bin/python bench/scaling.py --sizes 5m 50m --lengths 128 512
    PYTHONPATH=. .venv/bin/python bench/scaling.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDS = os.path.join(HERE, "results", "scaling.jsonl")
REPORT = os.path.join(HERE, "results", "scaling.md")
ROWS = {"5m": 64, "50m": 16, "0.5b": 8}
SIZES, LENGTHS = tuple(ROWS), (128, 512, 2048)
BENCHES = ("train_step", "sampler")
LONG = 2048  # from this length on, a quarter of ROWS
REMAT_FROM = {"0.5b": 512}  # from this length on, the train step runs with --remat full


def rows_at(size: str, length: int) -> int:
  return ROWS[size] if length < LONG else max(1, ROWS[size] // 4)


def remat_at(size: str, length: int) -> str:
  return "full" if length >= REMAT_FROM.get(size, float("inf")) else "none"


def _argv(bench: str, size: str, length: int, repeats: int) -> list[str]:
  rows = rows_at(size, length)
  common = ["--size", size, "--rows", str(rows), "--prompt-len", "32", "--repeats", str(repeats)]
  if bench == "train_step":
    remat = ["--remat", remat_at(size, length)]
    return ["train_step_vs_torch.py", *common, "--response-len", str(length), *remat]
  # the sampler's prompts come in groups of 8: at least one prompt
  return ["sampler_vs_hf.py", *common, "--new-tokens", str(length), "--group", str(min(8, rows))]


def _key(record: dict) -> tuple:
  length = record.get("response_len", record.get("new_tokens"))
  bench = "train_step" if "response_len" in record else "sampler"
  return bench, record["size"], length


def _load() -> list[dict]:
  if not os.path.exists(RECORDS):
    return []
  with open(RECORDS) as f:
    return [json.loads(line) for line in f if line.strip()]


def sweep(sizes, lengths, benches, repeats: int) -> None:
  done = {_key(r) for r in _load()}
  for size in sizes:
    for length in lengths:
      for bench in benches:
        if (bench, size, length) in done:
          continue
        script, *argv = _argv(bench, size, length, repeats)
        cmd = [sys.executable, os.path.join(HERE, script), *argv, "--out", RECORDS]
        print("$", " ".join(cmd[1:]), flush=True)
        # a point that fails (e.g. out of memory) is reported and the sweep goes on
        if subprocess.run(cmd).returncode != 0:
          print(f"  {bench} {size} {length}: failed", flush=True)


def _row(r: dict, machines: list[str]) -> str:
  bench, size, length = _key(r)
  j, p = r["jaxrl"], r["torch" if bench == "train_step" else "hf"]
  secs = "step_s_median" if bench == "train_step" else "s_median"
  rate = "tokens_per_s" if bench == "train_step" else "new_tokens_per_s"
  remat = r.get("remat", "none") if bench == "train_step" else "-"  # older records: none
  return (
    f"| {bench} | {size} | {r['rows']} | {length} | {remat} | {r['repeats']} | "
    f"{j[secs]:.2f} | {p[secs]:.2f} | "
    f"{j[rate]:,.0f} | {p[rate]:,.0f} | **{r['ratio']:.2f}** | {j['peak_rss_gib']:.1f} | "
    f"{p['peak_rss_gib']:.1f} | {r.get('commit', '—')} | "
    f"{_machine_tag(machines, r['machine'])} |"
  )


def _machine_tag(machines: list[str], machine: str) -> str:
  """The row's machine as a letter of the report's list (a, b, ...)."""
  return chr(ord("a") + machines.index(machine))


def report() -> str:
  records = _load()
  seen = {_key(r) for r in records}
  machines = list(dict.fromkeys(r["machine"] for r in records))  # in order of first record
  lines = [
    "# Peer comparisons by model size and response length",
    "",
    "`bench/scaling.py` (rows per size: "
    + ", ".join(f"{s} {n}" for s, n in ROWS.items())
    + f", a quarter of them at {LONG:,} tokens; 32-token prompts; "
    "sampler G = min(8, rows) per prompt, τ = 1, top_p = 1). Seconds are medians of alternating "
    "repeats (one side at a time at 0.5B), after each side's warm-up calls (the sampler's 1, the "
    "train step's 2); a point of 1 repeat is one timed call per side (long points, where 3 "
    "repeats would take hours). Remat `full`: the train step recomputes each layer in its "
    "backward, on both sides (jaxrl `model.remat`, HF activation checkpointing; jaxrl's "
    "recomputes from 9317a54 on: before, XLA CPU merged it back into the forward, so rows of "
    "earlier commits ran jaxrl's step without recomputation); `-`: the sampler. "
    "Peak memory is each worker's peak RSS.",
    "Machines: "
    + "; ".join(f"({_machine_tag(machines, m)}) {m}" for m in machines)
    + " (ratios compare the two sides on one machine; seconds across machines do not compare).",
    "",
    "| bench | size | rows | response | remat | repeats | jaxrl s | peer s | jaxrl tok/s "
    "| peer tok/s | ratio | jaxrl GiB | peer GiB | commit | machine |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  ordered = sorted(records, key=lambda r: (SIZES.index(r["size"]), _key(r)))
  lines += [_row(r, machines) for r in ordered]
  missing = [
    f"{b} {s} {n}" for s in SIZES for n in LENGTHS for b in BENCHES if (b, s, n) not in seen
  ]
  if missing:
    lines += ["", "Not measured yet: " + ", ".join(missing) + "."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
  parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
  parser.add_argument("--benches", nargs="+", choices=BENCHES, default=list(BENCHES))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--report", action="store_true", help="only write scaling.md")
  args = parser.parse_args(argv)
  if not args.report:
    sweep(args.sizes, args.lengths, args.benches, args.repeats)
  with open(REPORT, "w") as f:
    f.write(report())
  print(f"wrote {REPORT}")


if __name__ == "__main__":
  main()
