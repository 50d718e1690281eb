"""Benchmark: long-tailed response lengths, and what the sampler and the update spend on padding.

Response lengths (``--lengths``) with budget N: ``lognormal`` (log-normal, σ = 1, mean 25% of N,
cut at N: ~3% of rows reach N) and ``countdown`` (the countdown task's reference solutions + EOS as
a share of its 24-token budget, ``configs/tiny.py``, scaled to N). Two parts, each its own workers
(``side_by_side``: sides alternate call by call; medians and pairwise ratios):

``--part sampler``: the share of decode row-steps spent on rows that had already finished
(``compaction.wasted_share``: a count, no clock), without and with compaction, on both
distributions and on the lengths the timed rows had. Then new tokens/s (the tokens the rows
generated, not padding) of the JAX sampler decoding every row until the last one ends (``padded``,
``rollout.compact_every`` 0: the default) against the compacted decode (``compact``, every 32
tokens), same prompts and keys (so the same samples: checked), HF ``generate`` on the same
weights (``hf``) and the vLLM CPU server (``vllm``: its own venv ``.venv-vllm``, started by the
worker as the trainer's sidecar is, serving the same weights and stopping at the same ids; its
continuous batching never decodes a finished row; ``--without vllm`` leaves it out). A random
model cannot be told each row's length: rows stop at a set of stop ids whose mean probability
under the model (``stop_set``) makes a row end with probability about 1 / (25% of N) per token:
geometric lengths (mean ~25% of N, ~2% reach N), alike on every side in distribution
(``--lengths`` is the update's); the realised lengths are printed.

``--part update``: one GRPO update of R rows whose response masks follow ``--lengths``: jaxrl with
``loss.packing`` on (``packed``) and off (``padded``: every row N wide), and the PyTorch update as
TRL runs it (``torch``: rows padded to the batch's longest response).

    PYTHONPATH=. .venv/bin/python bench/padding.py --part sampler --size 5m --new-tokens 512
    PYTHONPATH=. .venv/bin/python bench/padding.py --part update --size 5m --new-tokens 2048
    PYTHONPATH=. .venv/bin/python bench/padding.py --all     # the grid below -> results/padding.md

``--all`` (``GRID``): 5m at N = 512 (64 rows) and 2,048 (64 rows sampled, 16 updated: PyTorch's
update of 64 rows padded to 2,048 would not fit in 24 GiB), 0.5b at N = 512 (32 rows sampled, 8
updated with each layer recomputed, one side at a time); the update on both distributions. Records
go to ``results/padding.jsonl``, the table to ``results/padding.md``. Run it with nothing else on
the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sampler_vs_hf  # noqa: E402
import side_by_side  # noqa: E402
import train_step_vs_torch  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SAMPLER_SIDES, UPDATE_SIDES = ("padded", "compact", "hf", "vllm"), ("packed", "padded", "torch")
COMPACT_EVERY = 32
MEAN_SHARE = 0.25  # the mean response length, a share of the budget N
COUNTDOWN_BUDGET = 24  # configs/tiny.py's countdown rollout.max_new_tokens
# --all's points: (size, N, the sampler's rows, the update's rows, the update's remat). The 0.5B
# update recomputes each layer so that a side fits in 24 GiB (train_step_vs_torch.py's --remat).
GRID = (("5m", 512, 64, 64, "none"), ("5m", 2048, 64, 16, "none"), ("0.5b", 512, 32, 8, "full"))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("sampler", "update"), default="sampler")
  parser.add_argument("--size", choices=sorted(side_by_side.MODEL_SIZES), default="5m")
  parser.add_argument(
    "--lengths",
    choices=("lognormal", "countdown"),
    default="lognormal",
    help="the update's response lengths (the sampler's rows stop at stop ids)",
  )
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--group", type=int, default=8, help="samples per prompt")
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=512, help="N, the response budget")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--sequential", action="store_true", help="one worker at a time")
  parser.add_argument("--without", nargs="+", default=[], help="sides left out (e.g. hf)")
  parser.add_argument(
    "--remat", choices=("none", "full"), default="none", help="the update recomputes each layer"
  )
  parser.add_argument("--all", action="store_true", help="the issue's grid, then the report")
  parser.add_argument("--report", action="store_true", help="only write results/padding.md")
  parser.add_argument("--out", help="append the result as a JSON line to this file")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rows % args.group:
    parser.error(f"--rows {args.rows} is not a multiple of --group {args.group}")
  if args.size == "0.5b":
    args.sequential = True
  return args


# The length distributions.


def lengths(kind: str, rows: int, budget: int, seed: int = 0) -> np.ndarray:
  """``rows`` response lengths (EOS included) in [1, budget] drawn from ``kind``."""
  rng = np.random.default_rng(seed)
  if kind == "lognormal":
    sigma = 1.0  # mean = exp(mu + σ²/2) = MEAN_SHARE · N
    mu = np.log(MEAN_SHARE * budget) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, rows)), 1, budget).astype(np.int32)
  from jaxrl.tasks.data import countdown

  pairs = countdown.sft_corpus(countdown.CountdownConfig(), rows, seed)
  share = np.array([len(solution) + 1 for _, solution in pairs]) / COUNTDOWN_BUDGET
  return np.clip(np.rint(share * budget), 1, budget).astype(np.int32)


def waste(lengths_R, budget: int) -> dict:
  """The share of decode row-steps spent on finished rows, without and with compaction
  (``compaction.wasted_share``), for rows of these lengths."""
  from jaxrl.rollout import compaction

  return {
    "mean_len": float(np.mean(lengths_R)),
    "padded": compaction.wasted_share(lengths_R, budget),
    "compact": compaction.wasted_share(lengths_R, budget, COMPACT_EVERY),
  }


# The sampler part.


def stop_set(cfg, graphdef, params, prompts_BxP, budget: int) -> tuple[int, ...]:
  """Stop ids whose probabilities, averaged over the model's own continuations of the prompts,
  sum to ~1 / (MEAN_SHARE · budget): each token then ends a row with about that probability."""
  import jax
  import jax.numpy as jnp

  from jaxrl.nn import model
  from jaxrl.rollout import sampler

  B, P = prompts_BxP.shape
  out = sampler.generate(
    graphdef, params, prompts_BxP, np.ones_like(prompts_BxP, bool), np.ones(B, np.int32),
    jax.random.key(123), 1.0, 1.0, num_rollouts=B, max_new_tokens=64, eos_id=-1, pad_id=0,
    model_cfg=cfg,
  )  # fmt: skip
  ids_BxT = jnp.concatenate([out.prompt_ids_RxP, out.tokens_RxN], axis=1)
  mask_BxT = jnp.ones(ids_BxT.shape, bool)
  hidden_BxTxD, lm_head_VxD, _ = model.forward(
    graphdef, params, ids_BxT, model.positions_from_mask(mask_BxT), mask_BxT
  )
  probs_V = np.asarray(jnp.mean(jax.nn.softmax(hidden_BxTxD[:, P - 1 :] @ lm_head_VxD.T), (0, 1)))
  want, chosen = 1.0 / (MEAN_SHARE * budget), []
  for token in np.argsort(probs_V)[::-1]:  # likely ids first: fewer of them, a steadier sum
    if token == 0:  # the pad id
      continue
    if probs_V[chosen].sum() + probs_V[token] <= want * 1.05:
      chosen.append(int(token))
    if probs_V[chosen].sum() >= want * 0.95:
      break
  return tuple(chosen)


def _id_tokenizer(vocab: int, eos: int):
  """A word-level tokenizer whose tokens are the random model's ids ("t0" ... "t{vocab - 1}"):
  vLLM loads a tokenizer with every checkpoint and stops at its EOS, here one of the stop ids."""
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
  raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(
    tokenizer_object=raw, pad_token="t0", unk_token="t0", eos_token=f"t{eos}"
  )


def _vllm_side(args, cfg, params, prompts_BxP, stops, calls):
  """The vLLM CPU server with the weights ``params``, as the trainer's engine drives it."""
  import atexit
  import tempfile

  import jax

  from jaxrl.rollout.engine import SampleRequest
  from jaxrl.rollout.sidecar import LaunchConfig
  from jaxrl.rollout.vllm_engine import EngineConfig, VllmEngine

  work = tempfile.mkdtemp(prefix="bench-padding-vllm-")
  launch = LaunchConfig(
    python=os.path.join(side_by_side.REPO_ROOT, ".venv-vllm", "bin", "python"),
    log_dir=work,
    max_model_len=-(-(args.prompt_len + args.new_tokens) // 16) * 16,
    max_num_seqs=args.rows,
  )
  engine = VllmEngine(
    cfg, _id_tokenizer(cfg.vocab_size, stops[0]), EngineConfig(launch=launch), workdir=work,
    max_new_tokens=args.new_tokens, eos_id=stops, pad_id=0,
  )  # fmt: skip
  atexit.register(engine.close)
  mask_BxP = np.ones_like(prompts_BxP, bool)
  counts_B = np.full(len(prompts_BxP), args.group, np.int32)

  def one():
    key = jax.random.PRNGKey(next(calls))
    out = engine.generate(params, 0, SampleRequest(prompts_BxP, mask_BxP, counts_B, key, 1.0))
    return {"tokens": int(np.asarray(out.mask_RxN).sum())}

  return one, {"stop_ids": len(stops)}


def _sampler_worker(args):
  """One side's call: sample the rows, return the tokens generated (EOS included)."""
  import jax

  cfg, graphdef, params = side_by_side.jaxrl_model(args.size)
  prompts_BxP = sampler_vs_hf.prompts(args.rows // args.group, args.prompt_len, cfg.vocab_size)
  stops = stop_set(cfg, graphdef, params, prompts_BxP, args.new_tokens)
  calls = iter(range(1 << 30))
  if args.worker == "hf":
    import torch

    from jaxrl.nn import hf

    net = side_by_side.hf_model(args.size).eval()
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in hf.to_hf_tensors(params)})
    del params
    prompts = torch.as_tensor(prompts_BxP).long()

    @torch.no_grad()
    def one():
      torch.manual_seed(next(calls))
      seqs = net.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
        temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=args.group,
        max_new_tokens=args.new_tokens, eos_token_id=list(stops), pad_token_id=0, use_cache=True,
      )[:, args.prompt_len :].numpy()  # fmt: skip
      ended_RxN = np.cumsum(np.isin(seqs, stops), axis=1) > 0
      # a row's tokens: up to its first stop id, which counts
      return {"tokens": int(seqs.size - ended_RxN.sum() + ended_RxN.any(1).sum())}

    return one, {"stop_ids": len(stops)}
  if args.worker == "vllm":
    return _vllm_side(args, cfg, params, prompts_BxP, stops, calls)
  from jaxrl.rollout import compaction, sampler

  generate = compaction.generate if args.worker == "compact" else sampler.generate

  def one():
    kw = {"compact_every": COMPACT_EVERY} if args.worker == "compact" else {}
    out = generate(
      graphdef, params, prompts_BxP, np.ones_like(prompts_BxP, bool),
      np.full(args.rows // args.group, args.group, np.int32), jax.random.key(next(calls)), 1.0,
      1.0, num_rollouts=args.rows, max_new_tokens=args.new_tokens, eos_id=stops, pad_id=0,
      model_cfg=cfg, **kw,
    )  # fmt: skip
    lengths_R = np.asarray(out.lengths_R)
    return {"tokens": int(lengths_R.sum()), "lengths": lengths_R.tolist()}

  return one, {"stop_ids": len(stops)}


# The update part.


def update_fn(args, packing: bool | None):
  """One update on R rows whose masks follow ``args.lengths``: jaxrl's with ``loss.packing`` =
  ``packing``, or (None) the PyTorch peer's, rows padded to the batch's longest response."""
  N = args.new_tokens
  lengths_R = lengths(args.lengths, args.rows, N, seed=1)
  if packing is None:
    net = side_by_side.hf_model(args.size).train()
    net.config.use_cache = False
    if args.remat == "full":  # as train_step_vs_torch.py's torch side
      net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    vocab = net.config.vocab_size
    longest = int(lengths_R.max())
    b = train_step_vs_torch.batch_arrays(args.rows, args.prompt_len, N, vocab, lengths_R=lengths_R)
    b = {k: v[:, :longest] if k.endswith("_RxN") else v for k, v in b.items()}
    return train_step_vs_torch.torch_update_fn(net, b)
  cfg, graphdef, params = side_by_side.jaxrl_model(args.size, remat=args.remat)
  b = train_step_vs_torch.batch_arrays(
    args.rows, args.prompt_len, N, cfg.vocab_size, lengths_R=lengths_R
  )
  return train_step_vs_torch.jaxrl_update_fn(graphdef, params, b, N, packing=packing)


def _update_worker(args):
  return update_fn(args, {"packed": True, "padded": False, "torch": None}[args.worker]), {}


# The parent.


def _median_rate(tokens: list[int], seconds: list[float]) -> float:
  return statistics.median(t / s for t, s in zip(tokens, seconds))


def measure(args, argv) -> dict:
  out = {
    "part": args.part, "size": args.size, "rows": args.rows, "remat": args.remat,
    "lengths": args.lengths if args.part == "update" else "stop ids",
    "group": args.group, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
    "repeats": args.repeats, "machine": side_by_side.machine(),
  }  # fmt: skip
  if args.part == "update":
    sides = tuple(s for s in UPDATE_SIDES if s not in args.without)
  else:
    N = args.new_tokens
    out["waste"] = {
      kind: waste(lengths(kind, args.rows, N), N) for kind in ("lognormal", "countdown")
    }
    sides = tuple(s for s in SAMPLER_SIDES if s not in args.without)
  timed = side_by_side.alternate(
    os.path.abspath(__file__), argv, sides, ("call",), args.repeats, args.sequential
  )
  for side in sides:
    s, results = timed[side]["call"], timed[side]["call_out"]
    out[side] = {"s_median": statistics.median(s), "s_all": s, **timed[side]["info"]}
    out[side]["peak_rss_gib"] = timed[side]["peak_rss_gib"]
    if args.part == "sampler":
      out[side]["tokens_all"] = [r["tokens"] for r in results]
      out[side]["tokens_per_s"] = _median_rate(out[side]["tokens_all"], s)
      out[side]["mean_len"] = statistics.mean(out[side]["tokens_all"]) / args.rows
  if {"padded", "compact"} <= set(sides) and args.part == "sampler":  # the timed rows' lengths
    padded, compact = (timed[side]["call_out"] for side in ("padded", "compact"))
    out["waste"]["stop ids"] = waste(np.concatenate([r["lengths"] for r in padded]), N)
    # the same keys: the same samples, so the same lengths, call by call
    out["compact_same_lengths"] = all(a["lengths"] == b["lengths"] for a, b in zip(padded, compact))
  pairs = [("compact", "padded"), ("compact", "hf"), ("padded", "hf"), ("compact", "vllm")]
  if args.part == "update":
    pairs = [("packed", "padded"), ("packed", "torch"), ("padded", "torch")]
  for a, b in [(a, b) for a, b in pairs if a in sides and b in sides]:
    if args.part == "sampler":  # rates: a's tokens/s over b's, repeat by repeat
      ra = [t / s for t, s in zip(out[a]["tokens_all"], out[a]["s_all"])]
      rb = [t / s for t, s in zip(out[b]["tokens_all"], out[b]["s_all"])]
      ratios = sorted(x / y for x, y in zip(ra, rb))
      out[f"{a}_vs_{b}"] = out[a]["tokens_per_s"] / out[b]["tokens_per_s"]
    else:  # times: b's seconds over a's (> 1: a faster)
      ratios = side_by_side.pair_ratios(out[a]["s_all"], out[b]["s_all"])
      out[f"{a}_vs_{b}"] = out[b]["s_median"] / out[a]["s_median"]
    if not args.sequential:
      out[f"{a}_vs_{b}_pairs"] = ratios
  return out


def show(result: dict) -> None:
  r = result
  print(
    f"{r['part']}: {r['size']}, {r['rows']} rows, {r['prompt_len']}-token prompts, N = "
    f"{r['new_tokens']}, {r['lengths']} lengths, median of {r['repeats']}"
  )
  for kind, w in r.get("waste", {}).items():
    print(
      f"  {kind}: mean length {w['mean_len']:.0f}; decode row-steps on finished rows "
      f"{100 * w['padded']:.0f}% padded, {100 * w['compact']:.0f}% compacted"
    )
  if "compact_same_lengths" in r:
    print(f"  compact's lengths equal padded's, call by call: {r['compact_same_lengths']}")
  for side in [s for s in dict.fromkeys(SAMPLER_SIDES + UPDATE_SIDES) if s in r]:
    x = r[side]
    rate = f"  {x['tokens_per_s']:,.0f} tokens/s, mean length {x['mean_len']:.0f}" if (
      "tokens_per_s" in x
    ) else ""  # fmt: skip
    print(f"  {side:8s} {x['s_median']:.3f} s{rate}  peak RSS {x['peak_rss_gib']:.1f} GiB")
  for key, value in r.items():
    if "_vs_" in key and not key.endswith("_pairs"):
      pairs = r.get(key + "_pairs")
      spread = f" (pairwise {pairs[0]:.2f}–{pairs[-1]:.2f})" if pairs else ""
      print(f"  {key.replace('_vs_', ' / ')}: {value:.2f}×{spread}")


def report(path: str) -> str:
  """results/padding.md from the records of ``path`` (the last record of each point)."""
  points = {}
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      points[(r["part"], r["size"], r["new_tokens"], r["lengths"])] = r
  lines = [
    "# Long-tailed response lengths: padding in the sampler and the update",
    "",
    "`bench/padding.py --all` (docstring: distributions, sides, stop ids). Ratios > 1: the first",
    "side faster; in brackets the range of pairwise ratios (repeat i against repeat i).",
    "",
    "| part | size | N | rows | lengths | finished-row share of decode (padded → compacted) "
    "| seconds per side | ratios | machine | commit |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (part, size, n, kind), r in sorted(points.items()):
    share = "; ".join(
      f"{name} (mean {w['mean_len']:.0f}) {100 * w['padded']:.0f}% → {100 * w['compact']:.0f}%"
      for name, w in r.get("waste", {}).items()
    )
    sides = SAMPLER_SIDES if part == "sampler" else UPDATE_SIDES
    secs = ", ".join(f"{s} {r[s]['s_median']:.2f}" for s in sides if s in r)
    ratios = ", ".join(
      f"{k.replace('_vs_', '/')} {v:.2f}"
      + (f" [{r[k + '_pairs'][0]:.2f}–{r[k + '_pairs'][-1]:.2f}]" if k + "_pairs" in r else "")
      for k, v in r.items()
      if "_vs_" in k and not k.endswith("_pairs")
    )
    lines.append(
      f"| {part} | {size} | {n} | {r['rows']} | {kind} | {share} | {secs} | {ratios} "
      f"| {r['machine']} | {r.get('commit', '')} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.worker:
    one, info = (_sampler_worker if args.part == "sampler" else _update_worker)(args)
    return side_by_side.serve({"call": one}, info, args.warmup)
  records = os.path.join(RESULTS, "padding.jsonl")
  if args.all or args.report:
    for size, n, sampler_rows, update_rows, remat in GRID if args.all else ():
      point = ["--size", size, "--new-tokens", str(n), "--repeats", str(args.repeats)]
      point += ["--out", records]
      main(["--part", "sampler", "--rows", str(sampler_rows), *point])
      for kind in ("lognormal", "countdown"):
        update = ["--part", "update", "--lengths", kind, "--remat", remat]
        main([*update, "--rows", str(update_rows), *point])
    with open(os.path.join(RESULTS, "padding.md"), "w") as f:
      f.write(report(records))
    return None
  result = measure(args, side_by_side.without_flag(argv, "--out"))
  show(result)
  side_by_side.finish(result, args.out)
  return result


if __name__ == "__main__":
  main()
