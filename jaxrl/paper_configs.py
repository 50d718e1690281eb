"""The papers' math RL runs as ConfigDicts: base models, data, budgets and each method's settings.

``configs/qwen7b.py`` and ``configs/qwen1_5b.py`` are thin files over ``math_config``. The base run is
E3's (arXiv 2505.18573, §5.1): DeepSeek-R1-Distill-Qwen, 64 questions x G = 8 per step at τ = 1,
responses up to 6k tokens, one policy update per sampling, 480 steps (3 epochs of 10k questions),
lr 2e-6 (7B) / 5e-6 (1.5B), E3 allocation (bounds widen by 2 per epoch) and the temperature
scheduler with annealing from ⌊0.6 T⌋ with η = 0.9. The other papers' methods are variants of it:
``:grpo`` (the baseline), ``:dynamo``, ``:eepo``, ``:es``; ``test`` shrinks everything for a unit test.

Weights and data come from the environment or flags: ``JAXRL_MODELS`` (default ``models``) holds the
checkpoint directories under their hub names, ``JAXRL_DATA`` (default ``data/math``) holds
``train.jsonl`` and ``val.jsonl`` (fields ``problem``, ``answer``); or set ``--config.model.checkpoint``
and ``--config.data.train`` / ``--config.data.heldout`` directly.
"""

from __future__ import annotations

import os

from jaxrl.config import default_configdict

# config.json of the base models (what --plan uses before the weights are downloaded; a downloaded
# checkpoint's own config.json always wins).
ARCHITECTURES = {
  "7b": dict(
    hub_id="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    qk_norm=False,
    tie_embeddings=False,
  ),
  "1.5b": dict(
    hub_id="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    qk_norm=False,
    tie_embeddings=False,
  ),
}
# E3 §5.1: 8 A100s for the 7B run, 4 for the 1.5B run; lr 2e-6 and 5e-6.
_SIZES = {"7b": dict(devices=8, lr=2e-6), "1.5b": dict(devices=4, lr=5e-6)}
METHODS = ("e3", "grpo", "dynamo", "eepo", "es")
OPTIONS = ("test", "lora")


def _base(size: str):
  c = default_configdict()
  arch = dict(ARCHITECTURES[size])
  hub_id = arch.pop("hub_id")
  for key, value in arch.items():
    setattr(c.model, key, value)
  c.model.hub_id = hub_id
  # An absolute path: "models/NAME" would read as the Hub id of an org called "models".
  c.model.checkpoint = os.path.abspath(
    os.path.join(os.environ.get("JAXRL_MODELS", "models"), hub_id.split("/")[1])
  )
  # bfloat16 compute on float32 master weights: at lr 2e-6 a bfloat16 weight (8 bits of mantissa)
  # would round most updates away. model.param_dtype = "bfloat16" halves param memory if wanted.
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.scan_layers = True  # compile time does not grow with the 28 layers
  c.model.remat = "full"  # per layer: only layer inputs are kept for the backward

  c.task.name = "math"
  c.task.max_prompt_len = 1024
  data = os.environ.get("JAXRL_DATA", os.path.join("data", "math"))
  c.data.train = os.path.join(data, "train.jsonl")
  c.data.heldout = os.path.join(data, "val.jsonl")
  c.data.template = "boxed"
  c.sft.steps = 0  # the distilled model already answers in the format

  c.steps = 480
  c.batch_questions = 64
  c.rollout.group_size = 8
  c.rollout.max_new_tokens = 6144
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.engine = "vllm"  # one sidecar per host; `rollout.engine=jax` also works
  c.vllm.dtype = "bfloat16"
  c.vllm.max_num_seqs = 256

  c.optim.learning_rate = _SIZES[size]["lr"]
  c.optim.warmup_steps = 0
  c.optim.weight_decay = 0.01  # verl's actor default (E3 trains with verl)
  c.optim.b2 = 0.999
  c.optim.grad_clip = 1.0
  c.loss.aggregation = "token-mean"
  c.loss.eps_low = 0.2
  c.loss.eps_high = 0.2  # E3 uses the symmetric clip
  c.loss.mini_batches = 1  # "experiences ... update the policy only once"
  c.loss.micro_batches = 16  # 512 rows → 32 per micro-batch: 4 per device on 8
  c.loss.logprob_chunk = 512
  c.mesh.fsdp = _SIZES[size]["devices"]

  c.eval.num_samples = 16  # E3's protocol: 16 samples at τ = 1, pass@1 and pass@16
  c.eval.temperature = 1.0
  c.eval.ks = "1,16"
  c.eval.every = 40
  c.checkpoint.every = 20
  c.checkpoint.keep = 3
  c.log.progress = False
  return c


