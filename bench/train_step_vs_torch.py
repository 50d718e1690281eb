"""Benchmark: one GRPO actor update, jaxrl's against the PyTorch update TRL and verl run.

The workload: R rows of P prompt + N response tokens (default 64 × (32 + 96)), one optimizer
update per step. jaxrl runs the trainer's own program (``Programs.update``: fused chunked
log-prob/entropy, clipped objective, grad-norm clip, AdamW). The peer runs HF ``Qwen2ForCausalLM``
(eager attention, float32) on the same architecture: logits of the response positions, log-softmax,
the same clipped objective and entropy metric, ``backward``, global-norm clip, ``torch.optim.AdamW``.

Each side runs in its own worker process (their thread pools never share a process), compiled or
warmed up once; then the parent alternates them step for step and reports medians, tokens/s,
the ratio jaxrl / torch, achieved GFLOP/s (6·N·tokens, N = all params as the issue counts them, so
attention's T² FLOPs are not credited) against the machine's measured float32 matmul peak of each
library (2048³, median), and each worker's peak resident memory. At the 0.5B shape both sides do
not fit in 24 GiB at once: ``--sequential`` (the default there) runs one worker, then the other.
``--remat full`` recomputes each layer in the backward on both sides (jaxrl ``model.remat=full``;
HF activation checkpointing per decoder layer, non-reentrant, as PyTorch recommends), so the 0.5B
step fits in 24 GiB at 512 and 2,048 tokens. jaxrl's layers stay unrolled here (loop mode); its
update keeps only each layer's input because the programs keep XLA's optimization barriers on CPU
(without them CSE merges the recomputation back into the forward).

    PYTHONPATH=. .venv/bin/python bench/train_step_vs_torch.py --size 5m
    PYTHONPATH=. .venv/bin/python bench/train_step_vs_torch.py --size 0.5b --rows 8 --repeats 3
    PYTHONPATH=. .venv/bin/python bench/train_step_vs_torch.py --size 0.5b --rows 8 \
      --response-len 512 --remat full --repeats 1

The last line printed is ``ratio R`` (jaxrl tokens/s / torch tokens/s). ``--out F`` appends the
result as one JSON line. Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side  # noqa: E402

SIDES = ("jaxrl", "torch")

PEAK_N = 2048


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(side_by_side.MODEL_SIZES), default="5m")
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--response-len", type=int, default=96)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--sequential", action="store_true", help="one worker at a time")
  parser.add_argument(
    "--remat", choices=("none", "full"), default="none", help="recompute each layer (both sides)"
  )
  parser.add_argument("--out", help="append the result as a JSON line to this file")
  parser.add_argument("--worker", choices=("jaxrl", "torch"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.size == "0.5b":
    args.sequential = True
  return args


# The two workers: each builds its model and batch and returns (one update, one peak matmul).
# ``batch_arrays``, ``jaxrl_update_fn`` and ``torch_update_fn`` are also bench/gpu_check.py's.


def batch_arrays(
  rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0, lengths_R=None
) -> dict:
  """The update's batch as numpy arrays: random prompts and responses (every response N tokens
  long, or ``lengths_R`` tokens in N-wide rows), behaviour log-probs and 0/1 rewards in groups of
  8."""
  import numpy as np

  rng = np.random.default_rng(seed)
  R, P, N = rows, prompt_len, response_len
  group = min(8, R)
  return dict(
    prompt_ids_RxP=rng.integers(0, vocab, (R, P)).astype(np.int32),
    tokens_RxN=rng.integers(0, vocab, (R, N)).astype(np.int32),
    # by default every response runs to N tokens: the same R·(P+N) tokens on both sides
    mask_RxN=np.ones((R, N), bool)
    if lengths_R is None
    else np.arange(N) < np.asarray(lengths_R)[:, None],
    old_logp_RxN=(-rng.random((R, N)) * 4 - 0.5).astype(np.float32),
    rewards_R=rng.integers(0, 2, R).astype(np.float32),
    group_ids_R=np.repeat(np.arange(R // group), group).astype(np.int32),
    num_groups=R // group,
  )


def jaxrl_update_fn(
  graphdef, params, b: dict, response_len: int, packing: bool = False, **loss_fields
):
  """A call that runs one GRPO update of the trainer's own program (``Programs.update``: AdamW at
  lr 1e-6, grad-norm clip 1) on the batch ``b`` (``batch_arrays``) and waits for it; the train
  state (built from ``params``) lives in the closure and is donated step to step. ``packing``:
  the update packed as the trainer packs it (``loss.packing``), else on the padded rows.
  ``loss_fields`` set more ``LossConfig`` fields."""
  import jax
  import numpy as np

  from jaxrl.config import LossConfig, LossSection
  from jaxrl.parallel import sharding
  from jaxrl.rl import optim
  from jaxrl.rl import packing as packing_lib
  from jaxrl.rl.losses import LossHparams
  from jaxrl.rl.programs import Programs
  from jaxrl.types import Rollouts

  mesh = sharding.make_mesh(1, 1, 1)
  programs = Programs(graphdef, params, mesh, optim.adamw(1e-6, 0, grad_clip=1.0))
  state = programs.init_state(params)
  R, P = b["prompt_ids_RxP"].shape
  batch = Rollouts(
    prompt_ids_RxP=b["prompt_ids_RxP"],
    prompt_mask_RxP=np.ones((R, P), bool),
    tokens_RxN=b["tokens_RxN"],
    mask_RxN=b["mask_RxN"],
    loss_mask_RxN=b["mask_RxN"],
    behaviour_logp_RxN=b["old_logp_RxN"],
    entropy_RxN=np.zeros_like(b["old_logp_RxN"]),
    lengths_R=np.sum(b["mask_RxN"], axis=-1, dtype=np.int32),
    group_ids_R=b["group_ids_R"],
    finished_R=np.ones((R,), bool),
    prox_logp_RxN=b["old_logp_RxN"],
    rewards_R=b["rewards_R"],
  )
  loss_cfg = LossConfig(
    num_groups=b["num_groups"],
    max_response_len=response_len,
    informative_only=False,
    **loss_fields,
  )
  pack = None
  if packing:  # the layout the trainer's loop plans on the host (rl/packing.py), default buckets
    mini, micro, buckets = loss_cfg.mini_batches, loss_cfg.micro_batches, LossSection.pack_buckets
    pack = packing_lib.plan(batch.prompt_mask_RxP, batch.mask_RxN, mini, micro, buckets)
    pack = sharding.shard_batch(pack, mesh)
  batch = sharding.shard_batch(batch, mesh)
  update = programs.update(loss_cfg)
  hp = LossHparams.create(tau=1.0)

  def one():
    nonlocal state
    state, metrics = update(state, batch, hp, None, pack)
    jax.block_until_ready((state, metrics))

  return one


def _jaxrl_worker(args):
  import jax
  import jax.numpy as jnp

  from jaxrl.nn import model

  mcfg, graphdef, params = side_by_side.jaxrl_model(args.size, remat=args.remat)
  n_params = model.num_params(params)
  b = batch_arrays(args.rows, args.prompt_len, args.response_len, mcfg.vocab_size)
  one = jaxrl_update_fn(graphdef, params, b, args.response_len)
  del params

  def peak():
    x = jnp.ones((PEAK_N, PEAK_N), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    jax.block_until_ready(mm(x))
    return lambda: jax.block_until_ready(mm(x))

  return one, peak(), n_params


def torch_update_fn(net, b: dict, *, autocast_dtype=None, compile_model: bool = False):
  """A call that runs one update of the PyTorch peer on ``net`` (an HF causal LM in train mode, on
  its device) and the batch ``b`` (``batch_arrays``): the clipped GRPO objective, ``backward``,
  global-norm clip 1, ``torch.optim.AdamW`` at lr 1e-6; then waits for the device.
  ``autocast_dtype``: the forward and loss under ``torch.autocast`` (mixed precision over the
  params' own dtype); ``compile_model``: the model's forward through ``torch.compile``."""
  import torch

  device = next(net.parameters()).device
  opt = torch.optim.AdamW(net.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0)
  forward = torch.compile(net) if compile_model else net
  b = {k: torch.as_tensor(v, device=device) for k, v in b.items() if k != "num_groups"}
  P, N = b["prompt_ids_RxP"].shape[1], b["tokens_RxN"].shape[1]
  input_ids = torch.cat([b["prompt_ids_RxP"], b["tokens_RxN"]], 1).long()
  targets = b["tokens_RxN"].long()
  mask = b["mask_RxN"].float()
  groups = b["group_ids_R"].long()
  eps_low, eps_high = 0.2, 0.28

  def advantages():
    # GRPO: (r - mean_group) / (std_group + 1e-6), as jaxrl's group_advantages
    g = int(groups.max()) + 1
    r = b["rewards_R"]
    zeros = torch.zeros(g, device=device)
    mean = zeros.index_add(0, groups, r) / torch.bincount(groups, minlength=g)
    var = zeros.index_add(0, groups, (r - mean[groups]) ** 2) / torch.bincount(groups, minlength=g)
    return (r - mean[groups]) / (var.sqrt()[groups] + 1e-6)

  def one():
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
      logits = forward(input_ids=input_ids).logits[:, P - 1 : P + N - 1].float()
      logp_all = torch.log_softmax(logits, -1)
      logp = logp_all.gather(-1, targets[..., None])[..., 0]
      with torch.no_grad():  # the entropy metric, as TRL/verl log it
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        _ = (entropy * mask).sum() / mask.sum()
      ratio = torch.exp(logp - b["old_logp_RxN"])
      adv = advantages()[:, None]
      obj = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
      loss = -(obj * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    if device.type == "cuda":
      torch.cuda.synchronize()

  return one


def _torch_worker(args):
  import torch

  net = side_by_side.hf_model(args.size).train()
  net.config.use_cache = False
  if args.remat == "full":
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
  n_params = sum(p.numel() for p in net.parameters())
  b = batch_arrays(args.rows, args.prompt_len, args.response_len, net.config.vocab_size)
  one = torch_update_fn(net, b)

  def peak():
    x = torch.ones(PEAK_N, PEAK_N)
    torch.mm(x, x)
    return lambda: torch.mm(x, x)

  return one, peak(), n_params


def worker_main(args):
  build = _jaxrl_worker if args.worker == "jaxrl" else _torch_worker
  one, peak, n_params = build(args)
  side_by_side.serve({"step": one, "peak": peak}, {"n_params": n_params}, args.warmup)


def measure(args, argv) -> dict:
  timed = side_by_side.alternate(
    os.path.abspath(__file__), argv, SIDES, ("step", "peak"), args.repeats, args.sequential
  )
  tokens = args.rows * (args.prompt_len + args.response_len)
  out = {
    "size": args.size,
    "rows": args.rows,
    "prompt_len": args.prompt_len,
    "response_len": args.response_len,
    "repeats": args.repeats,
    "sequential": args.sequential,
    "remat": args.remat,
    "machine": side_by_side.machine(),
  }
  for side in SIDES:
    t = timed[side]
    median = statistics.median(t["step"])
    n_params = t["info"]["n_params"]
    out[side] = {
      "n_params": n_params,
      "step_s_median": median,
      "step_s_all": t["step"],
      "tokens_per_s": tokens / median,
      "gflops": 6 * n_params * tokens / median / 1e9,
      "matmul_peak_gflops": 2 * PEAK_N**3 / statistics.median(t["peak"]) / 1e9,
      "peak_rss_gib": t["peak_rss_gib"],
    }
    out[side]["frac_of_own_peak"] = out[side]["gflops"] / out[side]["matmul_peak_gflops"]
  out["jaxrl_frac_of_xla_peak"] = out["jaxrl"]["frac_of_own_peak"]
  out["ratio"] = out["jaxrl"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
  if not args.sequential:
    out["ratio_pairs"] = side_by_side.pair_ratios(timed["jaxrl"]["step"], timed["torch"]["step"])
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.worker:
    return worker_main(args)
  result = measure(args, side_by_side.without_flag(argv, "--out"))
  j, t = result["jaxrl"], result["torch"]
  print(
    f"{args.size}: {args.rows} rows × ({args.prompt_len}+{args.response_len}) tokens, "
    f"N = {j['n_params'] / 1e6:.2f}M params, remat {args.remat}, median of {args.repeats}"
  )
  for name, r in (("jaxrl", j), ("torch", t)):
    print(
      f"  {name:5s} {r['step_s_median']:.3f} s/step  {r['tokens_per_s']:,.0f} tokens/s  "
      f"{r['gflops']:.0f} GFLOP/s = {100 * r['frac_of_own_peak']:.0f}% of its library's matmul "
      f"peak ({r['matmul_peak_gflops']:.0f})  peak RSS {r['peak_rss_gib']:.1f} GiB"
    )
  side_by_side.finish(result, args.out)


if __name__ == "__main__":
  main()
