"""The rollout's config sections, beside the engines that read them: ``rollout`` (the group size,
budget, sampling, engine, staleness, dynamic sampling) and ``vllm`` (the sidecar server and its
weight transfer); and the lengths they imply over the run's phases (each phase's response budget,
a model turn's tokens, what a task reads: ``rollout_limits``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxrl.fields import Range, check_ranges, need, need_seconds
from jaxrl.methods.sections import AnnealPhaseSection
from jaxrl.tasks.sections import RolloutLimits

Engine = Literal["jax", "vllm"]


WeightTransfer = Literal["files", "nccl"]


LoraSync = Literal["adapter", "merged"]


VllmDtype = Literal["", "float32", "bfloat16", "float16"]


Overlong = Literal["keep", "drop", "reward"]  # a response the budget cut (docs/algorithms.md §10)


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
    need(self.group_size >= 1, "rollout.group_size", "must be >= 1")
    need(
      math.isfinite(self.overlong_reward),
      "rollout.overlong_reward",
      f"must be finite, got {self.overlong_reward}",
    )
    need(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    need(self.max_turns >= 1, "rollout.max_turns", f"must be >= 1, got {self.max_turns}")
    need(
      0 <= self.max_turn_tokens <= self.max_new_tokens,
      "rollout.max_turn_tokens",
      f"must be in [0, max_new_tokens={self.max_new_tokens}] (0 = up to max_new_tokens), "
      f"got {self.max_turn_tokens}",
    )
    need(
      self.max_observation_tokens >= 1,
      "rollout.max_observation_tokens",
      f"must be >= 1, got {self.max_observation_tokens}",
    )
    need(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0")
    need(self.max_rounds >= 1, "rollout.max_rounds", "must be >= 1")
    need(self.compact_every >= 0, "rollout.compact_every", "must be >= 0 (0: no compaction)")
    need(self.temperature > 0, "rollout.temperature", "must be > 0")
    need(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")


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
    need(self.sync_every >= 1, "vllm.sync_every", "must be >= 1")
    check_ranges("vllm", self, dict(max_model_len=Range(0, note=" (0 = what the run needs)")))
    need(self.max_num_seqs >= 1, "vllm.max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
    need(
      all(p.replace("-", "", 1).isdigit() for p in self.cpus.split(",")) if self.cpus else True,
      "vllm.cpus",
      f"{self.cpus!r} is not a list of cores such as '1' or '0,2-3'",
    )
    need(
      self.retries >= 0 and self.max_restarts >= 0,
      "vllm.retries",
      "retries and max_restarts must be >= 0",
    )
    need_seconds(self.startup_timeout, "vllm.startup_timeout")
    need_seconds(self.request_timeout, "vllm.request_timeout")


def response_lengths(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> tuple[int, ...]:
  """Each phase's ``rollout.max_new_tokens``: the main phase's, and the annealing phase's if on."""
  if not anneal_phase.enabled:
    return (rollout.max_new_tokens,)
  return rollout.max_new_tokens, anneal_response(rollout, anneal_phase)


def shortest_response(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> int:
  """The smallest ``rollout.max_new_tokens`` over the run's phases (main, and annealing if on)."""
  return min(response_lengths(rollout, anneal_phase))


def turn_tokens(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> int:
  """T, the tokens of one model turn at most (docs/algorithms.md §11): ``rollout.max_turn_tokens``,
  0 = the whole response; one value for every phase (the multi-turn programs compile once), so
  capped by the shortest phase's response."""
  shortest = shortest_response(rollout, anneal_phase)
  return min(rollout.max_turn_tokens or shortest, shortest)


def rollout_limits(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> RolloutLimits:
  """What a task reads of the rollout (its loader's budget checks, its environment's bounds)."""
  return RolloutLimits(
    max_new_tokens=rollout.max_new_tokens,
    shortest_response=shortest_response(rollout, anneal_phase),
    max_turns=rollout.max_turns,
    max_observation_tokens=rollout.max_observation_tokens,
  )


def anneal_response(rollout: RolloutSection, anneal_phase: AnnealPhaseSection) -> int:
  """The annealing phase's response length: its own, 0 = the main phase's."""
  return anneal_phase.max_new_tokens or rollout.max_new_tokens
