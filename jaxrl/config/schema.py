"""The config's schema: every section as a frozen dataclass with its defaults and its own checks,
the ``Config`` that holds them, and ``ConfigError``.

Config files (``configs/*.py``) stay Python and return a ConfigDict; ``jaxrl.config.validate``
turns it into these dataclasses at the boundary and validates it before anything is compiled. Every
problem raises ``ConfigError`` naming the dotted field; ``jaxrl.main`` prints that one line and
exits 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import typing
from typing import Any, Literal

# Allowed values, declared once: the converter enforces them and the code that branches on them
# (losses, model, engines) reads them from here (``typing.get_args``).
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
# docs/algorithms.md §9: the update's corrections, and auto (tis for rollout.engine=vllm, none for
# the JAX sampler; ``resolved_correction``)
Correction = Literal["none", "tis", "mis", "seq-mis"]
BehaviourCorrection = Literal["auto", Correction]
Remat = Literal["none", "full", "dots", "offload"]
LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]  # projections an adapter sits on
Dtype = Literal["float32", "bfloat16"]
Engine = Literal["jax", "vllm"]
WeightTransfer = Literal["files", "nccl"]
LoraSync = Literal["adapter", "merged"]
VllmDtype = Literal["", "float32", "bfloat16", "float16"]
TaskName = Literal["arithmetic", "countdown", "math"]
Overlength = Literal["drop", "truncate", "error"]
OldLogpFrom = Literal["rollout", "policy"]
UnlearnClip = Literal["straight-through", "paper"]
Overlong = Literal["keep", "drop", "reward"]  # a response the budget cut (docs/algorithms.md §10)
# How reward.terms combine into one reward (docs/algorithms.md §13)
RewardCombine = Literal["sum-then-normalise", "normalise-then-sum"]
# Where a judge's score is read in its reply (``jaxrl.tasks.rewards.judge.parse_score``)
JudgeParse = Literal["score", "boxed", "last-number"]


class ConfigError(ValueError):
  """A broken config: ``field`` is the dotted path of the offending entry."""

  def __init__(self, field: str, message: str | None = None):
    if message is None:  # rebuilt from its text: ml_collections re-raises a config file's
      super().__init__(field)  # errors as type(e)(text with the traceback)
      self.field = ""
      return
    super().__init__(f"config.{field}: {message}")
    self.field = field


def _need(ok: bool, field: str, message: str) -> None:
  if not ok:
    raise ConfigError(field, message)


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a number of the config may take: from ``low`` (itself allowed when ``low_ok``) to
  ``high`` (itself allowed), never NaN. A value outside fails later (a division by zero, NaN steps,
  an allocation numpy refuses) or silently changes the run (a negative clip turning clipping off),
  so each section's ``check`` refuses it, naming the field."""

  low: float = -math.inf
  low_ok: bool = True
  high: float = math.inf
  note: str = ""  # what a special value means, e.g. " (0 = off)"

  def holds(self, value: float) -> bool:
    above = value >= self.low if self.low_ok else value > self.low
    return above and value <= self.high  # NaN compares False

  def __str__(self) -> str:
    if self.high == math.inf:
      return f"{'>=' if self.low_ok else '>'} {self.low}{self.note}"
    return f"in {'[' if self.low_ok else '('}{self.low}, {self.high}]{self.note}"


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
POSITIVE = Range(0, low_ok=False)
FRACTION = Range(0, high=1)  # a probability, a share, a threshold on one


def _check_ranges(section: str, obj, ranges: dict[str, Range]) -> None:
  """Each number ``ranges`` names of the section ``obj`` in its range (a ConfigError naming it)."""
  for name, allowed in ranges.items():
    value = getattr(obj, name)
    _need(allowed.holds(value), f"{section}.{name}", f"must be {allowed}, got {value}")


def _need_seconds(value: float, field: str) -> None:
  """A timeout: a positive, finite number of seconds (an infinite wait never ends)."""
  _need(0 < value < math.inf, field, f"must be a finite number of seconds > 0, got {value}")


# The least address space a verifier worker may be given (reward.memory_limit_mb, its RLIMIT_AS).
# Measured (CPython 3.11, x86-64, 2 cores): a worker that has imported the math verifier (sympy,
# latex2sympy, numpy) and scored its warm-up pair peaks at 186 MiB of address space (VmPeak); under
# a 160 MiB limit it dies while starting, under 192 MiB it starts and scores. numpy's OpenBLAS adds
# ~40 MiB per thread it starts (one per core, up to 64), so hosts with more cores need more than
# the 2-core figure. 512 MiB is ~2.7x that figure: room for other builds, a few more threads and
# the sympy work of real answers; below it a worker would start on few hosts.
MIN_REWARD_MEMORY_MB = 512
# The least address space a tool worker may be given (tool.memory_limit_mb). Measured (CPython
# 3.11, x86-64): a calculator worker (the interpreter, numpy with one BLAS thread, jaxrl.tasks.envs)
# peaks at 100 MiB of address space (VmPeak); 256 MiB is 2.5x that, room for a tool's own imports.
MIN_TOOL_MEMORY_MB = 256


