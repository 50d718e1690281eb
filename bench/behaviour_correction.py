"""The training–inference mismatch on this CPU and what each behaviour correction does about it
(docs/algorithms.md §9), with the tiny model through a real vLLM sidecar.

``--part mismatch``: one batch of rollouts (64 questions × 8) from the SFT warm start, sampled by
the server and rescored by the trainer, for server/trainer dtypes float32/float32,
bfloat16/float32 and float32/bfloat16 (``vllm.dtype``, ``model.dtype``): ``mismatch_kl`` and the
distribution of |ℓ_prox − ℓ_μ| per token.

``--part learning``: ``configs/tiny.py`` for ``--steps`` RL steps through a bfloat16 sidecar with
``loss.behaviour_correction`` none / tis / mis, and a float32 sidecar (tis: its weights are ~1) as
the reference, ``--seeds`` seeds each: held-out pass@1 / pass@8 / greedy after RL, and the
per-step mismatch. Each run's results go to ``--out``.json as they land (rerunning skips them).

  python bench/behaviour_correction.py --part mismatch --out bench/results/behaviour_mismatch
  python bench/behaviour_correction.py --part learning --out bench/results/behaviour_correction
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = {  # name: (server dtype, trainer dtype, correction)
  "f32 server (reference)": ("float32", "float32", "tis"),
  "bf16 server, none": ("bfloat16", "float32", "none"),
  "bf16 server, tis": ("bfloat16", "float32", "tis"),
  "bf16 server, mis": ("bfloat16", "float32", "mis"),
}


def _config(**overrides):
  """configs/tiny.py (the embedded default) with dotted overrides."""
  from jaxrl.config import from_configdict
  from jaxrl.run import cli

  cd = cli.load_config(os.path.join(ROOT, "configs", "tiny.py"))
  cd.update_from_flattened_dict(overrides)
  return from_configdict(cd)


def _measure_mismatch(server: str, trainer: str, workdir: str, sft_dir: str | None):
  """One batch sampled by the server and rescored by the trainer, as the loop does."""
  import jax
  import numpy as np

  from jaxrl.rl.behaviour import behaviour_metrics
  from jaxrl.run.train import Trainer

  cfg = _config(**{"rollout.engine": "vllm", "vllm.dtype": server, "model.dtype": trainer})
  if sft_dir:
    shutil.copytree(sft_dir, os.path.join(workdir, "sft"))
  with Trainer.open(cfg, workdir) as trainer_:
    params = trainer_.warm_start(trainer_.init_params())
    t = trainer_.task
    b = 64
    counts = np.full(b, 8, np.int32)
    out = trainer_.collector.sample(
      params,
      0,
      t.train_prompt_ids[:b],
      t.train_prompt_mask[:b],
      counts,
      1.0,
      jax.random.PRNGKey(0),
      cfg.rollout.max_new_tokens,
    )
  mask = np.asarray(out.mask_RxN)
  prox, behaviour = np.asarray(out.prox_logp_RxN), np.asarray(out.behaviour_logp_RxN)
  diff = np.abs(prox - behaviour)[mask]
  m = behaviour_metrics(prox, behaviour, mask, "tis")
  return dict(
    tokens=int(mask.sum()),
    mismatch_kl=float(m["mismatch_kl"]),
    weight_mean=float(m["behaviour_weight_mean"]),
    tis_truncated_frac=float(m["behaviour_weight_dropped_frac"]),
    abs_diff={f"p{q}": float(np.percentile(diff, q)) for q in (50, 90, 99, 99.9)}
    | {"max": float(diff.max()), "mean": float(diff.mean())},
  ), os.path.join(workdir, "sft")


def _run_learning(name: str, seed: int, steps: int, workdir: str, warm: str | None) -> dict:
  """One run; ``warm``: an earlier run of the seed whose SFT warm start (float32 trainer in every
  setting, so the same params) this one reuses, and its SFT evaluation when its server had this
  run's dtype (the evaluation samples through the server)."""
  server, trainer, correction = SETTINGS[name]
  if warm and os.path.isdir(os.path.join(warm, "sft")) and not os.path.exists(workdir):
    shutil.copytree(os.path.join(warm, "sft"), os.path.join(workdir, "sft"))
    if json.load(open(os.path.join(warm, "config.json")))["vllm"]["dtype"] == server:
      shutil.copy(os.path.join(warm, "eval_sft.json"), workdir)
  cmd = [
    sys.executable,
    "-m",
    "jaxrl.main",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    f"--config.seed={seed}",
    f"--config.steps={steps}",
    "--config.rollout.engine=vllm",
    f"--config.vllm.dtype={server}",
    f"--config.model.dtype={trainer}",
    f"--config.loss.behaviour_correction={correction}",
    "--config.log.plot=False",
    "--config.log.progress=False",
  ]
  done = subprocess.run(
    cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True
  )
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
  with open(os.path.join(workdir, "results.md")) as f:
    last = [line for line in f if line.startswith("| all |")][-1]
  cells = [c.strip() for c in last.strip("|\n").split("|")]
  # | all | n | pass@1 SFT | pass@1 RL | Δ | pass@8 SFT | pass@8 RL | Δ | greedy SFT | greedy RL | Δ |
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return dict(
    pass1_sft=float(cells[2]),
    pass1=float(cells[3]),
    pass8=float(cells[6]),
    greedy=float(cells[9]),
    mismatch_kl_median=float(np.median([r["mismatch_kl"] for r in rows])),
    diff_max_median=float(np.median([r["behaviour_logp_diff_max"] for r in rows])),
    dropped_frac_mean=float(np.mean([r["behaviour_weight_dropped_frac"] for r in rows])),
  )


