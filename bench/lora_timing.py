"""LoRA's cost per step beside full fine-tuning, side by side: the GRPO update, and the weight push
to a vLLM sidecar (the adapter alone vs the whole model).

  PYTHONPATH=. .venv/bin/python bench/lora_timing.py --repeats 7

Model: the embedded default's architecture (configs/tiny.py, untied here so a push carries a
head like a real checkpoint's), random weights. Update: one jitted ``rl_update`` on a batch of the
default's shape (16 questions × 8 rollouts, 8 new tokens), full fine-tuning and LoRA ranks 1, 8,
32, timed alternately after a warm-up (compile excluded), medians. Push: two launched servers of
the same base, one with runtime LoRA (``set_weights`` writes the PEFT adapter and loads it), one
taking merged weights (writes the HF model, ``reload_weights``); pushes alternate, medians, and
the bytes each push writes. Run it on a quiet machine. Appends a section to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.side_by_side import machine  # noqa: E402
from jaxrl.config import from_configdict, loss_config  # noqa: E402
from jaxrl.nn import arch, model  # noqa: E402
from jaxrl.rl import programs  # noqa: E402
from jaxrl.rl.losses import LossHparams  # noqa: E402
from jaxrl.rollout.build import build_engine  # noqa: E402
from jaxrl.run import cli  # noqa: E402
from jaxrl.run.components import engine_sections, task_sections  # noqa: E402
from jaxrl.tasks.task import load_task  # noqa: E402
from jaxrl.types import Rollouts  # noqa: E402

RANKS = (0, 1, 8, 32)


def _config(rank: int, **overrides):
  cd = cli.load_config(os.path.join(ROOT, "configs", "tiny.py"))
  cd.update_from_flattened_dict(
    {"model.lora.rank": rank, "model.tie_embeddings": False, **overrides}
  )
  return from_configdict(cd)


def _batch(cfg, task, rng) -> Rollouts:
  r, n = cfg.num_rollouts, cfg.rollout.max_new_tokens
  q = rng.integers(0, len(task.train_answers), cfg.batch_questions)
  ids, mask = task.train_prompt_ids[q], task.train_prompt_mask[q]
  group = np.repeat(np.arange(cfg.batch_questions), cfg.rollout.group_size).astype(np.int32)
  return Rollouts(
    prompt_ids_RxP=ids[group],
    prompt_mask_RxP=mask[group],
    tokens_RxN=rng.integers(3, task.vocab_size, (r, n)).astype(np.int32),
    mask_RxN=np.ones((r, n), bool),
    loss_mask_RxN=np.ones((r, n), bool),
    behaviour_logp_RxN=np.full((r, n), -1.0, np.float32),
    entropy_RxN=np.zeros((r, n), np.float32),
    lengths_R=np.full((r,), n, np.int32),
    group_ids_R=group,
    finished_R=np.ones((r,), bool),
    rewards_R=rng.integers(0, 2, r).astype(np.float32),
    prox_logp_RxN=np.full((r, n), -1.0, np.float32),
  )


def update_times(repeats: int, workdir: str) -> dict[int, list[float]]:
  """Seconds per GRPO update of each rank (0 = full fine-tuning), alternating."""
  from jaxrl.parallel import sharding

  base = _config(0)
  task = load_task(task_sections(base), os.path.join(workdir, "tokenizer"))
  batch = _batch(base, task, np.random.default_rng(0))
  mesh = sharding.make_mesh(1, 1, 1)
  runs = {}
  for rank in RANKS:
    cfg = _config(rank)
    mcfg = arch.model_config(cfg.model, task.vocab_size)
    graphdef, params = model.create(mcfg, 0)
    progs = programs.Programs.for_run(cfg.optim, graphdef, params, mesh)
    update = progs.update(loss_config(cfg))
    hp = LossHparams.from_config(cfg.loss, cfg.modulation, 1.0, cfg.loss.eps_high)
    state = progs.init_state(params)
    state, _ = update(state, batch, hp, None)  # compile
    jax.block_until_ready(state)
    runs[rank] = [update, state, hp]
  times = {rank: [] for rank in RANKS}
  for _ in range(repeats):
    for rank in RANKS:
      update, state, hp = runs[rank]
      t0 = time.perf_counter()
      state, metrics = update(state, batch, hp, None)
      jax.block_until_ready((state, metrics))
      times[rank].append(time.perf_counter() - t0)
      runs[rank][1] = state
  return times


def push_times(repeats: int, workdir: str, rank: int) -> dict[str, tuple[list[float], list[int]]]:
  """Seconds and bytes per weight push: the LoRA adapter vs the merged model, alternating."""
  engines, params = {}, None
  for sync in ("adapter", "merged"):
    cfg = _config(rank, **{"rollout.engine": "vllm", "vllm.lora_sync": sync})
    sub = os.path.join(workdir, sync)
    task = load_task(task_sections(cfg), os.path.join(sub, "tokenizer"))
    mcfg = arch.model_config(cfg.model, task.vocab_size)
    graphdef, params = model.create(mcfg, 0)
    engines[sync] = build_engine(
      graphdef, mcfg, **engine_sections(cfg), tokenizer=task.tokenizer, eos_id=task.eos_id, pad_id=task.pad_id,
      prompt_len=task.train_prompt_ids.shape[1], workdir=sub,
    )  # fmt: skip
  try:
    for engine in engines.values():
      engine.set_weights(params, 0)  # starts the server
    out = {sync: ([], []) for sync in engines}
    for i in range(1, repeats + 1):
      moved = jax.tree.map(lambda x, i=i: x + 1e-3 * i, params)
      for sync, engine in engines.items():
        engine.set_weights(moved, i)
        out[sync][0].append(engine.push_seconds[-1])
        out[sync][1].append(engine.push_bytes[-1])
    return out
  finally:
    for engine in engines.values():
      engine.close()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--push-rank", type=int, default=8)
  ap.add_argument("--out", default="bench/results/lora.md")
  args = ap.parse_args()
  med = statistics.median
  with tempfile.TemporaryDirectory() as workdir:
    updates = update_times(args.repeats, workdir)
    pushes = push_times(args.repeats, workdir, args.push_rank)
  full = med(updates[0])
  lines = [
    "",
    f"## Update and push time per step (quiet machine, {machine()})",
    "",
    f"Command: `PYTHONPATH=. .venv/bin/python bench/lora_timing.py --repeats {args.repeats}`. "
    "Embedded default's architecture (untied), a batch of its shape (128 rows, 8 new tokens); "
    "medians of alternating repeats, compile excluded.",
    "",
    "| setting | GRPO update s (median) | / full fine-tuning |",
    "|---|---|---|",
  ]
  for rank in RANKS:
    name = "full" if rank == 0 else f"lora r{rank}"
    lines.append(f"| {name} | {med(updates[rank]):.4f} | {med(updates[rank]) / full:.2f} |")
  lines += [
    "",
    f"Weight push to the vLLM sidecar (CPU build), LoRA rank {args.push_rank}:",
    "",
    "| push | seconds (median) | bytes written per push |",
    "|---|---|---|",
  ]
  for sync, (secs, sizes) in pushes.items():
    what = {
      "adapter": "adapter (PEFT files, runtime LoRA load)",
      "merged": "merged model (HF files, reload_weights)",
    }[sync]
    lines.append(f"| {what} | {med(secs):.3f} | {int(med(sizes)):,} |")
  text = "\n".join(lines) + "\n"
  with open(args.out, "a") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