@dataclasses.dataclass(frozen=True)
class LoraSection:
  """LoRA adapters trained in RL instead of the whole model (``rank`` 0: full fine-tuning).

  The base weights stay frozen (no gradients, no optimizer state); the KL reference is the base
  (adapters switched off); checkpoints hold the adapters and their optimizer state; a vLLM
  sidecar receives the adapter, or the merged weights (``vllm.lora_sync``)."""

  rank: int = 0
  alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
  targets: str = "q,k,v,o,gate,up,down"  # comma-separated projections carrying an adapter

  def target_names(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.targets.split(",") if t.strip())

  def check(self) -> None:
    _need(self.rank >= 0, "model.lora.rank", f"must be >= 0 (0 = off), got {self.rank}")
    _need(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
    names = self.target_names()
    unknown = sorted(set(names) - set(typing.get_args(LoraTarget)))
    _need(
      bool(names) and not unknown,
      "model.lora.targets",
      f"{self.targets!r}: each target must be one of {', '.join(typing.get_args(LoraTarget))}",
    )


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """The policy's architecture (or ``checkpoint``, an HF directory that defines it) and its dtypes."""

  vocab_size: int = 0  # 0: take the tokenizer's size
  hidden_size: int = 128
  intermediate_size: int = 384
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  rope_theta: float = 10_000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = True
  qk_norm: bool = False
  tie_embeddings: bool = True
  dtype: Dtype = "float32"  # compute dtype of activations and matmuls
  param_dtype: Dtype = "float32"  # storage dtype of the params (and so of their gradients)
  scan_layers: bool = (
    False  # layers stacked on one axis and lax.scan'ed: compile time flat in depth
  )
  remat: Remat = "none"  # per-layer rematerialisation: none | full | dots | offload
  attention_block: int = 512  # most queries per attention block (equal blocks): O(block x T) memory
  # HF-layout directory to start from ("" = random init + SFT). Its config.json then defines the
  # architecture (the fields above up to tie_embeddings only describe a model built from scratch,
  # or one planned with --plan before its weights are downloaded).
  checkpoint: str = ""  # HF directory, or a Hub id ORG/NAME[@REVISION] (through the HF cache)
  hub_id: str = ""  # where to download ``checkpoint`` from, for the error message
  lora: LoraSection = LoraSection()

  def check(self) -> None:
    self.lora.check()
    sizes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "attention_block")
    _check_ranges("model", self, dict.fromkeys(sizes, AT_LEAST_1))
    _check_ranges(
      "model",
      self,
      dict(
        vocab_size=Range(0, note=" (0 = the task's)"), rope_theta=POSITIVE, rms_norm_eps=POSITIVE
      ),
    )
    _need(
      self.num_heads % max(self.num_kv_heads, 1) == 0 and self.num_kv_heads > 0,
      "model.num_kv_heads",
      f"num_heads={self.num_heads} must be a positive multiple of num_kv_heads={self.num_kv_heads}",
    )
    _need(self.head_dim % 2 == 0, "model.head_dim", "must be even (RoPE)")


@dataclasses.dataclass(frozen=True)
class TaskSection:
  """The task: the built-in arithmetic (levels, sizes, layout) or countdown (levels, sizes), or
  ``math`` (datasets in ``data``)."""

  name: TaskName = "arithmetic"
  # "" = the task's default grid; arithmetic: "da x db op, ..." e.g. "1x1+,2x2+"; countdown:
  # "COUNTnMAX, ..." e.g. "3n9,4n19" (COUNT numbers in 1..MAX)
  levels: str = ""
  num_train_per_level: int = 400
  num_heldout_per_level: int = 48
  reverse_answer: bool = True  # arithmetic: answers written least-significant digit first
  digit_width: int = (
    0  # > 0: aligned layout, numbers zero-padded LSB-first (see data/arithmetic.py)
  )
  max_prompt_len: int = 0  # 0: the longest prompt of the task (+BOS); else a fixed P
  # The levels the SFT corpus draws from, each with an optional relative weight (default 1), e.g.
  # "2x2+,5x1+,5x3*:0.1"; "" = every level, equally.
  sft_levels: str = ""
  # A name of tasks.envs.registry.ENVIRONMENTS: the model's turns are answered by that environment
  # (multi-turn rollouts, limits in rollout.max_turns ...); "" = none, single-turn. "calculator":
  # <calc>EXPR</calc> is answered <result>VALUE</result>; the arithmetic task then uses its tools
  # vocabulary and shows the calls in its SFT corpus.
  environment: str = ""
  # The built-in calculator task in a chat template: its ``tools_chat`` vocabulary adds ChatML's
  # <|im_start|> and <|im_end|> (its EOS, the end of every model turn); prompts, observations (the
  # tool's answer in the tool role, then the assistant header) and the SFT corpus are framed as an
  # instruct model reads them. (The math task frames observations when data.chat_template is on.)
  chat_template: bool = False

  def check(self) -> None:
    _check_ranges(
      "task",
      self,
      dict(
        num_train_per_level=AT_LEAST_1,
        num_heldout_per_level=AT_LEAST_1,
        max_prompt_len=Range(0, note=" (0 = the longest prompt)"),
        digit_width=Range(0, note=" (0 = numbers as usual)"),
      ),
    )


