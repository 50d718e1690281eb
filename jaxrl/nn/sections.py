"""The model's config sections: ``model`` (the architecture, or an HF checkpoint, dtype, remat) and
``model.lora`` (adapters).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from jaxrl.fields import AT_LEAST_1, POSITIVE, Range, check_ranges, need

Remat = Literal["none", "full", "dots", "offload"]


LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]  # projections an adapter sits on


Dtype = Literal["float32", "bfloat16"]


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
    need(self.rank >= 0, "model.lora.rank", f"must be >= 0 (0 = off), got {self.rank}")
    need(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
    names = self.target_names()
    unknown = sorted(set(names) - set(typing.get_args(LoraTarget)))
    need(
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
    check_ranges("model", self, dict.fromkeys(sizes, AT_LEAST_1))
    check_ranges(
      "model",
      self,
      dict(
        vocab_size=Range(0, note=" (0 = the task's)"), rope_theta=POSITIVE, rms_norm_eps=POSITIVE
      ),
    )
    need(
      self.num_heads % max(self.num_kv_heads, 1) == 0 and self.num_kv_heads > 0,
      "model.num_kv_heads",
      f"num_heads={self.num_heads} must be a positive multiple of num_kv_heads={self.num_kv_heads}",
    )
    need(self.head_dim % 2 == 0, "model.head_dim", "must be even (RoPE)")
