"""What a task reads of the run's config: its own sections, ``task`` (which task, its levels and
sizes), ``data`` (datasets), ``reward`` (the verifier's workers, reward terms, the judge), ``tool`` (the
tool environment's workers) and ``sft`` (the warm start on the task's worked examples); and
``TaskSections``, everything a task's loader, its ``check_inputs``, its environment and its reward
terms take (``jaxrl.run.components.task_sections`` picks them from the whole ``Config``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from jaxrl.fields import AT_LEAST_0, AT_LEAST_1, Range, check_ranges, need, need_seconds
from jaxrl.nn.sections import ModelSection

TaskName = Literal["arithmetic", "countdown", "math"]


Overlength = Literal["drop", "truncate", "error"]


# How reward.terms combine into one reward (docs/algorithms.md §13)
RewardCombine = Literal["sum-then-normalise", "normalise-then-sum"]


# Where a judge's score is read in its reply (``jaxrl.tasks.rewards.judge.parse_score``)
JudgeParse = Literal["score", "boxed", "last-number"]


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
    check_ranges(
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
    need(self.max_heldout >= 0, "data.max_heldout", "must be >= 0")
    need(
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
  # "KIND[:SOURCE][*WEIGHT],..." (``jaxrl.tasks.term_specs``); "" = the verifier alone, weight 1.
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
    need(self.model_max_tokens >= 1, "reward.model_max_tokens", "must be >= 1")
    need(self.model_rows >= 1, "reward.model_rows", "must be >= 1")
    need_seconds(self.fn_time_limit, "reward.fn_time_limit")
    need_seconds(self.judge_timeout, "reward.judge_timeout")
    check_ranges(
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
    need(
      self.judge_min < self.judge_max and math.isfinite(self.judge_max - self.judge_min),
      "reward.judge_min",
      f"the judge's scale [{self.judge_min}, {self.judge_max}] must be finite with min < max",
    )
    need(
      re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.judge_api_key_env or "_") is not None,
      "reward.judge_api_key_env",
      f"{self.judge_api_key_env!r} is not an environment variable's name (the key itself goes "
      "in that variable, never in the config)",
    )
    need(self.workers >= 0, "reward.workers", "must be >= 0 (0 = min(8, CPUs))")
    need_seconds(self.time_limit, "reward.time_limit")
    need(
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
    need(self.workers >= 0, "tool.workers", "must be >= 0 (0 = min(4, CPUs))")
    need_seconds(self.time_limit, "tool.time_limit")
    need(
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
    check_ranges("sft", self, dict(batch_size=AT_LEAST_1))
    check_ranges("sft", self, dict.fromkeys(("steps", "warmup_steps", "target_loss"), AT_LEAST_0))
    need(
      0 < self.learning_rate < math.inf,
      "sft.learning_rate",
      f"must be > 0 and finite, got {self.learning_rate}",
    )
    need(
      0 <= self.weight_decay < math.inf,
      "sft.weight_decay",
      f"must be >= 0 and finite, got {self.weight_decay}",
    )


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
  """What a task reads of the rollout: the response budget it checks its data against, and the
  bounds of a multi-turn episode (an environment's ``max_turns`` and ``max_observation_tokens``).
  ``rollout.sections.rollout_limits`` derives them from the rollout and annealing-phase sections."""

  max_new_tokens: int  # N of the main phase
  shortest_response: int  # the smallest N over the run's phases (main, and annealing if on)
  max_turns: int
  max_observation_tokens: int


@dataclasses.dataclass(frozen=True)
class TaskSections:
  """The sections a task reads: the built-in tasks the task, sft and rollout limits (and, with
  tools, data and tool) and the seed; the math task the model, data, reward and rollout limits;
  reward terms the reward section, the model's dtype and, for ``model:tiny-rm``, the task and
  seed; countdown the shortest response of any phase."""

  seed: int
  model: ModelSection
  task: TaskSection
  data: DataSection
  reward: RewardSection
  tool: ToolSection
  sft: SFTSection
  rollout: RolloutLimits