@dataclasses.dataclass(frozen=True)
class DataSection:
  """Math datasets for ``task.name = "math"``: local jsonl / parquet / ``datasets.save_to_disk``
  dirs, or Hub datasets ``hf:ORG/NAME[:CONFIG][:SPLIT]`` (their parquet files, through the HF cache)."""

  train: str = ""  # "PATH[:WEIGHT],..." a weighted mixture of datasets (PATH may be hf:ORG/NAME...)
  heldout: str = ""  # validation set, evaluated before/after and every eval.every steps
  split: str = "train"  # the split of a DatasetDict saved with save_to_disk
  question_field: str = "problem"  # dotted paths into a row, e.g. "reward_model.ground_truth"
  answer_field: str = "answer"
  id_field: str = ""  # "" = the row number
  level_field: str = ""  # "" = one level; else rows are grouped by this field's value
  strict: bool = False  # a row with an empty question or missing answer is an error
  template: str = "boxed"  # boxed (asks for \boxed{}) | plain | a string with {question}
  system_prompt: str = ""
  chat_template: bool = True  # wrap in the tokenizer's chat template when it has one
  overlength: Overlength = (
    "drop"  # prompts longer than task.max_prompt_len: drop | truncate | error
  )
  max_heldout: int = 0  # 0 = every held-out question

  def check(self) -> None:
    _need(self.max_heldout >= 0, "data.max_heldout", "must be >= 0")
    _need(
      re.fullmatch(r"\w+(\.\w+)*", self.split) is not None,  # the datasets library's rule
      "data.split",
      f"{self.split!r} is not a split name (letters, digits, _ and .)",
    )


@dataclasses.dataclass(frozen=True)
class RewardSection:
  """Math rewards run in a pool of worker processes (``jaxrl.tasks.rewards.pool``); further reward
  terms (a Python callable, a reward model, a judge model) combine with the verifier (``terms``)."""

  fn: str = ""  # "" = the task's verifier; else "module:function"
  workers: int = 0  # 0 = min(8, CPUs)
  time_limit: float = 5.0  # seconds per answer; over it the answer scores 0 (counted)
  memory_limit_mb: int = 4096  # address space per worker (RLIMIT_AS); >= MIN_REWARD_MEMORY_MB
  # "KIND[:SOURCE][*WEIGHT],..." (``jaxrl.config.reward_terms``); "" = the verifier alone, weight 1.
  # They score beside the next batch's generation when rollout.max_staleness >= 1 with the vllm
  # engine, not beside it otherwise (docs/rewards.md, "When the terms score")
  terms: str = ""
  combine: RewardCombine = "sum-then-normalise"
  # A reward model reads at most this many tokens of prompt + response (the last ones: its score
  # is read at the last token); longer inputs are cut on the left and counted
  model_max_tokens: int = 2048
  model_rows: int = 64  # rows per reward-model forward: its activations' memory is that many rows'
  # A callable term's call on one batch (fn:) may take this long; over it that batch's values of the
  # term are None, counted in reward_term_<label>_failed, and the call is abandoned (a thread)
  fn_time_limit: float = 300.0
  # The judge term (judge:URL or judge:sidecar, docs/rewards.md). judge_model: with a URL, the model
  # name sent ("" = the one the endpoint lists); with sidecar, the checkpoint the run serves (a
  # directory or a Hub id)
  judge_model: str = ""
  judge_template: str = (
    ""  # "" = the built-in prompt; else a text file with {question} {response} …
  )
  judge_parse: JudgeParse = "score"  # the last "Score: X", the last \boxed{X}, or the last number
  judge_min: float = 0.0  # the scale the judge scores on; the term's value is
  judge_max: float = 10.0  # (score - judge_min) / (judge_max - judge_min), in [0, 1]
  judge_workers: int = 8  # requests in flight at once
  judge_timeout: float = 60.0  # seconds per request
  judge_retries: int = 2  # per request, after a failed connection, a time-out, HTTP 429 or 5xx
  judge_backoff: float = 1.0  # seconds before the first retry, doubled before each next one
  judge_max_tokens: int = 512  # the judge's reply budget (max_tokens of the request)
  judge_temperature: float = 0.0
  judge_api_key_env: str = ""  # the environment variable holding the endpoint's API key (Bearer)
  judge_max_model_len: int = 4096  # sidecar: the served judge's context (prompt + reply)
  judge_extra_args: str = ""  # sidecar: appended to its server's command line

  def check(self) -> None:
    # (the terms' syntax: ``config.validate`` parses them)
    _need(self.model_max_tokens >= 1, "reward.model_max_tokens", "must be >= 1")
    _need(self.model_rows >= 1, "reward.model_rows", "must be >= 1")
    _need_seconds(self.fn_time_limit, "reward.fn_time_limit")
    _need_seconds(self.judge_timeout, "reward.judge_timeout")
    _check_ranges(
      "reward",
      self,
      dict(
        judge_workers=AT_LEAST_1,
        judge_retries=AT_LEAST_0,
        judge_backoff=Range(0, high=3600),
        judge_max_tokens=AT_LEAST_1,
        judge_temperature=AT_LEAST_0,
        judge_max_model_len=Range(16),
      ),
    )
    _need(
      self.judge_min < self.judge_max and math.isfinite(self.judge_max - self.judge_min),
      "reward.judge_min",
      f"the judge's scale [{self.judge_min}, {self.judge_max}] must be finite with min < max",
    )
    _need(
      re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.judge_api_key_env or "_") is not None,
      "reward.judge_api_key_env",
      f"{self.judge_api_key_env!r} is not an environment variable's name (the key itself goes "
      "in that variable, never in the config)",
    )
    _need(self.workers >= 0, "reward.workers", "must be >= 0 (0 = min(8, CPUs))")
    _need_seconds(self.time_limit, "reward.time_limit")
    _need(
      self.memory_limit_mb >= MIN_REWARD_MEMORY_MB,
      "reward.memory_limit_mb",
      f"must be >= {MIN_REWARD_MEMORY_MB} (MiB of address space per verifier worker; a worker "
      f"needs about 200 MiB to start), got {self.memory_limit_mb}",
    )


