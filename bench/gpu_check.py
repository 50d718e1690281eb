"""One command for a GPU host: jaxrl's correctness, speed against PyTorch and memory there.

    python bench/gpu_check.py               # environment + stages 1-5, 7 -> bench/results/gpu.{jsonl,md}
    python bench/gpu_check.py --stages 6    # the 7B LoRA step against --plan, a command of its own
    python bench/gpu_check.py --smoke       # every stage at tiny shapes on CPU, into a temp dir
    make gpu-check PY=python3               # the first line, with the host's Python

First an environment report (versions, device kind and memory, the commit, and the device's
measured bfloat16 matmul peak and copy bandwidth: the references of stages 3 and 4), then:

  1. correctness on the device: a random tiny Qwen2's logits against transformers' on the same
     device (float32 within a rounding bound; bfloat16 no farther from float32 than HF's own
     bfloat16), the golden update (tests/test_golden_update.py), greedy sampling = HF ``generate``;
  2. the embedded default learns: ``configs/tiny.py:quick`` end to end (``--tiny-config``), its
     held-out table before and after RL;
  3. one GRPO update against the PyTorch update TRL and verl run (HF Qwen2, SDPA attention, float32
     params under bfloat16 autocast, AdamW; then the same through ``torch.compile``), at the
     Qwen2.5-1.5B and 0.5B shapes with random weights, 8 x (64 + 512) tokens: tokens/s, MFU against
     the measured matmul peak, peak device memory, ratios;
  4. the JAX sampler against HF ``generate`` with a static cache (bfloat16), 0.5B, 64 rows x
     (64 + 512) tokens, with the decode's achieved memory bandwidth against the measured copy one;
  5. the fused log-prob + entropy at V = 151,936 against the naive [B, T, V] one (time, XLA temp);
  6. ``--plan`` of ``configs/qwen7b.py:lora`` against a real update: random bfloat16 7B weights
     with LoRA, 1 x (64 + 1,024) tokens per micro-batch, the measured peak beside the plan's;
  7. the packed update (``loss.packing``) against the padded one and the PyTorch update padded to
     the batch's longest row, at 0.5B, 16 x (64 + 2,048) tokens with log-normal response lengths
     (mean 25% of the budget: ``bench/padding.py``'s): useful tokens/s and ratios. Stage 1 checks
     the segment-masked attention it runs on this device (cuDNN where the device has it).

Every stage runs in a process of its own (and each side of a comparison in its own again): a
crash, an out-of-memory or ``--timeout`` ends that stage only, each side has the device's memory
to itself, and a peak is the stage's own. Each finished stage appends one JSON line to
OUT/gpu.jsonl and rewrites OUT/gpu.md, so a killed run keeps what finished. Stage 1 imports the
test suite's bounds and fixtures (tests/), which needs pytest. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH)
TESTS = os.path.join(REPO_ROOT, "tests")
sys.path.insert(0, BENCH)

import side_by_side  # noqa: E402

STAGES = {
  1: "correctness on the device",
  2: "the embedded default learns",
  3: "GRPO update vs PyTorch",
  4: "JAX sampler vs HF generate",
  5: "fused log-prob + entropy",
  6: "7B LoRA update vs --plan",
  7: "packed update vs padded",
}
# (hidden, layers, heads, kv heads, head_dim, ffn, vocab): Qwen2.5's shapes, untied, as
# side_by_side.MODEL_SIZES; "tiny" for --smoke.
SHAPES = {
  "0.5b": (896, 24, 14, 2, 64, 4864, 151936),
  "1.5b": (1536, 28, 12, 2, 128, 8960, 151936),
  "tiny": (64, 2, 4, 2, 16, 128, 512),
}
# What each setting is at full size and at --smoke.
FULL = dict(
  rows=8, prompt=64, response=512, sample_rows=64, group=8, new_tokens=512, matmul_n=8192,
  copy_mib=2048, logprob=(8, 576, 896, 151936), lora_tokens=(64, 1024),
  packed=dict(size="0.5b", rows=16, prompt=64, response=2048),
)  # fmt: skip
SMOKE = dict(
  rows=8, prompt=8, response=16, sample_rows=8, group=4, new_tokens=16, matmul_n=256,
  copy_mib=16, logprob=(2, 32, 32, 1024), lora_tokens=(8, 16),
  packed=dict(size="tiny", rows=8, prompt=8, response=64),
)  # fmt: skip


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU is enough")
  parser.add_argument(
    "--stages", help="comma-separated stage numbers (default 1-5, 7; --smoke all)"
  )
  parser.add_argument("--out", help="results directory (default bench/results; --smoke a temp dir)")
  parser.add_argument(
    "--repeats", type=int, help="timed calls per measurement (default 3, smoke 2)"
  )
  parser.add_argument("--timeout", type=float, default=0, help="seconds per stage (0: none)")
  # 1.5B first: the goals are its figures, and a --timeout keeps what finished
  parser.add_argument("--sizes", default="1.5b,0.5b", help="stage 3's model shapes, in order")
  parser.add_argument("--tiny-config", default="configs/tiny.py:quick", help="stage 2's config")
  parser.add_argument("--no-torch-compile", action="store_true", help="stage 3 without it")
  parser.add_argument("--stage-worker", help=argparse.SUPPRESS)  # run one stage (a child)
  parser.add_argument("--side-worker", help=argparse.SUPPRESS)  # run one side (a grandchild)
  args = parser.parse_args(argv)
  default = "1,2,3,4,5,6,7" if args.smoke else "1,2,3,4,5,7"
  args.stages = [int(s) for s in (args.stages or default).split(",") if s.strip()]
  unknown = sorted(set(args.stages) - set(STAGES))
  if unknown:
    parser.error(f"unknown stage(s) {unknown}: choose from {sorted(STAGES)}")
  args.repeats = args.repeats or (2 if args.smoke else 3)
  if set(args.sizes.split(",")) - set(SHAPES):
    parser.error(f"--sizes {args.sizes}: choose from {sorted(SHAPES)}")
  if args.out is None:
    args.out = (
      tempfile.mkdtemp(prefix="jaxrl-gpu-check-") if args.smoke else os.path.join(BENCH, "results")
    )
  return args


# -- the parent: runs each stage in a child process, records and renders -------------------------


def _child_env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
  # JAX and torch share a device in stage 1; elsewhere each grows its pool as it needs it, and
  # torch's caching allocator does the same: neither side starts with 75% of the device.
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  env.setdefault("HF_HUB_OFFLINE", "1")
  env.setdefault("TRANSFORMERS_OFFLINE", "1")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def _run_group(cmd: list[str], timeout: float) -> str | None:
  """Run ``cmd`` in a process group of its own; kill the whole group (workers included) past
  ``timeout`` seconds or on Ctrl-C. Returns why it failed, or None."""
  proc = subprocess.Popen(cmd, env=_child_env(), start_new_session=True)
  try:
    rc = proc.wait(timeout=timeout or None)
  except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if isinstance(e, KeyboardInterrupt):
      raise
    return f"timed out after {timeout:.0f} s"
  return None if rc == 0 else f"exit code {rc}"


def run_stage(name: str, args, run: dict) -> dict:
  """Stage ``name`` ("env" or a number) in a child process; its record (an error included)."""
  path = os.path.join(args.out, f".stage-{name}.json")
  with contextlib.suppress(FileNotFoundError):
    os.remove(path)
  start = time.perf_counter()
  failure = _run_group(
    [sys.executable, __file__, "--stage-worker", name, "--out", args.out], args.timeout
  )
  record = {"stage": name if name == "env" else int(name)}
  if os.path.exists(path):
    with open(path) as f:
      record.update(json.load(f))
    os.remove(path)
  if failure and "error" not in record:
    record["error"] = failure
  record.update(run=run["run"], commit=run["commit"], wall_s=time.perf_counter() - start)
  if name != "env":
    record["name"] = STAGES[int(name)]
  return record


def main(argv=None):
  args = parse_args(argv)
  if args.stage_worker:
    return stage_main(args)
  if args.side_worker:
    return side_main(args.side_worker)
  os.makedirs(args.out, exist_ok=True)
  run = {
    "run": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": side_by_side.code_version(),  # "+dirty": jaxrl/ has uncommitted changes
    "smoke": args.smoke,
    "repeats": args.repeats,
    "sizes": args.sizes.split(","),
    "tiny_config": args.tiny_config,
    "torch_compile": not args.no_torch_compile,
    "settings": SMOKE if args.smoke else FULL,
  }
  with open(os.path.join(args.out, ".run.json"), "w") as f:
    json.dump(run, f)
  # One compilation cache for the stages: stage 6 compiles the update for --plan, then runs it.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxrl-gpu-xla-"))
  print(f"gpu_check: stages {args.stages} into {args.out}", flush=True)
  records = []
  try:
    for name in ["env", *map(str, args.stages)]:
      record = run_stage(name, args, run)
      records.append(record)
      if name == "env":
        with open(os.path.join(args.out, ".env.json"), "w") as f:
          json.dump(record, f)
      with open(os.path.join(args.out, "gpu.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
      with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(render(run, records))
      status = f"error: {record['error']}" if "error" in record else "done"
      print(f"gpu_check: stage {name}: {status} ({record['wall_s']:.0f} s)", flush=True)
  finally:  # the children's inputs; the results stay
    for name in (".run.json", ".env.json"):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(args.out, name))
  return 1 if any("error" in r for r in records) else 0


# -- a stage child ---------------------------------------------------------------------------------


class Stage:
  """What a stage child knows: the run's settings, the environment's record, where to write."""

  def __init__(self, out: str):
    self.out = out
    with open(os.path.join(out, ".run.json")) as f:
      self.run = json.load(f)
    self.smoke = self.run["smoke"]
    self.s = self.run["settings"]
    self.repeats = self.run["repeats"]
    self.env = {}  # the environment's record (its measured peaks), after stage "env"
    with contextlib.suppress(FileNotFoundError), open(os.path.join(out, ".env.json")) as f:
      self.env = json.load(f)
    self.record: dict = {}
    self.path = None

  def report(self, **fields) -> None:
    """Add to the stage's record and write it now: a stage killed later keeps these."""
    self.record.update(fields)
    with open(self.path + ".tmp", "w") as f:
      json.dump(self.record, f)
    os.replace(self.path + ".tmp", self.path)


