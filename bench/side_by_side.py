"""Two implementations of the same work, each in its own worker process, timed alternately.

Used by the benchmarks that put jaxrl beside a PyTorch peer (``train_step_vs_torch.py``,
``sampler_vs_hf.py``). Each side builds its model and warms up once in a process of its own, so
the two libraries' thread pools never share a process (an OpenMP pool spinning after torch's last
op would steal cycles from XLA's). The parent then asks each worker in turn for one timed call of
each action: load from elsewhere on the machine hits both sides alike, and the ratio of repeat i of
one side to repeat i of the other is a pairwise ratio.

A worker script calls ``serve(actions, info)``; the parent calls ``alternate(...)``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model shapes the peer benchmarks run, both sides alike (Qwen2 layout, untied, random
# weights): name -> (hidden, layers, heads, kv heads, head_dim, ffn, vocab)
MODEL_SIZES = {
  "5m": (256, 4, 8, 4, 32, 1024, 2048),
  "50m": (512, 12, 8, 4, 64, 2048, 8192),
  "0.5b": (896, 24, 14, 2, 64, 4864, 151936),  # Qwen2.5-0.5B's shape
}


def machine() -> str:
  """The CPU model, core count and vector extension (XLA and torch both vectorise for the host:
  AVX-512 and AVX2-only machines give different ratios)."""
  model, flags = "unknown CPU", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
  except OSError:
    pass
  vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
  return f"{model}, {os.cpu_count()} cores, {vector}"


def jaxrl_model(size: str, vocab: int | None = None, remat: str = "none"):
  """(ModelConfig, graphdef, params) of a ``MODEL_SIZES`` shape, vocabulary optionally replaced;
  ``remat`` is ``ModelConfig.remat`` (how the layers run, not what they are)."""
  from jaxrl.nn import model

  d, layers, heads, kv, e, f, v = MODEL_SIZES[size]
  cfg = model.ModelConfig(
    vocab_size=vocab or v, hidden_size=d, intermediate_size=f, num_layers=layers,
    num_heads=heads, num_kv_heads=kv, head_dim=e, remat=remat, rope_theta=1e6,
    tie_embeddings=False,
  )  # fmt: skip
  graphdef, params = model.create(cfg, 0)
  return cfg, graphdef, params


def hf_model(size: str, vocab: int | None = None):
  """The same shape as HF ``Qwen2ForCausalLM`` (float32, eager attention, HF's random init)."""
  import torch
  import transformers

  d, layers, heads, kv, e, f, v = MODEL_SIZES[size]
  torch.manual_seed(0)
  config = transformers.Qwen2Config(
    vocab_size=vocab or v, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
    num_attention_heads=heads, num_key_value_heads=kv, head_dim=e, tie_word_embeddings=False,
    attn_implementation="eager", torch_dtype=torch.float32,
  )  # fmt: skip
  return transformers.Qwen2ForCausalLM(config)


def serve(actions: dict, info: dict, warmup: int) -> None:
  """Worker side: run every action ``warmup`` times, report ready, then time one call per line
  read from stdin (the action's name) and answer with its seconds (and the dict it returned, if
  one: e.g. the tokens a call generated); on EOF report peak RSS."""
  start = time.perf_counter()
  for fn in actions.values():
    for _ in range(warmup):
      fn()
  print(json.dumps(dict(info, ready=True, warmup_s=time.perf_counter() - start)), flush=True)
  for line in sys.stdin:
    fn = actions[line.strip()]
    t0 = time.perf_counter()
    returned = fn()
    reply = {"s": time.perf_counter() - t0}
    print(
      json.dumps(dict(reply, out=returned) if isinstance(returned, dict) else reply), flush=True
    )
  print(json.dumps({"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


class Worker:
  """The parent's handle on one worker: ``script argv --worker side`` with a line protocol."""

  def __init__(self, script: str, argv: list[str], side: str):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    self.side = side
    self.proc = subprocess.Popen(
      [sys.executable, script, *argv, "--worker", side],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=env,
    )
    self.info = self._read()
    if not self.info.get("ready"):
      raise RuntimeError(f"{side} worker did not start: {self.info}")

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"{self.side} worker exited with {self.proc.wait()}")
    return json.loads(line)

  def time(self, action: str) -> tuple[float, object]:
    """One timed call: its seconds and what it returned (None if nothing)."""
    self.proc.stdin.write(action + "\n")
    self.proc.stdin.flush()
    reply = self._read()
    return reply["s"], reply.get("out")

  def close(self) -> float:
    """Stop the worker; its peak resident memory in GiB."""
    self.proc.stdin.close()
    rss = self._read()["peak_rss_gib"]
    self.proc.wait()
    return rss


def alternate(script, argv, sides, actions, repeats: int, sequential: bool) -> dict:
  """Time every action of every side ``repeats`` times, sides alternating call by call (or, with
  ``sequential``, one side's worker after the other's when both do not fit in memory at once).

  Returns ``{side: {"info": ..., "peak_rss_gib": ..., action: [seconds, ...], action + "_out":
  [what each call returned, ...]}}``.
  """
  out = {side: {k: [] for a in actions for k in (a, a + "_out")} for side in sides}
  for group in [(s,) for s in sides] if sequential else [tuple(sides)]:
    workers = {s: Worker(script, argv, s) for s in group}
    for _ in range(repeats):
      for side, w in workers.items():
        for a in actions:
          seconds, returned = w.time(a)
          out[side][a].append(seconds)
          out[side][a + "_out"].append(returned)
    for side, w in workers.items():
      out[side]["info"] = w.info
      out[side]["peak_rss_gib"] = w.close()
  return out


def without_flag(argv: list[str], flag: str) -> list[str]:
  """``argv`` without ``flag VALUE`` / ``flag=VALUE`` (flags only the parent acts on)."""
  kept, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == flag:
      skip = True
    elif not a.startswith(flag + "="):
      kept.append(a)
  return kept


def pair_ratios(ours: list[float], theirs: list[float]) -> list[float]:
  """theirs_i / ours_i (> 1: ours faster) for each repeat i, sorted."""
  return sorted(t / o for o, t in zip(ours, theirs))


def append_jsonl(path: str | None, record: dict) -> None:
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
      f.write(json.dumps(record) + "\n")


def code_version() -> str:
  """The commit measured (``+dirty`` when jaxrl/ has uncommitted changes), or "unknown"."""

  def git(*args):
    return subprocess.run(
      ["git", "-C", REPO_ROOT, *args], capture_output=True, text=True, check=True
    ).stdout.strip()

  try:
    return git("rev-parse", "--short", "HEAD") + (
      "+dirty" if git("status", "--porcelain", "jaxrl") else ""
    )
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def finish(result: dict, out: str | None) -> None:
  """The end of a comparison: the pairwise ratio range, the JSON line appended to ``out`` (with
  the commit measured), and ``ratio R`` as the last line printed (when both sides ran)."""
  result.setdefault("commit", code_version())
  if "ratio_pairs" in result:
    pairs = result["ratio_pairs"]
    print(f"  pairwise ratios {pairs[0]:.2f}–{pairs[-1]:.2f}")
  append_jsonl(out, result)
  if "ratio" in result:
    print(f"ratio {result['ratio']:.3f}")