@dataclasses.dataclass(frozen=True)
class ToolSection:
  """Tool calls of ``task.environment`` run in a pool of worker processes (``jaxrl.tasks.workers``),
  started at the first call."""

  workers: int = 0  # 0 = min(4, CPUs)
  time_limit: float = 2.0  # seconds per call; over it the model reads an error observation
  memory_limit_mb: int = 1024  # address space per worker (RLIMIT_AS); >= MIN_TOOL_MEMORY_MB
  # With a chat template, the role of a tool's answer ("tool": ChatML and Llama 3.1's own templates,
  # which render it as their tool / ipython message)
  chat_role: str = "tool"

  def check(self) -> None:
    _need(self.workers >= 0, "tool.workers", "must be >= 0 (0 = min(4, CPUs))")
    _need_seconds(self.time_limit, "tool.time_limit")
    _need(
      self.memory_limit_mb >= MIN_TOOL_MEMORY_MB,
      "tool.memory_limit_mb",
      f"must be >= {MIN_TOOL_MEMORY_MB} (MiB of address space per tool worker), "
      f"got {self.memory_limit_mb}",
    )


@dataclasses.dataclass(frozen=True)
class SFTSection:
  """The supervised warm start of a model without a checkpoint (the tiny task)."""

  steps: int = 600  # at most this many steps
  batch_size: int = 128
  learning_rate: float = 3e-3
  warmup_steps: int = 30
  weight_decay: float = 0.0
  target_loss: float = 0.0  # > 0: stop once the loss (EMA) is below it

  def check(self) -> None:
    _check_ranges("sft", self, dict(batch_size=AT_LEAST_1))
    _check_ranges("sft", self, dict.fromkeys(("steps", "warmup_steps", "target_loss"), AT_LEAST_0))
    _need(
      0 < self.learning_rate < math.inf,
      "sft.learning_rate",
      f"must be > 0 and finite, got {self.learning_rate}",
    )
    _need(
      0 <= self.weight_decay < math.inf,
      "sft.weight_decay",
      f"must be >= 0 and finite, got {self.weight_decay}",
    )


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  """Sampling: the engine (``jax`` or ``vllm``), G, τ, lengths, staleness and dynamic sampling."""

  engine: Engine = "jax"
  group_size: int = 8  # G: rollouts per question (uniform allocation)
  max_new_tokens: int = 8
  temperature: float = 1.0
  top_p: float = 1.0
  # k: a step trains on rollouts sampled by params at most k updates older than its own; k >= 1
  # with an engine that runs beside the trainer (vllm) generates the next steps' rollouts while
  # the current step's reward terms and update run (docs/algorithms.md §9, docs/rewards.md)
  max_staleness: int = 0
  # DAPO's dynamic sampling (docs/algorithms.md §10): draw rounds of batch_questions until that
  # many groups have a learning signal (rewards not all equal), at most max_rounds rounds per step
  dynamic_sampling: bool = False
  max_rounds: int = 4
  # Multi-turn rollouts (task.environment set): the response of max_new_tokens holds every model
  # turn and every observation; a turn ends at the environment's stop sequence, EOS or
  # max_turn_tokens; the environment's answer is at most max_observation_tokens (cut beyond).
  max_turns: int = 4  # model turns per trajectory (the environment answers at most max_turns - 1)
  max_turn_tokens: int = 0  # tokens of one model turn; 0 = up to max_new_tokens
  max_observation_tokens: int = 64
  # A response the budget cut (no EOS; a multi-turn one: no room or turn left, or a turn's T
  # tokens): "keep" scores it as any; "drop" (DAPO's overlong filtering) sets it aside, out of the
  # loss, the statistics and its group's advantage; "reward" scores it overlong_reward. Counted
  # as overlong_rows either way.
  overlong: Overlong = "keep"
  overlong_reward: float = 0.0
  # The JAX sampler's single-turn decode drops finished rows every compact_every tokens, so long-
  # tailed lengths stop paying for rows that ended (jaxrl/rollout/compaction.py: the same tokens
  # for the same seed; bench/results/padding.md: 1.9-2.5x the tokens/s); 0 decodes every row
  # until the last one finishes. Off on several processes (a warning) and for budgets <= it.
  compact_every: int = 32

  def check(self) -> None:
    _need(self.group_size >= 1, "rollout.group_size", "must be >= 1")
    _need(
      math.isfinite(self.overlong_reward),
      "rollout.overlong_reward",
      f"must be finite, got {self.overlong_reward}",
    )
    _need(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    _need(self.max_turns >= 1, "rollout.max_turns", f"must be >= 1, got {self.max_turns}")
    _need(
      0 <= self.max_turn_tokens <= self.max_new_tokens,
      "rollout.max_turn_tokens",
      f"must be in [0, max_new_tokens={self.max_new_tokens}] (0 = up to max_new_tokens), "
      f"got {self.max_turn_tokens}",
    )
    _need(
      self.max_observation_tokens >= 1,
      "rollout.max_observation_tokens",
      f"must be >= 1, got {self.max_observation_tokens}",
    )
    _need(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0")
    _need(self.max_rounds >= 1, "rollout.max_rounds", "must be >= 1")
    _need(self.compact_every >= 0, "rollout.compact_every", "must be >= 0 (0: no compaction)")
    _need(self.temperature > 0, "rollout.temperature", "must be > 0")
    _need(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class VllmSection:
  """The vLLM sidecar (``rollout.engine = "vllm"``): launched from ``python``, or attached by ``urls``."""

  # The sidecar's Python ("" = $JAXRL_VLLM_PYTHON, else .venv-vllm/bin/python in the working
  # directory, else the checkout's: what `make vllm-env` builds).
  python: str = ""
  # "" = launch a server (one per process); else comma-separated URLs to attach to, shared by every
  # process (each host's localhost) or one group per process separated by ";"
  urls: str = ""
  dtype: VllmDtype = ""  # "" = model.dtype
  max_model_len: int = 0  # 0 = prompt length + the longest response of any phase
  max_num_seqs: int = 64
  startup_timeout: float = 300.0  # seconds until /health answers
  request_timeout: float = 120.0  # seconds per completion request
  retries: int = 2  # per request, before the rollout counts as failed
  max_restarts: int = 2  # sidecar restarts per rollout before the run stops
  sync_every: int = 1  # push the weights every k steps (k > 1: rollouts up to k-1 stale)
  weight_transfer: WeightTransfer = (
    "files"  # files (HF safetensors + reload_weights) | nccl (GPU only)
  )
  weights_dir: str = ""  # "" = tmpfs (/dev/shm) when it has room, else WORKDIR/sidecar
  extra_args: str = ""  # appended to the server's command line
  cpus: str = ""  # CPU build: cores the launched server is pinned to ("1", "0,2-3"); "" = inherit
  # With model.lora: "adapter" = the server holds the base and each push loads the PEFT adapter
  # (megabytes) through vLLM's runtime LoRA loading; "merged" = W + (alpha/r) A B pushed as full
  # weights, as a full fine-tuning run pushes.
  lora_sync: LoraSync = "adapter"

  def check(self) -> None:
    _need(self.sync_every >= 1, "vllm.sync_every", "must be >= 1")
    _check_ranges("vllm", self, dict(max_model_len=Range(0, note=" (0 = what the run needs)")))
    _need(self.max_num_seqs >= 1, "vllm.max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
    _need(
      all(p.replace("-", "", 1).isdigit() for p in self.cpus.split(",")) if self.cpus else True,
      "vllm.cpus",
      f"{self.cpus!r} is not a list of cores such as '1' or '0,2-3'",
    )
    _need(
      self.retries >= 0 and self.max_restarts >= 0,
      "vllm.retries",
      "retries and max_restarts must be >= 0",
    )
    _need_seconds(self.startup_timeout, "vllm.startup_timeout")
    _need_seconds(self.request_timeout, "vllm.request_timeout")


@dataclasses.dataclass(frozen=True)
class OptimSection:
  """AdamW for the RL updates."""

  # RL learning rate. On the tiny task 1e-3 collapsed the policy within 200 steps (reward 0.40 →
  # 0.01); 3e-4 and 5e-4 both rose steadily (0.54 → 0.87 in 150 steps), 3e-4 with smaller
  # gradient norms.
  learning_rate: float = 3e-4
  warmup_steps: int = 10
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  b1: float = 0.9
  b2: float = 0.99
  state_dtype: Dtype = "float32"  # AdamW moments (float32 even for bfloat16 params)
  max_nonfinite_steps: int = 5  # consecutive steps with a skipped non-finite update → stop

  def check(self) -> None:
    _need(self.max_nonfinite_steps >= 1, "optim.max_nonfinite_steps", "must be >= 1")
    _check_ranges(
      "optim",
      self,
      dict(warmup_steps=AT_LEAST_0, grad_clip=Range(0, note=" (0 = no clipping)")),
    )
    _need(
      0 < self.learning_rate < math.inf,
      "optim.learning_rate",
      f"must be > 0 and finite, got {self.learning_rate}",
    )
    for name in ("b1", "b2"):  # Adam's moment decay rates
      value = getattr(self, name)
      _need(0 <= value < 1, f"optim.{name}", f"must be in [0, 1), got {value}")
    _need(
      0 <= self.weight_decay < math.inf,
      "optim.weight_decay",
      f"must be >= 0 and finite, got {self.weight_decay}",
    )


@dataclasses.dataclass(frozen=True)
class LossSection:
  """The GRPO-family objective: aggregation, clipping, KL, entropy bonus, behaviour correction."""

  aggregation: Aggregation = "token-mean"
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 0.0  # 0 = off; else c > 1
  kl_coef: float = 0.0  # > 0 turns on KL to the frozen reference (the SFT policy)
  kl_estimator: KLEstimator = "k3"
  entropy_coef: float = 0.0
  informative_only: bool = True
  scale_by_std: bool = True
  mini_batches: int = 1  # optimizer updates per step; > 1 makes later updates off-policy
  micro_batches: int = 1  # gradient accumulation within each mini-batch
  logprob_chunk: int = 128  # tokens per chunk of the fused log-prob (bench/fused_logprob.py)
  # Packed update (jaxrl.rl.packing): the forward reads each sequence's real tokens only, packed
  # side by side into buffers of P + N; the objective is the padded update's (docs/algorithms.md
  # §1.6). Buffer rows per micro-batch come from pack_buckets values: that many programs at most.
  packing: bool = True
  pack_buckets: int = 4
  # Per-token objective weights for rollouts sampled by another policy μ (docs/algorithms.md §9)
  behaviour_correction: BehaviourCorrection = "auto"
  tis_cap: float = 2.0  # tis: weights truncated at this
  mis_low: float = 0.5  # mis, seq-mis: weights outside [mis_low, mis_high] mask the token
  mis_high: float = 2.0

  def check(self) -> None:
    """The values that become ``rl.losses.LossHparams`` (traced, so checked here only); what
    becomes the static ``LossConfig`` is checked where it is built (its ``__post_init__``)."""
    _need(self.eps_low >= 0 and self.eps_high >= 0, "loss.eps_low", "clip ranges must be >= 0")
    _need(
      self.eps_low < 1,
      "loss.eps_low",
      f"must be < 1 (the ratio is clipped below at 1 - eps_low, and no ratio is <= 0: the clip "
      f"would be off), got {self.eps_low}",
    )
    _check_ranges(
      "loss",
      self,
      dict(logprob_chunk=AT_LEAST_1, mini_batches=AT_LEAST_1, pack_buckets=AT_LEAST_1),
    )
    _check_ranges("loss", self, dict(dual_clip=Range(0, note=" (0 = off)"), mis_high=POSITIVE))
    _need(self.tis_cap > 0, "loss.tis_cap", "must be > 0")
    _need(
      0 < self.mis_low <= 1 <= self.mis_high,
      "loss.mis_low",
      f"need 0 < mis_low <= 1 <= mis_high, got {self.mis_low}, {self.mis_high}",
    )
    # The loss is pg + kl_coef * KL - entropy_coef * H (rl/losses.py): a KL penalty and an
    # entropy bonus, so both coefficients are >= 0 (0 = off).
    _need(
      0 <= self.kl_coef < math.inf,
      "loss.kl_coef",
      f"must be >= 0 (the loss adds kl_coef * KL; 0 = off), got {self.kl_coef}",
    )
    _need(
      0 <= self.entropy_coef < math.inf,
      "loss.entropy_coef",
      f"must be >= 0 (the loss subtracts entropy_coef * entropy; 0 = off), got {self.entropy_coef}",
    )


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """The device mesh: data × fsdp × tensor (their product = the devices of the run)."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  def check(self) -> None:
    _check_ranges("mesh", self, dict.fromkeys(("data", "fsdp", "tensor"), AT_LEAST_1))


@dataclasses.dataclass(frozen=True)
class EvalSection:
  """Held-out evaluation: samples per question, τ, the k of pass@k, how often."""

  num_samples: int = 8  # n samples per held-out question at temperature
  temperature: float = 1.0
  # The k of pass@k: comma-separated integers, or "pow2" for every power of two ≤ num_samples and
  # num_samples itself (num_samples = 64: 1, 2, 4, 8, 16, 32, 64).
  ks: str = "1,8"
  every: int = 0  # 0 = only before and after training

  def check(self) -> None:
    _check_ranges(
      "eval",
      self,
      dict(num_samples=AT_LEAST_1, every=Range(0, note=" (0 = before and after training)")),
    )
    _need(
      0 < self.temperature < math.inf,
      "eval.temperature",
      f"must be > 0 and finite, got {self.temperature}",
    )


@dataclasses.dataclass(frozen=True)
class LogSection:
  """Where metrics go besides metrics.jsonl: TensorBoard, W&B, the plot, the progress bar; a
  profile of chosen steps."""

  tensorboard: bool = True
  wandb: bool = False
  wandb_project: str = "jaxrl"
  plot: bool = True
  progress: bool = True
  samples_per_step: int = 4  # responses logged as text per step (samples.jsonl, TensorBoard)
  # Peak TFLOP/s of one device for train_mfu; 0 = from the device kind (GPUs, TPUs: run/mfu.py),
  # and on CPU no train_mfu.
  peak_tflops: float = 0.0
  # A jax.profiler trace of RL steps profile_from .. profile_from + profile_steps - 1 (1-based, as
  # logged) in WORKDIR/profile: every program's ops, host and device (jaxrl/workdir/profiling.py).
  profile_from: int = 0  # 0: no trace
  profile_steps: int = 3

  def check(self) -> None:
    _need(self.samples_per_step >= 0, "log.samples_per_step", "must be >= 0")
    _check_ranges("log", self, dict(peak_tflops=Range(0, note=" (0 = from the device kind)")))
    _need(self.profile_from >= 0, "log.profile_from", "must be >= 0 (0: no trace)")
    _need(self.profile_steps >= 1, "log.profile_steps", "must be >= 1")
    if self.wandb and importlib.util.find_spec("wandb") is None:
      raise ConfigError("log.wandb", "is on but wandb is not installed: pip install wandb")


@dataclasses.dataclass(frozen=True)
class DiagnosticsSection:
  """Measurements at fixed params that change no step of training (docs/algorithms.md §12.1)."""

  # Every this many steps (0: never), DynaMO's gradient-variance ratio of the step's allocation
  # against uniform allocation of the same budget: grad_variance_draws resampled batches of each,
  # at the step's params, logged as dynamo_grad_var_ratio. Costs 2 × draws rollout batches and
  # gradients per measured step.
  grad_variance_every: int = 0
  grad_variance_draws: int = 4

  def check(self) -> None:
    _need(self.grad_variance_every >= 0, "diagnostics.grad_variance_every", "must be >= 0")
    _need(self.grad_variance_draws >= 2, "diagnostics.grad_variance_draws", "must be >= 2")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  """Orbax checkpoints of the whole loop state: how often, how many kept, async writes."""

  every: int = 25
  keep: int = 2
  async_save: bool = True
  # Longest wait for a write to finish (s). A write still running then (a hung disk or log sink)
  # counts as failed: the previous checkpoint stays the latest, and the run can still exit.
  settle_timeout: float = 600.0

  def check(self) -> None:
    _need(self.every >= 1, "checkpoint.every", "must be >= 1")
    _need_seconds(self.settle_timeout, "checkpoint.settle_timeout")
    _need(self.keep >= 1, "checkpoint.keep", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class E3AllocationSection:
  """E3's bounds curriculum (``allocation.method = "e3"``)."""

  step: int = 2  # G_min/G_max widen by this per epoch
  g_min_floor: int = 4
  g_max_cap: int = 12
  curriculum: bool = True  # False: bounds stay (allocation.g_min, allocation.g_max)

  def check(self) -> None:
    # A negative step narrows the bounds each epoch (the curriculum silently off); a floor
    # below 1 lets a question get no rollout.
    _check_ranges("allocation.e3", self, dict(step=AT_LEAST_0, g_min_floor=AT_LEAST_1))


@dataclasses.dataclass(frozen=True)
class DynamoAllocationSection:
  """DynaMO's priorities (``allocation.method = "dynamo"``)."""

  min_history: int = 4
  floor: float = 0.01
  mastered: float = 0.85

  def check(self) -> None:
    # ``mastered`` is compared with an accuracy: above 1 nothing is ever mastered, at 0 everything
    # is; ``floor`` is the least priority, which a negative one would make a negative share.
    _check_ranges(
      "allocation.dynamo",
      self,
      dict(min_history=AT_LEAST_0, floor=AT_LEAST_0, mastered=Range(0, low_ok=False, high=1)),
    )


@dataclasses.dataclass(frozen=True)
class AllocationSection:
  """How the step's fixed budget R = batch_questions * rollout.group_size is split over questions."""

  method: str = "uniform"  # a name of methods.registry.ALLOCATORS: uniform | e3 | dynamo | ...
  g_min: int = 4  # DynaMO bounds (and E3 bounds without the curriculum)
  g_max: int = 12
  e3: E3AllocationSection = E3AllocationSection()
  dynamo: DynamoAllocationSection = DynamoAllocationSection()

  def check(self) -> None:
    self.e3.check()
    self.dynamo.check()
    _need(
      1 <= self.g_min <= self.g_max,
      "allocation.g_min",
      f"need 1 <= g_min <= g_max, got g_min={self.g_min} g_max={self.g_max}",
    )


@dataclasses.dataclass(frozen=True)
class TemperatureSection:
  """The sampling temperature: fixed, or E3's entropy-targeting scheduler (with annealing)."""

  method: str = "fixed"  # fixed (rollout.temperature) | e3 (entropy targeting)
  anneal: bool = True  # E3 annealing of the entropy target (Eq. 5)
  anneal_start: int = 0  # 0: floor(0.6 * steps)
  eta: float = 0.9
  tau_min: float = 0.1
  tau_max: float = 3.0

  def check(self) -> None:
    _need(0 < self.tau_min <= self.tau_max, "temperature.tau_min", "need 0 < tau_min <= tau_max")
    # eta: the entropy target anneals from H_init to eta * H_init (E3 Eq. 5)
    _check_ranges(
      "temperature", self, dict(tau_max=POSITIVE, anneal_start=AT_LEAST_0, eta=FRACTION)
    )


@dataclasses.dataclass(frozen=True)
class ClipSection:
  """ε_high: fixed, or Entropy Scheduling's adaptive clip-higher tracking an entropy schedule."""

  method: str = "fixed"  # fixed (loss.eps_high) | adaptive (Entropy Scheduling)
  schedule: str = "constant"  # constant | cosine | stable_then_anneal
  h_target: float = 0.2  # constant target, and H_0 of the decaying schedules
  h_end: float = 0.1
  rho: float = 0.1  # stable_then_anneal: the last rho * steps anneal
  c0: float = 0.28
  c_min: float = 0.2
  c_max: float = 0.4
  delta: float = 0.01
  window: int = 4
  warmup: int = 5

  def check(self) -> None:
    _need(
      self.c_min <= self.c0 <= self.c_max,
      "clip.c0",
      f"need c_min <= c0 <= c_max, got {self.c_min}, {self.c0}, {self.c_max}",
    )
    _need(self.window >= 1, "clip.window", "must be >= 1")
    _check_ranges("clip", self, dict(rho=Range(0, low_ok=False, high=1), delta=POSITIVE))
    entropies = ("warmup", "c_min", "h_target", "h_end")
    _check_ranges("clip", self, dict.fromkeys(entropies, AT_LEAST_0))


@dataclasses.dataclass(frozen=True)
class EEPOSection:
  """EEPO's sample-then-forget two-stage rollouts (the gate and the unlearning step)."""

  enabled: bool = False
  m: int = 3  # gate: mean entropy of the last m steps ...
  alpha: float = 0.3  # ... below alpha fires the unlearning step
  lr: float = 3e-3  # eta of the plain SGD ascent step on the rollout copy
  eps_l: float = 1e-3
  eps_r: float = 1e-2
  old_logp_from: OldLogpFrom = "rollout"  # rollout (θ', the paper) | policy (recompute under θ)
  # log(1 − p)'s floor at log eps_r: "straight-through" keeps the unfloored gradient (a dominant
  # token is still pushed down); "paper": p clipped to [eps_l, 1 − eps_r] (EEPO Eq. 8–9), no
  # gradient where p > 1 − eps_r (docs/algorithms.md §5.2)
  unlearn_clip: UnlearnClip = "straight-through"

  def check(self) -> None:
    _need(self.m >= 1, "eepo.m", "must be >= 1")
    _check_ranges("eepo", self, dict(lr=POSITIVE, eps_l=POSITIVE, eps_r=POSITIVE, alpha=AT_LEAST_0))


@dataclasses.dataclass(frozen=True)
class ModulationSection:
  """DynaMO's token-level advantage modulation."""

  enabled: bool = False  # DynaMO token-level advantage modulation
  alpha: float = 0.4
  gamma: float = 50.0
  tau: float = 0.9

  def check(self) -> None:
    # A token's factor is 1 - alpha + alpha * sigmoid(-gamma * (x - tau)) with x in [0, 1]:
    # alpha above 1 flips the advantage's sign, a negative gamma inverts which tokens are damped,
    # and a tau outside [0, 1] damps all or none (docs/algorithms.md §4.3).
    _check_ranges("modulation", self, dict(alpha=FRACTION, gamma=AT_LEAST_0, tau=FRACTION))


@dataclasses.dataclass(frozen=True)
class AnnealPhaseSection:
  """The annealing-phase curriculum (Entropy Scheduling §5): from step ``start`` on, the run samples
  a different data mixture, more rollouts per question and longer responses. The switch compiles the
  train step and the sampler once for the new shapes; nothing recompiles afterwards."""

  enabled: bool = False
  start: int = 0  # first step; 0 = where the entropy schedule anneals (else 0.6·steps)
  mixture: str = ""  # "" = keep; else "LEVEL:WEIGHT,..." e.g. "4x4+:1,5x5+:2"
  group_size: int = 0  # 0 = keep (paper: 8 → 32); allocation bounds scale with it
  max_new_tokens: int = 0  # 0 = keep (paper: 4k → 16k)

  def check(self) -> None:
    keep = Range(0, note=" (0 = keep)")
    _check_ranges(
      "anneal_phase",
      self,
      dict(
        start=Range(0, note=" (0 = where the entropy schedule anneals)"),
        group_size=keep,
        max_new_tokens=keep,
      ),
    )


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = 0
  steps: int = 200  # RL steps
  batch_questions: int = 16  # B: questions per RL step
  # Compiled programs kept across runs (jaxrl.workdir.compile_cache): "" = WORKDIR/compile_cache (or JAX's
  # own $JAX_COMPILATION_CACHE_DIR when set), "off", or a directory shared by several runs.
  compile_cache: str = ""
  model: ModelSection = ModelSection()
  task: TaskSection = TaskSection()
  data: DataSection = DataSection()
  reward: RewardSection = RewardSection()
  tool: ToolSection = ToolSection()
  sft: SFTSection = SFTSection()
  rollout: RolloutSection = RolloutSection()
  vllm: VllmSection = VllmSection()
  optim: OptimSection = OptimSection()
  loss: LossSection = LossSection()
  mesh: MeshSection = MeshSection()
  eval: EvalSection = EvalSection()
  log: LogSection = LogSection()
  checkpoint: CheckpointSection = CheckpointSection()
  allocation: AllocationSection = AllocationSection()
  temperature: TemperatureSection = TemperatureSection()
  clip: ClipSection = ClipSection()
  eepo: EEPOSection = EEPOSection()
  modulation: ModulationSection = ModulationSection()
  anneal_phase: AnnealPhaseSection = AnnealPhaseSection()
  diagnostics: DiagnosticsSection = DiagnosticsSection()

  @property
  def num_rollouts(self) -> int:
    """R: rollouts per step (static)."""
    return self.batch_questions * self.rollout.group_size

  @property
  def eval_ks(self) -> tuple[int, ...]:
    return resolve_ks(self.eval.ks, self.eval.num_samples)


POWERS_OF_TWO = "pow2"


def resolve_ks(spec: str, num_samples: int) -> tuple[int, ...]:
  """The k of pass@k that ``spec`` names for n = ``num_samples`` samples: "1,8" → (1, 8);
  "pow2" → every power of two ≤ n, then n (n = 24: 1, 2, 4, 8, 16, 24). ValueError if malformed."""
  if spec.strip() == POWERS_OF_TWO:
    powers = [2**e for e in range(max(num_samples, 1).bit_length()) if 2**e <= num_samples]
    return tuple(sorted({*powers, num_samples}))
  return tuple(int(k) for k in spec.split(","))


def _check_type(path: str, value: Any, annotation: Any) -> Any:
  hint = annotation
  if typing.get_origin(hint) is Literal:
    allowed = typing.get_args(hint)
    if value not in allowed:
      raise ConfigError(path, f"{value!r} is not one of {allowed}")
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint in (int, float, str, bool) and not (
    isinstance(value, hint) and not (hint is int and isinstance(value, bool))
  ):
    raise ConfigError(path, f"expected {hint.__name__}, got {type(value).__name__} {value!r}")
  if hint is float and math.isnan(value):
    raise ConfigError(path, "is NaN: expected a number")
  return value