def _apply_method(c, method: str) -> None:
  if method == "e3":
    c.allocation.method = "e3"
    c.allocation.e3.step = 2  # G_max + 2, G_min - 2 per epoch
    c.temperature.method = "e3"
    c.temperature.anneal = True
    c.temperature.eta = 0.9  # annealing from floor(0.6 T) (the default start)
  elif method == "dynamo":  # DynaMO §5 on DAPO-Math-17k: τ = 1, top-p 1
    c.allocation.method = "dynamo"
    c.modulation.enabled = True
  elif method == "eepo":  # EEPO §5: α = 0.3, η = 3e-3, plain GRPO otherwise
    c.eepo.enabled = True
    c.eepo.alpha = 0.3
    c.eepo.lr = 3e-3
  elif method == "es":  # Entropy Scheduling: adaptive clip-higher, stable → anneal
    c.clip.method = "adaptive"
    c.clip.schedule = "stable_then_anneal"
    c.clip.c0 = 0.28  # DAPO's clip-higher value as the starting point
    c.anneal_phase.enabled = True  # ES §5: more rollouts and longer answers while annealing
    c.anneal_phase.group_size = 16
    c.anneal_phase.max_new_tokens = 8192
    c.allocation.g_max = 16


def _apply_test(c) -> None:
  """A 2-step run on a tiny checkpoint with the JAX sampler: the same code path, CPU-sized."""
  c.steps = 2
  c.batch_questions = 2
  c.rollout.group_size = 4
  c.rollout.max_new_tokens = 16
  c.rollout.engine = "jax"
  c.task.max_prompt_len = 96
  c.loss.micro_batches = 2
  c.loss.logprob_chunk = 16
  c.mesh.fsdp = 1
  c.model.dtype = "float32"
  c.eval.num_samples = 2
  c.eval.ks = "1,2"
  c.eval.every = 1
  c.data.max_heldout = 4
  c.checkpoint.every = 1
  c.reward.workers = 1
  c.allocation.e3.g_min_floor = 2
  c.allocation.e3.g_max_cap = 6
  c.allocation.g_min = 2
  c.allocation.g_max = 6
  c.anneal_phase.group_size = 0
  c.anneal_phase.max_new_tokens = 0


def math_config(size: str, arg: str = ""):
  """The ConfigDict of ``configs/qwen{size}.py:ARG``; ARG = [METHOD][,test], METHOD default e3."""
  parts = [p.strip() for p in arg.split(",") if p.strip()]
  unknown = [p for p in parts if p not in METHODS + OPTIONS]
  if unknown:
    raise ValueError(
      f"unknown config variant {unknown[0]!r} (methods: {', '.join(METHODS)}; "
      f"options: {', '.join(OPTIONS)})"
    )
  methods = [p for p in parts if p in METHODS] or ["e3"]
  if len(methods) > 1:
    raise ValueError(f"one method per run, got {methods}")
  c = _base(size)
  _apply_method(c, methods[0])
  if "lora" in parts:
    _apply_lora(c)
  if "test" in parts:
    _apply_test(c)
  return c


def _apply_lora(c) -> None:
  """LoRA on one device: rank 64 on every projection over a frozen bfloat16 base (adapters and
  their moments float32), the KL reference = the base with adapters off (no copy). One row per
  micro-batch keeps the 8k-token activations small. The learning rate is 10x the full
  fine-tuning one, as "LoRA Without Regret" (Thinking Machines, 2025) found optimal for LoRA.
  Two devices: ``--config.mesh.fsdp=2 --config.loss.micro_batches=256`` (a micro-batch must
  split over the devices)."""
  c.model.lora.rank = 64
  c.model.lora.alpha = 64.0
  c.model.param_dtype = "bfloat16"
  c.mesh.fsdp = 1
  c.loss.micro_batches = c.batch_questions * c.rollout.group_size  # one row each
  c.optim.learning_rate = 10 * c.optim.learning_rate