def _report(results: dict, steps: int) -> str:
  """bench/results/behaviour_correction.md: per setting, the mean (min–max) over seeds."""
  lines = [
    "# Behaviour correction on the tiny task through the vLLM sidecar (bench/behaviour_correction.py)",
    "",
    f"`configs/tiny.py`, {steps} RL steps per run, k = 0 (fresh batches: the only off-policyness is",
    "the server's dtype). Held-out pass@1 / pass@8 / greedy (percent, 384 questions, 16 samples at",
    "τ = 1) after RL, evaluated through the run's own server; the per-step mismatch over the run.",
    "Mean over seeds, (min–max) beside it.",
    "",
    "| setting | seeds | pass@1 SFT | pass@1 RL | pass@8 RL | greedy RL | mismatch_kl (median step) "
    "| max abs Δℓ (median step) | tokens dropped/truncated |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name in SETTINGS:
    runs = [v for k, v in results.items() if k.split(" | ")[0] == name]
    if not runs:
      continue
    cell = lambda key, fmt="{:.1f}": (  # noqa: E731
      fmt.format(np.mean([r[key] for r in runs]))
      + f" ({fmt.format(min(r[key] for r in runs))}–{fmt.format(max(r[key] for r in runs))})"
    )
    lines.append(
      f"| {name} | {len(runs)} | {cell('pass1_sft')} | {cell('pass1')} | {cell('pass8')} | "
      f"{cell('greedy')} | {cell('mismatch_kl_median', '{:.2g}')} | "
      f"{cell('diff_max_median', '{:.2g}')} | {cell('dropped_frac_mean', '{:.2g}')} |"
    )
  lines += ["", "Per run:", "", "```", json.dumps(results, indent=1), "```", ""]
  return "\n".join(lines)


def _load(path):
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {}


def _save(path, data):
  with open(path + ".tmp", "w") as f:
    json.dump(data, f, indent=1)
  os.replace(path + ".tmp", path)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=("mismatch", "learning", "report"), required=True)
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--out", required=True)
  ap.add_argument("--workdirs", default="", help="where the runs go (default: a temp directory)")
  ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
  ap.add_argument("--merge", nargs="*", default=[], help="more result JSONs (--part report)")
  args = ap.parse_args()
  results = _load(args.out + ".json")
  for extra in args.merge:
    results.update(_load(extra))
  base = args.workdirs or tempfile.mkdtemp(prefix="behaviour-")
  if args.part == "report":  # the .md of what --part learning wrote (several JSONs: merged)
    with open(args.out + ".md", "w") as f:
      f.write(_report(results, args.steps))
    return
  if args.part == "mismatch":
    sft = None
    for server, trainer in (
      ("float32", "float32"),
      ("bfloat16", "float32"),
      ("float32", "bfloat16"),
    ):
      key = f"server {server}, trainer {trainer}"
      workdir = os.path.join(base, key.replace(" ", "_").replace(",", ""))
      results[key], made = _measure_mismatch(server, trainer, workdir, sft)
      sft = sft or made
      print(key, results[key], flush=True)
      _save(args.out + ".json", results)
  else:
    for seed in (int(s) for s in args.seeds.split(",")):
      warm = None
      for name in SETTINGS:
        key = f"{name} | seed {seed}"
        workdir = os.path.join(base, re.sub(r"\W+", "_", key))
        if key not in results:
          results[key] = _run_learning(name, seed, args.steps, workdir, warm)
        warm = workdir if os.path.isdir(os.path.join(workdir, "sft")) else warm
        print(key, results[key], flush=True)
        _save(args.out + ".json", results)
  if not args.keep:
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
  main()