def stage_main(args) -> int:
  ctx = Stage(args.out)
  ctx.path = os.path.join(args.out, f".stage-{args.stage_worker}.json")
  fn = stage_env if args.stage_worker == "env" else STAGE_FNS[int(args.stage_worker)]
  try:
    fn(ctx)
  except Exception as e:  # recorded, and the parent goes on to the next stage
    traceback.print_exc()
    ctx.report(error=f"{type(e).__name__}: {e}")
    return 1
  return 0


def _timed(fn, repeats: int, inner: int = 1, wait=lambda out: out) -> tuple[float, list[float]]:
  """(seconds of the first call: compilation included, seconds per call of ``repeats`` rounds of
  ``inner`` calls each, issued back to back so that an asynchronous device pipelines them and
  ``wait`` blocks on the last round's outputs)."""
  t0 = time.perf_counter()
  wait(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    wait([fn() for _ in range(inner)])
    times.append((time.perf_counter() - t0) / inner)
  return first, times


def _device() -> str:
  import jax

  return jax.devices()[0].device_kind


def _peak_memory() -> dict:
  """This process's peak: JAX's device allocator when the backend reports it, else its RSS."""
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return {"peak_bytes": int(stats["peak_bytes_in_use"]), "peak_kind": "device"}
  return {
    "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "peak_kind": "rss",
  }


def stage_env(ctx: Stage) -> None:
  import platform

  import jax
  import jax.numpy as jnp

  from jaxrl.nn import attention

  versions = {"python": platform.python_version()}
  for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers"):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  ctx.report(
    versions=versions,
    platform=dev.platform,
    device=dev.device_kind,
    device_count=jax.device_count(),
    device_memory_bytes=stats.get("bytes_limit"),
    environment_info=jax.print_environment_info(return_string=True),
  )
  # The attention the GRPO update of stage 3 runs at 0.5B (bf16, 8 x 576 tokens from slot 0).
  d, layers, h, k, e, f, v = SHAPES["0.5b"]
  q = jax.ShapeDtypeStruct((8, 576, k, h // k, e), jnp.bfloat16)
  fused = attention.fused_implementation(q, jax.ShapeDtypeStruct((8, k, e, 576), jnp.bfloat16), 0)
  ctx.report(attention=f"{fused} fused" if fused else "blocked XLA")

  n = ctx.s["matmul_n"]
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  matmul = jax.jit(lambda x: x @ x)
  _, times = _timed(lambda: matmul(a), ctx.repeats, 10, jax.block_until_ready)
  ctx.report(matmul_n=n, matmul_peak_flops=2 * n**3 / statistics.median(times))
  x = jnp.zeros((ctx.s["copy_mib"] * 2**20 // 4,), jnp.float32)
  copy = jax.jit(lambda x: x + 1)  # reads and writes every byte once
  _, times = _timed(lambda: copy(x), ctx.repeats, 10, jax.block_until_ready)
  ctx.report(copy_bytes=x.nbytes, copy_bandwidth=2 * x.nbytes / statistics.median(times))
  try:
    import torch

    ctx.report(torch_device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
  except ImportError as e:
    ctx.report(torch_device=f"no torch: {e}")


# -- stage 1: correctness --------------------------------------------------------------------------


def _torch_device():
  import torch

  return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check(ctx: Stage, name: str, fn) -> None:
  """Run one check of stage 1; a failing one is recorded and the others still run."""
  try:
    result = fn()
  except Exception as e:
    traceback.print_exc()
    result = {"error": f"{type(e).__name__}: {e}", "ok": False}
  ctx.report(checks=dict(ctx.record.get("checks", {}), **{name: result}))


def _hf_parity(tmp: str) -> dict:
  """The tiny Qwen2 of tests/hf_fixtures.py on a left-padded batch of even T (the GPU's fused
  attention takes it in bfloat16): our logits against transformers' on this device."""
  import hf_fixtures
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers
  from hf_fixtures import our_logits
  from rounding import logits_atol

  from jaxrl.nn import attention, hf_load

  path = hf_fixtures.make_tiny_hf("qwen2", False, os.path.join(tmp, "qwen2"))
  dev = _torch_device()
  lengths_B = np.array([12, 7, 1, 10])
  t = int(lengths_B.max())
  mask = np.arange(t)[None] >= (t - lengths_B)[:, None]
  tokens = np.where(mask, np.random.default_rng(0).integers(1, 160, mask.shape), 0)

  @torch.no_grad()
  def hf_logits(dtype):
    net = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    m = torch.tensor(mask, dtype=torch.long, device=dev)
    positions = (m.cumsum(-1) - 1).clamp(min=0)
    ids = torch.tensor(tokens, device=dev)
    return net(input_ids=ids, attention_mask=m, position_ids=positions).logits.float().cpu().numpy()

  ref = hf_logits(torch.float32)
  cfg, graphdef, params = hf_load.load_hf_checkpoint(path)
  diff = float(np.max(np.abs(our_logits(graphdef, params, tokens, mask) - ref)[mask]))
  atol = logits_atol(cfg, ref[mask], t)
  # bfloat16: not a rounding bound but HF's own bf16 error, as test_hf_parity's bf16 test (1.5x)
  hf_err = np.abs(hf_logits(torch.bfloat16) - ref)[mask]
  cfg16, graphdef16, params16 = hf_load.load_hf_checkpoint(
    path, dtype=jnp.bfloat16, compute_dtype="bfloat16"
  )
  err = np.abs(our_logits(graphdef16, params16, tokens, mask) - ref)[mask]
  q = jnp.zeros(
    (4, t, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim), "bfloat16"
  )
  k = jnp.zeros((4, cfg.num_kv_heads, cfg.head_dim, t), "bfloat16")
  bf16_ok = bool(err.mean() <= 1.5 * hf_err.mean() and err.max() <= 1.5 * hf_err.max())
  return {
    "float32_max_diff": diff,
    "float32_bound": atol,
    "float32_ok": bool(diff <= atol),
    "bfloat16_ok": bf16_ok and bool(np.isfinite(err).all()),
    "bfloat16_mean_err": float(err.mean()),
    "hf_bfloat16_mean_err": float(hf_err.mean()),
    "bfloat16_max_err": float(err.max()),
    "hf_bfloat16_max_err": float(hf_err.max()),
    "bfloat16_attention": attention.fused_implementation(q, k, 0) or "blocked",
    "ok": bool(diff <= atol) and bf16_ok and bool(np.isfinite(err).all()),
  }


def _golden_update() -> dict:
  """tests/test_golden_update.py's off-policy update on this device against its pinned values
  (pinned on a CPU; its bound covers the CPUs CI runs on)."""
  import test_golden_update as golden

  got = golden.run_golden_update()
  exact = ("token_count", "nonfinite_updates", "informative_frac", "dual_clip_frac")
  rel = {k: abs(got[k] - v) / max(abs(v), 1e-30) for k, v in golden.GOLDEN.items()}
  ok = all(
    got[k] == v if k in exact else rel[k] <= golden.ACROSS_CPUS_REL or abs(got[k] - v) <= 1e-7
    for k, v in golden.GOLDEN.items()
  )
  worst = max((k for k in rel if k not in exact), key=rel.get)
  return {
    "max_rel_diff": rel[worst],
    "worst": worst,
    "bound": golden.ACROSS_CPUS_REL,
    "values": got,
    "ok": ok,
  }


def _greedy_vs_hf(tmp: str) -> dict:
  """tests/test_sampler.py's greedy check (its fixtures: tests/sampler_fixtures.py) with
  transformers on this device: the same tokens, where every choice is decided by more than two
  float32 forwards' rounding."""
  import hf_fixtures
  import jax
  import numpy as np
  import sampler_fixtures as ts
  import torch
  import transformers
  from rounding import U, chain_terms

  from jaxrl.nn import hf_load
  from jaxrl.rollout import sampler

  path = hf_fixtures.make_tiny_hf("qwen2", False, os.path.join(tmp, "qwen2-greedy"))
  cfg, graphdef, params = hf_load.load_hf_checkpoint(path)
  ids, mask = ts.left_pad([[15, 99, 3, 42, 7, 120], [61, 8, 150]], 6)
  new, eos = 12, cfg.vocab_size - 1
  out = sampler.generate(
    graphdef, params, ids, mask, np.array([1, 1]), jax.random.key(0), 1.0, 1.0,
    num_rollouts=2, max_new_tokens=new, eos_id=eos, pad_id=ts.PAD, model_cfg=cfg, greedy=True,
  )  # fmt: skip
  dev = _torch_device()
  net = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)
  with torch.no_grad():
    hf_out = net.eval().generate(
      input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
      attention_mask=torch.tensor(mask, dtype=torch.long, device=dev),
      do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=ts.PAD,
    )  # fmt: skip
  hf_tokens = hf_out[:, ids.shape[1] :].cpu().numpy()
  hf_tokens = np.pad(hf_tokens, ((0, 0), (0, new - hf_tokens.shape[1])), constant_values=ts.PAD)
  logits = ts.teacher_forced_logits((graphdef, params), out)
  gap = 2 * chain_terms(cfg, ids.shape[1] + new) * U * float(np.max(np.abs(logits)))
  top2 = np.sort(logits, axis=-1)[..., -2:][np.asarray(out.mask_RxN, bool)]
  lead = float(np.min(top2[:, 1] - top2[:, 0]))
  same = bool(np.array_equal(np.asarray(out.tokens_RxN), hf_tokens))
  return {"same_tokens": same, "min_lead": lead, "twice_gap": 2 * gap, "ok": same}


def _segment_attention() -> dict:
  """Packed rows' attention (segment ids) as the update runs it on this device (``attention``:
  cuDNN's fused call in bfloat16 on an NVIDIA GPU; a CPU has no bfloat16 dot, so float32 there),
  each sequence against itself alone in float32 (tests/test_packing.py's oracle). Bound: the error
  rounding the inputs to the compute dtype makes in the oracle, two roundings of max |v| in that
  dtype (the probabilities and the output), and two float32 evaluations' apart
  (tests/rounding.py: ``attention_atol``)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rounding import attention_atol

  from jaxrl.nn import attention

  b, t, kv, rep, e = 2, 256, 2, 4, 64
  segments_BxT = np.zeros((b, t), np.int32)  # row 0: three sequences and padding; row 1: one
  segments_BxT[0, :100], segments_BxT[0, 100:180], segments_BxT[0, 180:240] = 1, 2, 3
  segments_BxT[1] = 1
  rng = np.random.default_rng(0)
  qkv = [rng.normal(size=shape).astype(np.float32) for shape in
         [(b, t, kv, rep, e), (b, kv, e, t), (b, kv, t, e)]]  # fmt: skip
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  low = [jnp.asarray(x, dtype) for x in qkv]
  implementation = attention.fused_implementation(low[0], low[1], 0) or "xla (blocked)"
  accepted = None
  if implementation == "cudnn":  # whether cuDNN takes it, or ``attention`` falls back
    try:
      jax.block_until_ready(attention.fused_attention(*low, jnp.asarray(segments_BxT), "cudnn"))
      accepted = True
    except Exception as err:  # noqa: BLE001 - recorded: the fallback is what runs then
      accepted = f"{type(err).__name__}: {str(err)[:200]}"
  run = jax.jit(attention.attention, static_argnums=(4, 5))
  got = np.asarray(run(*low, jnp.asarray(segments_BxT), 0, 512), np.float32)
  rounded = [np.asarray(x, np.float32) for x in low]  # the inputs as the compute dtype holds them

  def alone(q, k, v, row, at):
    return np.asarray(attention.attention(
      q[row : row + 1, at], k[row : row + 1][..., at], v[row : row + 1][:, :, at],
      jnp.ones((1, len(at)), bool), 0, len(at),
    )[0])  # fmt: skip

  err, input_err = 0.0, 0.0
  for row in range(b):
    for seg in set(segments_BxT[row].tolist()) - {0}:
      at = np.flatnonzero(segments_BxT[row] == seg)
      exact = alone(*qkv, row, at)
      err = max(err, float(np.max(np.abs(got[row, at] - exact))))
      input_err = max(input_err, float(np.max(np.abs(alone(*rounded, row, at) - exact))))
  unit = float(jnp.finfo(dtype).eps) / 2  # the unit roundoff: a rounding's relative error
  bound = input_err + 2 * unit * float(np.max(np.abs(qkv[2]))) + attention_atol(*qkv)
  return dict(
    implementation=implementation, dtype=jnp.dtype(dtype).name, cudnn_accepted=accepted,
    max_err=err, input_rounding_err=input_err, bound=bound,
    ok=err <= bound and accepted in (None, True),
  )  # fmt: skip


def stage_correctness(ctx: Stage) -> None:
  import jax

  sys.path.insert(0, TESTS)
  # As tests/conftest.py: full float32 matmuls (a GPU's default is TF32), so the float32 bounds
  # hold; torch keeps TF32 off for matmuls by default.
  jax.config.update("jax_default_matmul_precision", "highest")
  ctx.report(device=_device(), torch_device=str(_torch_device()))
  with tempfile.TemporaryDirectory() as tmp:
    _check(ctx, "hf_parity", lambda: _hf_parity(tmp))
    _check(ctx, "golden_update", _golden_update)
    _check(ctx, "greedy_vs_hf_generate", lambda: _greedy_vs_hf(tmp))
    _check(ctx, "segment_attention", _segment_attention)
  ctx.report(ok=all(c.get("ok") for c in ctx.record["checks"].values()))


# -- stage 2: the embedded default learns ----------------------------------------------------------


def stage_tiny_run(ctx: Stage) -> None:
  workdir = tempfile.mkdtemp(prefix="jaxrl-gpu-check-tiny-")  # checkpoints stay out of OUT
  config = "configs/tiny.py:test" if ctx.smoke else ctx.run["tiny_config"]
  cmd = [sys.executable, "-m", "jaxrl.main", f"--config={config}", f"--workdir={workdir}"]
  if ctx.smoke:  # only that it completes: the smallest config, two RL steps
    cmd += ["--config.steps=2", "--config.sft.steps=10"]
  ctx.report(device=_device(), config=config, command=" ".join(cmd[1:]))
  start = time.perf_counter()
  subprocess.run(cmd, check=True, cwd=REPO_ROOT)
  ctx.report(run_s=time.perf_counter() - start, workdir=workdir)
  with open(os.path.join(workdir, "results.md")) as f:
    ctx.report(results_md=f.read())
  with open(os.path.join(workdir, "config.json")) as f:
    steps = json.load(f)["steps"]
  held_out = {}
  for when, name in (("before", "eval_sft.json"), ("after", f"eval_step{steps}.json")):
    with open(os.path.join(workdir, name)) as f:
      e = json.load(f)
    held_out[when] = {"pass@1": e["pass_at"]["1"]["all"], "greedy": e["greedy"]["all"]}
  ctx.report(held_out=held_out, learned=held_out["after"]["pass@1"] > held_out["before"]["pass@1"])


# -- stages 3 and 4: each side in a process of its own ---------------------------------------------


def run_side(ctx: Stage, spec: dict) -> dict:
  """One side of a comparison in a fresh process (``side_main``); its result or its error."""
  path = os.path.join(ctx.out, f".side-{os.getpid()}.json")
  spec = dict(spec, result=path, repeats=ctx.repeats)
  with open(path, "w") as f:
    json.dump(spec, f)
  cmd = [sys.executable, __file__, "--side-worker", path]
  rc = subprocess.run(cmd, env=_child_env()).returncode
  with open(path) as f:
    result = json.load(f)
  os.remove(path)
  result.pop("result", None)
  if rc and "error" not in result:
    result["error"] = f"exit code {rc}"
  return result


def _jaxrl_cfg(shape, **execution):
  from jaxrl.nn import model

  d, layers, heads, kv, e, f, v = shape
  return model.ModelConfig(
    vocab_size=v, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=heads,
    num_kv_heads=kv, head_dim=e, **execution,
  )  # fmt: skip


def _hf_qwen2(shape, dtype_name: str):
  """HF ``Qwen2ForCausalLM`` of ``shape`` (SDPA attention, untied), initialised on the device."""
  import torch
  import transformers

  d, layers, heads, kv, e, f, v = shape
  config = transformers.Qwen2Config(
    vocab_size=v, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
    num_attention_heads=heads, num_key_value_heads=kv, head_dim=e, tie_word_embeddings=False,
    attn_implementation="sdpa",
  )  # fmt: skip
  torch.manual_seed(0)
  with torch.device(_torch_device()):
    return transformers.Qwen2ForCausalLM(config).to(getattr(torch, dtype_name))


def _torch_peak() -> dict:
  import torch

  if torch.cuda.is_available():
    return {"peak_bytes": int(torch.cuda.max_memory_allocated()), "peak_kind": "device"}
  return {
    "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "peak_kind": "rss",
  }


def _build_side(spec: dict):
  """(one call, n_params, device name, peak memory function) of a side."""
  shape = SHAPES[spec["size"]]
  if spec["side"] in ("jaxrl", "jaxrl_sampler"):
    from jaxrl.nn import model

    if spec["side"] == "jaxrl":
      import train_step_vs_torch as ts

      cfg = _jaxrl_cfg(shape, dtype="bfloat16", param_dtype="float32", scan_layers=True)
      graphdef, params = model.create(cfg, 0)
      b = _update_batch(spec, cfg.vocab_size)
      one = ts.jaxrl_update_fn(
        graphdef, params, b, spec["response"], packing=bool(spec.get("packed"))
      )
    else:
      import sampler_vs_hf as sv

      cfg = _jaxrl_cfg(shape, dtype="bfloat16", param_dtype="bfloat16")
      graphdef, params = model.create(cfg, 0)
      prompts = sv.prompts(spec["rows"] // spec["group"], spec["prompt"], cfg.vocab_size)
      one = sv.jaxrl_generate_fn(cfg, graphdef, params, prompts, spec["group"], spec["new"], 1.0)
    return one, model.num_params(params), _device(), _peak_memory
  import torch

  name = str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"
  if spec["side"] in ("torch", "torch_compile"):
    import train_step_vs_torch as ts

    net = _hf_qwen2(shape, "float32").train()
    net.config.use_cache = False
    b = _update_batch(spec, net.config.vocab_size)
    if "lengths" in spec:  # as TRL pads: to the batch's longest response
      longest = max(spec["lengths"])
      b = {k: v[:, :longest] if k.endswith("_RxN") else v for k, v in b.items()}
    compiled = spec["side"] == "torch_compile"
    one = ts.torch_update_fn(net, b, autocast_dtype=torch.bfloat16, compile_model=compiled)
  else:
    import sampler_vs_hf as sv

    net = _hf_qwen2(shape, "bfloat16").eval()
    prompts = sv.prompts(spec["rows"] // spec["group"], spec["prompt"], net.config.vocab_size)
    one = sv.hf_generate_fn(
      net, prompts, spec["group"], spec["new"], 1.0, cache_implementation="static"
    )
  return one, sum(p.numel() for p in net.parameters()), name, _torch_peak


def _update_batch(spec: dict, vocab: int) -> dict:
  """An update's batch: every response ``response`` tokens, or ``lengths`` where the spec has them."""
  import train_step_vs_torch as ts

  return ts.batch_arrays(
    spec["rows"], spec["prompt"], spec["response"], vocab, lengths_R=spec.get("lengths")
  )


def side_main(spec_path: str) -> int:
  with open(spec_path) as f:
    spec = json.load(f)
  result = dict(spec)
  try:
    one, n_params, device, peak = _build_side(spec)
    first, times = _timed(one, spec["repeats"])  # each call waits for its device
    result.update(device=device, n_params=n_params, first_call_s=first, times_s=times)
    result.update(median_s=statistics.median(times), **peak())
  except Exception as e:
    traceback.print_exc()
    result["error"] = f"{type(e).__name__}: {e}"
  with open(spec["result"], "w") as f:
    json.dump(result, f)
  return 1 if "error" in result else 0


def _update_flops(shape, rows: int, tokens: int, n_params: int) -> float:
  """Model FLOPs of one update: 6 per param and token (forward + backward) for every param but
  the input embedding (a gather), plus causal attention's 6·L·H·E·T² per row."""
  d, layers, heads, kv, e, f, v = shape
  return 6 * (n_params - v * d) * rows * tokens + 6 * layers * heads * e * tokens**2 * rows


def stage_update_vs_torch(ctx: Stage) -> None:
  s = ctx.s
  sizes = ["tiny"] if ctx.smoke else ctx.run["sizes"]
  peak = ctx.env.get("matmul_peak_flops")
  tokens = s["rows"] * (s["prompt"] + s["response"])
  ctx.report(rows=s["rows"], prompt=s["prompt"], response=s["response"], sizes={})
  for size in sizes:
    out = {"shape": SHAPES[size]}
    for side in ("jaxrl", "torch", "torch_compile"):
      if side == "torch_compile" and (ctx.smoke or not ctx.run["torch_compile"]):
        why = "--smoke: torch.compile compiles ~50 s on 2 CPU cores even at the tiny shape"
        out[side] = {"skipped": why if ctx.smoke else "--no-torch-compile"}
        continue
      spec = dict(side=side, size=size, rows=s["rows"], prompt=s["prompt"], response=s["response"])
      r = run_side(ctx, spec)
      if "median_s" in r:
        r["tokens_per_s"] = tokens / r["median_s"]
        flops = _update_flops(SHAPES[size], s["rows"], s["prompt"] + s["response"], r["n_params"])
        r["mfu"] = flops / r["median_s"] / peak if peak else None
      out[side] = r
      ctx.report(sizes=dict(ctx.record["sizes"], **{size: out}))
    for peer in ("torch", "torch_compile"):
      if "tokens_per_s" in out["jaxrl"] and "tokens_per_s" in out[peer]:
        out[f"ratio_vs_{peer}"] = out["jaxrl"]["tokens_per_s"] / out[peer]["tokens_per_s"]
    ctx.report(sizes=dict(ctx.record["sizes"], **{size: out}))
  _raise_side_errors(ctx.record["sizes"])


def _raise_side_errors(by_size: dict) -> None:
  errors = [f"{size}/{side}: {r['error']}" for size, sides in by_size.items()
            for side, r in sides.items() if isinstance(r, dict) and "error" in r]  # fmt: skip
  if errors:
    raise RuntimeError("; ".join(errors))


def _decode_bytes(shape, rows: int, prompt: int, new: int, itemsize: int = 2) -> float:
  """Bytes one decode step must read: the head (V·D) and the layers' matrices (not the input
  embedding, a gather of R rows; norms and biases are too small to count), and the KV cache at its
  mean length P + N/2."""
  d, layers, heads, kv, e, f, v = shape
  n_params = v * d + layers * (d * (heads + 2 * kv) * e + heads * e * d + 3 * d * f)
  cache = rows * layers * 2 * kv * e * (prompt + new / 2)
  return (n_params + cache) * itemsize


def stage_sampler_vs_hf(ctx: Stage) -> None:
  s = ctx.s
  size = "tiny" if ctx.smoke else "0.5b"
  spec = dict(size=size, rows=s["sample_rows"], group=s["group"], prompt=s["prompt"])
  spec["new"] = s["new_tokens"]
  ctx.report(**spec, sides={})
  step_bytes = _decode_bytes(SHAPES[size], s["sample_rows"], s["prompt"], s["new_tokens"])
  for side in ("jaxrl_sampler", "hf_generate"):
    r = run_side(ctx, dict(spec, side=side))
    if "median_s" in r:
      r["new_tokens_per_s"] = s["sample_rows"] * s["new_tokens"] / r["median_s"]
      # the whole call (prefill and sampling too): a lower bound on the decode's bandwidth
      r["decode_bandwidth"] = step_bytes * s["new_tokens"] / r["median_s"]
      copy = ctx.env.get("copy_bandwidth")
      r["frac_of_copy_bandwidth"] = r["decode_bandwidth"] / copy if copy else None
    ctx.report(sides=dict(ctx.record["sides"], **{side: r}))
  sides = ctx.record["sides"]
  if all("new_tokens_per_s" in r for r in sides.values()):
    ratio = sides["jaxrl_sampler"]["new_tokens_per_s"] / sides["hf_generate"]["new_tokens_per_s"]
    ctx.report(ratio=ratio)
  _raise_side_errors({size: sides})


# -- stage 5: fused log-probs ----------------------------------------------------------------------


def stage_fused_logprob(ctx: Stage) -> None:
  import fused_logprob

  from jaxrl.nn.logprobs import DEFAULT_CHUNK_SIZE

  B, T, D, V = ctx.s["logprob"]
  ctx.report(device=_device(), B=B, T=T, D=D, V=V, chunk=DEFAULT_CHUNK_SIZE)
  result = fused_logprob.compare(B, T, D, V, 1.0, [DEFAULT_CHUNK_SIZE], ctx.repeats)
  ctx.report(**result, table=fused_logprob.table_rows(result))


# -- stage 6: the 7B LoRA update against --plan ----------------------------------------------------


def _lora_config(ctx: Stage):
  """``configs/qwen7b.py:lora`` at 4 rows (e3's smallest group) of P + N tokens, one row per
  micro-batch as the config runs them; --smoke: the same on a tiny model section."""
  from jaxrl.config import from_configdict
  from jaxrl.run import cli

  p, n = ctx.s["lora_tokens"]
  cd = cli.load_config(os.path.join(REPO_ROOT, "configs", "qwen7b.py") + ":lora")
  overrides = {
    "batch_questions": 1, "rollout.group_size": 4, "loss.micro_batches": 4,
    "task.max_prompt_len": p, "rollout.max_new_tokens": n,
    "anneal_phase.group_size": 0, "anneal_phase.max_new_tokens": 0,
  }  # fmt: skip
  if ctx.smoke:
    d, layers, heads, kv, e, f, v = SHAPES["tiny"]
    overrides.update({
      "model.vocab_size": v, "model.hidden_size": d, "model.intermediate_size": f,
      "model.num_layers": layers, "model.num_heads": heads, "model.num_kv_heads": kv,
      "model.head_dim": e, "model.lora.rank": 8,
    })  # fmt: skip
  cd.update_from_flattened_dict(overrides)
  return from_configdict(cd)


def _random_params(abstract, shardings, seed: int = 0):
  """Random weights of ``abstract``'s shapes and dtypes, leaf by leaf and at most 64 slices of a
  leaf at a time (``lax.map``), so making them never holds a float32 copy of a whole leaf: the
  process's peak memory stays the update's."""
  import functools

  import jax

  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(seed), len(leaves))

  def fill(key, x, sh):
    scale = x.shape[-1] ** -0.5

    @functools.partial(jax.jit, out_shardings=sh)
    def make(key):
      if x.ndim < 2:
        return (1 + 0.1 * jax.random.normal(key, x.shape)).astype(x.dtype)
      slices = jax.random.split(key, x.shape[0])
      normal = lambda k: (scale * jax.random.normal(k, x.shape[1:])).astype(x.dtype)  # noqa: E731
      return jax.lax.map(normal, slices, batch_size=-(-x.shape[0] // 64))

    return make(key)

  flat_sh = treedef.flatten_up_to(shardings)
  return jax.tree.unflatten(treedef, [fill(k, x, s) for k, x, s in zip(keys, leaves, flat_sh)])


def stage_lora_vs_plan(ctx: Stage) -> None:
  import jax
  import numpy as np

  from jaxrl.config import loss_config
  from jaxrl.nn import model
  from jaxrl.parallel import sharding
  from jaxrl.rl import step
  from jaxrl.rl.losses import LossHparams
  from jaxrl.rl.programs import Programs, reference_copy
  from jaxrl.run import plan, plan_estimate
  from jaxrl.run.phases import run_phases
  from jaxrl.types import Rollouts

  cfg = _lora_config(ctx)
  pc = run_phases(cfg)[0].cfg
  R, P, N = pc.num_rollouts, plan_estimate.prompt_len(pc), pc.rollout.max_new_tokens
  ctx.report(device=_device(), config="configs/qwen7b.py:lora", rows=R, prompt=P, response=N)
  the_plan = plan.build(cfg, rollout_side=False)
  ph = the_plan.phases[0]
  ctx.report(
    plan_estimate_bytes=the_plan.train_peak(ph),
    plan_compiled_peak_bytes=ph.compiled[0].peak if ph.compiled else None,
    plan_state_bytes=the_plan.state,
    plan_skipped=the_plan.skipped,
    n_params=sum(int(np.prod(w.shape)) * w.leaves for w in the_plan.weights),
  )
  mcfg = the_plan.model_cfg
  mesh, _ = plan.plan_mesh(cfg)
  graphdef, abstract = model.abstract(mcfg)
  programs = Programs.for_run(cfg.optim, graphdef, abstract, mesh)
  params = _random_params(abstract, programs.param_shardings)
  # Not the jitted ``Programs.init_state``: its outputs are copies, so the process would peak at
  # twice the base before the update; eagerly, the state holds these very arrays.
  state = jax.device_put(
    step.init_state(params, programs.tx, programs.trainable), programs.state_shardings
  )
  ref = params if reference_copy(pc.loss, pc.model) else None
  del params
  rng = np.random.default_rng(0)
  mask = np.ones((R, N), bool)
  batch = Rollouts(
    prompt_ids_RxP=rng.integers(0, mcfg.vocab_size, (R, P)).astype(np.int32),
    prompt_mask_RxP=np.ones((R, P), bool),
    tokens_RxN=rng.integers(0, mcfg.vocab_size, (R, N)).astype(np.int32),
    mask_RxN=mask,
    loss_mask_RxN=mask,
    behaviour_logp_RxN=(-rng.random((R, N)) * 4 - 0.5).astype(np.float32),
    prox_logp_RxN=(-rng.random((R, N)) * 4 - 0.5).astype(np.float32),
    entropy_RxN=np.zeros((R, N), np.float32),
    lengths_R=np.full((R,), N, np.int32),
    group_ids_R=np.zeros((R,), np.int32),
    finished_R=np.ones((R,), bool),
    rewards_R=np.array([1, 0, 0, 1] * (R // 4) + [0] * (R % 4), np.float32),
  )
  batch = sharding.shard_batch(batch, mesh)
  hp = LossHparams.from_config(pc.loss, pc.modulation, pc.rollout.temperature, pc.loss.eps_high)
  update = programs.update(loss_config(pc))
  jax.block_until_ready(state)
  before = _peak_memory()
  start = time.perf_counter()
  state, metrics = update(state, batch, hp, ref)
  jax.block_until_ready((state, metrics))
  ctx.report(
    first_update_s=time.perf_counter() - start,
    peak_before_update_bytes=before["peak_bytes"],
    loss=float(metrics["loss"]),
    **_peak_memory(),
  )
  ctx.report(
    measured_over_estimate=ctx.record["peak_bytes"] / ctx.record["plan_estimate_bytes"],
    measured_over_compiled=(
      ctx.record["peak_bytes"] / ctx.record["plan_compiled_peak_bytes"]
      if ctx.record["plan_compiled_peak_bytes"]
      else None
    ),
  )


def stage_packed_update(ctx: Stage) -> None:
  """The update on long-tailed responses: packed and padded jaxrl (bf16 over f32 params, layers
  scanned, as stage 3), and PyTorch padded to the batch's longest row (stage 3's torch side)."""
  import padding

  p = ctx.s["packed"]
  lengths_R = padding.lengths("lognormal", p["rows"], p["response"], seed=1).tolist()
  useful = p["rows"] * p["prompt"] + sum(lengths_R)  # prompt and response tokens, no padding
  ctx.report(**p, lengths=lengths_R, useful_tokens=useful, sides={})
  for name, side, packed in (("packed", "jaxrl", True), ("padded", "jaxrl", False),
                             ("torch", "torch", None)):  # fmt: skip
    spec = dict(side=side, size=p["size"], rows=p["rows"], prompt=p["prompt"])
    spec.update(response=p["response"], lengths=lengths_R, packed=packed)
    r = run_side(ctx, spec)
    if "median_s" in r:
      r["tokens_per_s"] = useful / r["median_s"]
    r.pop("lengths", None)
    ctx.report(sides=dict(ctx.record["sides"], **{name: r}))
  sides = ctx.record["sides"]
  for peer in ("padded", "torch"):
    if "tokens_per_s" in sides["packed"] and "tokens_per_s" in sides[peer]:
      ratio = sides["packed"]["tokens_per_s"] / sides[peer]["tokens_per_s"]
      ctx.report(**{f"ratio_vs_{peer}": ratio})
  _raise_side_errors({p["size"]: sides})


STAGE_FNS = {
  1: stage_correctness,
  2: stage_tiny_run,
  3: stage_update_vs_torch,
  4: stage_sampler_vs_hf,
  5: stage_fused_logprob,
  6: stage_lora_vs_plan,
  7: stage_packed_update,
}


# -- gpu.md ----------------------------------------------------------------------------------------


def _gib(n) -> str:
  if n is None:
    return "–"
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _num(x, fmt="{:.3g}") -> str:
  return "–" if x is None else fmt.format(x)


def _scaled(x, unit):
  return None if x is None else x / unit


def _env_md(run: dict, env: dict) -> list[str]:
  v = env.get("versions", {})
  lines = [
    "# jaxrl on one GPU: `bench/gpu_check.py`",
    "",
    f"Run {run['run']}, commit `{run['commit']}`"
    f"{', **--smoke** (tiny shapes)' if run['smoke'] else ''}; medians of {run['repeats']}.",
    "",
  ]
  if "error" in env:
    return lines + [f"Environment report failed: {_err(env)}", ""]
  versions = ", ".join(f"{k} {v[k]}" for k in v)
  lines += [
    "| environment | |",
    "|---|---|",
    f"| device (JAX) | {env.get('device')} x {env.get('device_count')} ({env.get('platform')}) |",
    f"| device (torch) | {env.get('torch_device')} |",
    f"| device memory | {_gib(env.get('device_memory_bytes'))} |",
    f"| versions | {versions} |",
    f"| bf16 matmul peak, measured ({env.get('device')}) | "
    f"{_num(_scaled(env.get('matmul_peak_flops'), 1e12), '{:.1f}')} TFLOP/s "
    f"({env.get('matmul_n')}³) |",
    f"| copy bandwidth, measured ({env.get('device')}) | "
    f"{_num(_scaled(env.get('copy_bandwidth'), 1e9), '{:.0f}')} GB/s |",
    f"| attention of the bf16 update | {env.get('attention')} |",
    "",
  ]
  return lines


def _err(r: dict) -> str:
  """An error on one line (a table cell), at most 300 characters."""
  text = " ".join(str(r["error"]).split())
  return f"`{text[:300]}`"


def _mark(ok) -> str:
  return "✓" if ok else "✗"


def _stage1_md(r: dict) -> list[str]:
  rows = []
  for name, c in r.get("checks", {}).items():
    if "error" in c:
      rows.append(f"| {name} | error: {_err(c)} | | ✗ |")
    elif name == "hf_parity":
      rows.append(
        f"| HF parity, float32 logits | max diff {c['float32_max_diff']:.2e} | "
        f"≤ {c['float32_bound']:.2e} (rounding bound) | {_mark(c['float32_ok'])} |"
      )
      rows.append(
        f"| HF parity, bfloat16 logits ({c['bfloat16_attention']} attention) | error vs f32: "
        f"mean {c['bfloat16_mean_err']:.3g}, max {c['bfloat16_max_err']:.3g} | ≤ 1.5x HF bf16's: "
        f"mean {c['hf_bfloat16_mean_err']:.3g}, max {c['hf_bfloat16_max_err']:.3g} | "
        f"{_mark(c['bfloat16_ok'])} |"
      )
    elif name == "golden_update":
      rows.append(
        f"| golden update | max rel. diff {c['max_rel_diff']:.2e} ({c['worst']}) | "
        f"≤ {c['bound']:.0e} (across CPUs) | {_mark(c['ok'])} |"
      )
    elif name == "segment_attention":
      how = c["implementation"] + ("" if c["cudnn_accepted"] in (None, True) else
                                   f" (refused: {c['cudnn_accepted']}; blocked instead)")  # fmt: skip
      rows.append(
        f"| packed rows' attention, {c['dtype']}, {how} | max err vs each sequence alone (f32) "
        f"{c['max_err']:.3g} | ≤ {c['bound']:.3g} (inputs' rounding {c['input_rounding_err']:.3g}"
        f" + 2 roundings of max abs v + f32 evaluation) | {_mark(c['ok'])} |"
      )
    else:
      rows.append(
        f"| sampler greedy = HF generate | same tokens: {c['same_tokens']} | min lead "
        f"{c['min_lead']:.3g} > {c['twice_gap']:.2g} | {_mark(c['ok'])} |"
      )
  return ["| check | measured | bound | ok |", "|---|---|---|---|", *rows]


def _stage2_md(r: dict) -> list[str]:
  h = r.get("held_out")
  out = [f"`{r.get('command', '')}`: {_num(r.get('run_s'), '{:.0f}')} s."]
  if h:
    out += [
      "",
      f"Held-out pass@1 {100 * h['before']['pass@1']:.1f} → {100 * h['after']['pass@1']:.1f}, "
      f"greedy {100 * h['before']['greedy']:.1f} → {100 * h['after']['greedy']:.1f}.",
    ]
  return out + (["", r["results_md"].split("\n", 2)[-1].strip()] if "results_md" in r else [])


def _side_cells(r: dict, rate_key: str) -> list[str]:
  if "skipped" in r:
    return [f"skipped: {r['skipped']}", "", "", ""]
  if "error" in r:
    return [f"error: {_err(r)}", "", "", ""]
  return [
    f"{r[rate_key]:,.0f}",
    f"{r['median_s']:.3f}",
    _gib(r["peak_bytes"]) + (" (RSS)" if r["peak_kind"] == "rss" else ""),
    r.get("device", ""),
  ]


def _stage3_md(r: dict) -> list[str]:
  out = [
    f"{r.get('rows')} rows x ({r.get('prompt')} + {r.get('response')}) tokens; jaxrl: "
    "`Programs.update`, bf16 compute over f32 params, layers scanned; PyTorch: HF Qwen2 (SDPA), "
    "f32 params under bf16 autocast, AdamW. MFU: model FLOPs (6 per non-embedding param and "
    "token + causal attention) over the measured bf16 matmul peak.",
    "",
    "| shape | side | tokens/s | s/update | MFU | peak memory | device | jaxrl / side |",
    "|---|---|---:|---:|---:|---:|---|---:|",
  ]
  for size, sides in r.get("sizes", {}).items():
    for side in ("jaxrl", "torch", "torch_compile"):
      if side not in sides:
        continue
      s = sides[side]
      rate, secs, peak, device = _side_cells(s, "tokens_per_s")
      mfu = _num(s.get("mfu"), "{:.1%}")
      ratio = _num(sides.get(f"ratio_vs_{side}"), "{:.2f}")
      out.append(f"| {size} | {side} | {rate} | {secs} | {mfu} | {peak} | {device} | {ratio} |")
  return out


def _stage4_md(r: dict) -> list[str]:
  out = [
    f"{r.get('rows')} rows ({r.get('group')} per prompt) x ({r.get('prompt')} + {r.get('new')}) "
    f"tokens at shape {r.get('size')}, bf16, τ = 1, full softmax. Decode bandwidth: the bytes a "
    "decode step reads (weights + mean KV cache) per token step over the whole call.",
    "",
    "| side | new tokens/s | s/call | peak memory | device | decode GB/s | of copy bw |",
    "|---|---:|---:|---:|---|---:|---:|",
  ]
  for side, s in r.get("sides", {}).items():
    rate, secs, peak, device = _side_cells(s, "new_tokens_per_s")
    bw = _num(_scaled(s.get("decode_bandwidth"), 1e9), "{:.0f}")
    frac = _num(s.get("frac_of_copy_bandwidth"), "{:.0%}")
    out.append(f"| {side} | {rate} | {secs} | {peak} | {device} | {bw} | {frac} |")
  return out + ["", f"jaxrl / HF: **{_num(r.get('ratio'), '{:.2f}')}**"]


def _stage5_md(r: dict) -> list[str]:
  head = f"B={r.get('B')} T={r.get('T')} D={r.get('D')} V={r.get('V')} on {r.get('device')}:"
  return [head, "", *r.get("table", [])]


def _stage6_md(r: dict) -> list[str]:
  rows = [
    ("plan: estimated peak (state + gradients + activations)", r.get("plan_estimate_bytes")),
    ("plan: XLA's compiled peak of the update", r.get("plan_compiled_peak_bytes")),
    (f"measured peak ({r.get('peak_kind', '?')}) on {r.get('device')}", r.get("peak_bytes")),
    ("measured peak before the update (weights, state)", r.get("peak_before_update_bytes")),
  ]
  return [
    f"`{r.get('config')}`: {r.get('rows')} rows x ({r.get('prompt')} + {r.get('response')}) "
    f"tokens, one row per micro-batch; {_num(_scaled(r.get('n_params'), 1e6), '{:,.1f}')}M params.",
    "",
    "| memory | bytes |",
    "|---|---:|",
    *(f"| {name} | {_gib(v)} |" for name, v in rows),
    "",
    f"measured / estimate {_num(r.get('measured_over_estimate'), '{:.2f}')}, measured / "
    f"compiled {_num(r.get('measured_over_compiled'), '{:.2f}')}.",
  ]


def _stage7_md(r: dict) -> list[str]:
  lengths = r.get("lengths") or [0]
  out = [
    f"{r.get('rows')} rows x ({r.get('prompt')} + {r.get('response')}) slots at shape "
    f"{r.get('size')}, responses log-normal (mean {statistics.mean(lengths):.0f}, longest "
    f"{max(lengths)}): {r.get('useful_tokens')} useful tokens per update, the rate's numerator "
    "on every side. packed: `loss.packing`; padded: every row N wide; torch: rows cut to the "
    "longest response.",
    "",
    "| side | useful tokens/s | s/update | peak memory | device |",
    "|---|---:|---:|---:|---|",
  ]
  for side, s in r.get("sides", {}).items():
    out.append("| " + " | ".join([side, *_side_cells(s, "tokens_per_s")]) + " |")
  return out + [
    "",
    f"packed / padded: **{_num(r.get('ratio_vs_padded'), '{:.2f}')}**, packed / torch: "
    f"**{_num(r.get('ratio_vs_torch'), '{:.2f}')}**",
  ]


BOOKKEEPING = {"stage", "name", "error", "run", "commit", "wall_s", "device"}
STAGE_MD = {
  1: _stage1_md,
  2: _stage2_md,
  3: _stage3_md,
  4: _stage4_md,
  5: _stage5_md,
  6: _stage6_md,
  7: _stage7_md,
}


def render(run: dict, records: list[dict]) -> str:
  """gpu.md: the environment and a section per finished stage, in the order they ran."""
  env = next((r for r in records if r["stage"] == "env"), {})
  lines = _env_md(run, env)
  for r in records:
    if r["stage"] == "env":
      continue
    lines += [f"## {r['stage']}. {r['name']} ({r.get('device', env.get('device'))})", ""]
    if "error" in r:
      lines += [f"**Error**: {_err(r)}", ""]
    if set(r) - BOOKKEEPING:  # a partial record shows what it has
      with contextlib.suppress(KeyError, TypeError, ValueError):
        lines += STAGE_MD[r["stage"]](r) + [""]
  return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
  sys.exit(main())
