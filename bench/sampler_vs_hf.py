"""Benchmark: the JAX sampler (``jaxrl.rollout.sampler.generate``) against HF ``generate``.

The same work on both sides: B = rows / G prompts of P tokens, G samples each (GRPO's layout),
N new tokens per row at τ = 1 with nucleus sampling switched off (top_p = 1; HF's default top_k = 50
switched off too, so both sample from the full softmax), float32, the same model shape. HF runs
with its KV cache (``use_cache``) and no stop token, so every row generates N tokens; jaxrl's rows
may emit its stop id and stop early, but the batch decodes all N steps regardless (the while loop
runs until every row finished). jaxrl also returns each token's log-prob and the entropy of the
full softmax, which HF ``generate`` does not compute.

Each side runs in its own worker process, compiled or warmed up once, timed alternately
(``side_by_side``). Prints new tokens/s of each, and as its last line ``ratio R`` (jaxrl / HF).

``--devices N`` runs jaxrl's side on N host CPU devices (``jax_num_cpu_devices``)
with the params replicated on a ``data`` mesh of N, as the trainer's JAX engine samples under
``jaxrl-train --cpu_devices=N --config.mesh.data=N``: the model's sharding constraints split the
rows over the devices, each decoding its share (its own loop, its ops overlapping the other's).
HF's side is unchanged (torch already runs every op on all cores); the figures are in
``results/peers.md``. The embedded default's run is slower on two devices (its model is too small).

    PYTHONPATH=. .venv/bin/python bench/sampler_vs_hf.py                    # 64 rows, vocab 2048
    PYTHONPATH=. .venv/bin/python bench/sampler_vs_hf.py --vocab 151936
    PYTHONPATH=. .venv/bin/python bench/sampler_vs_hf.py --rows 256 --side jaxrl   # one side only
    PYTHONPATH=. .venv/bin/python bench/sampler_vs_hf.py --devices 2   # one CPU device per core
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side  # noqa: E402

SIDES = ("jaxrl", "hf")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(side_by_side.MODEL_SIZES), default="5m")
  parser.add_argument("--vocab", type=int, help="replace the size's vocabulary")
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--group", type=int, default=8, help="samples per prompt")
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=96)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--devices", type=int, default=1, help="jaxrl's host CPU devices (data mesh)")
  parser.add_argument("--side", choices=SIDES, help="time one side only (no ratio)")
  parser.add_argument("--sequential", action="store_true", help="one worker at a time")
  parser.add_argument("--out", help="append the result as a JSON line to this file")
  parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rows % args.group:
    parser.error(f"--rows {args.rows} is not a multiple of --group {args.group}")
  if args.devices < 1 or (args.rows // args.group) % args.devices:
    parser.error(f"--devices {args.devices} must divide the {args.rows // args.group} prompts")
  return args


def prompts(num_prompts: int, prompt_len: int, vocab: int):
  """Random prompt ids [B, P] (every prompt P tokens long), the same on both sides."""
  import numpy as np

  rng = np.random.default_rng(0)
  return rng.integers(0, vocab, (num_prompts, prompt_len)).astype(np.int32)


def _prompts(args, vocab):
  return prompts(args.rows // args.group, args.prompt_len, vocab)


# ``jaxrl_generate_fn`` and ``hf_generate_fn`` are also bench/gpu_check.py's.


def jaxrl_generate_fn(cfg, graphdef, params, prompts_BxP, group: int, new_tokens: int, top_p):
  """A call that samples ``group`` responses of ``new_tokens`` tokens to each prompt with the JAX
  sampler (τ = 1, a fresh key per call) and waits for them."""
  import jax
  import numpy as np

  from jaxrl.rollout import sampler

  B = prompts_BxP.shape[0]
  calls = iter(range(1 << 30))

  def one():
    out = sampler.generate(
      graphdef,
      params,
      prompts_BxP,
      np.ones_like(prompts_BxP, bool),
      np.full((B,), group, np.int32),
      jax.random.key(next(calls)),
      1.0,
      top_p,
      num_rollouts=B * group,
      max_new_tokens=new_tokens,
      eos_id=cfg.vocab_size - 1,
      pad_id=0,
      model_cfg=cfg,
    )
    jax.block_until_ready(out)

  return one


def hf_generate_fn(net, prompts_BxP, group: int, new_tokens: int, top_p, **generate_kwargs):
  """A call of HF ``generate`` on ``net`` (on its device) with the same work: ``group`` samples of
  exactly ``new_tokens`` tokens per prompt from the full softmax (top_k off); then waits for the
  device. ``generate_kwargs`` add to the call (e.g. ``cache_implementation="static"``)."""
  import torch

  device = next(net.parameters()).device
  prompts = torch.as_tensor(prompts_BxP, device=device).long()

  @torch.no_grad()
  def one():
    net.generate(
      input_ids=prompts,
      attention_mask=torch.ones_like(prompts),
      do_sample=True,
      temperature=1.0,
      top_p=top_p,
      top_k=0,
      num_return_sequences=group,
      max_new_tokens=new_tokens,
      min_new_tokens=new_tokens,
      eos_token_id=None,
      pad_token_id=0,
      use_cache=True,
      **generate_kwargs,
    )
    if device.type == "cuda":
      torch.cuda.synchronize()

  return one


def _jaxrl_worker(args):
  import jax

  # before the backend starts: the number of host devices is fixed then (as jaxrl-train's
  # --cpu_devices, ``distributed.initialize``)
  jax.config.update("jax_num_cpu_devices", args.devices)

  from jaxrl.parallel import sharding

  cfg, graphdef, params = side_by_side.jaxrl_model(args.size, args.vocab)
  if args.devices > 1:
    params = jax.device_put(params, sharding.replicated(sharding.make_mesh(args.devices, 1, 1)))
  prompts_BxP = _prompts(args, cfg.vocab_size)
  return jaxrl_generate_fn(
    cfg, graphdef, params, prompts_BxP, args.group, args.new_tokens, args.top_p
  )


def _hf_worker(args):
  net = side_by_side.hf_model(args.size, args.vocab).eval()
  prompts_BxP = _prompts(args, net.config.vocab_size)
  return hf_generate_fn(net, prompts_BxP, args.group, args.new_tokens, args.top_p)


def measure(args, argv) -> dict:
  sides = (args.side,) if args.side else SIDES
  timed = side_by_side.alternate(
    os.path.abspath(__file__), argv, sides, ("generate",), args.repeats, args.sequential
  )
  new_tokens = args.rows * args.new_tokens
  out = {
    "size": args.size,
    "vocab": args.vocab or side_by_side.MODEL_SIZES[args.size][-1],
    "rows": args.rows,
    "group": args.group,
    "prompt_len": args.prompt_len,
    "new_tokens": args.new_tokens,
    "top_p": args.top_p,
    "repeats": args.repeats,
    "jaxrl_devices": args.devices,
    "machine": side_by_side.machine(),
  }
  for side in sides:
    median = statistics.median(timed[side]["generate"])
    out[side] = {
      "s_median": median,
      "s_all": timed[side]["generate"],
      "new_tokens_per_s": new_tokens / median,
      "peak_rss_gib": timed[side]["peak_rss_gib"],
    }
  if len(sides) == 2:
    out["ratio"] = out["jaxrl"]["new_tokens_per_s"] / out["hf"]["new_tokens_per_s"]
    if not args.sequential:
      out["ratio_pairs"] = side_by_side.pair_ratios(
        timed["jaxrl"]["generate"], timed["hf"]["generate"]
      )
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.worker:
    one = (_jaxrl_worker if args.worker == "jaxrl" else _hf_worker)(args)
    return side_by_side.serve({"generate": one}, {}, args.warmup)
  result = measure(args, side_by_side.without_flag(argv, "--out"))
  print(
    f"{args.size} (vocab {result['vocab']}): {args.rows} rows ({args.rows // args.group} prompts × "
    f"{args.group}), {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
    f"top_p {args.top_p}, jaxrl on {args.devices} device(s), median of {args.repeats}"
  )
  for side in SIDES:
    if side in result:
      r = result[side]
      print(
        f"  {side:5s} {r['s_median']:.3f} s/batch  {r['new_tokens_per_s']:,.0f} new tokens/s  "
        f"peak RSS {r['peak_rss_gib']:.1f} GiB"
      )
  side_by_side.finish(result, args.out)


if __name__ == "__main__":
  main()
