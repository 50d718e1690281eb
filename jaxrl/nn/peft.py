"""LoRA adapters in PEFT's layout: what ``peft.PeftModel.from_pretrained`` and vLLM's runtime LoRA
loading read.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with, per adapted
projection, ``base_model.model.<HF module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r]
(jaxrl's own layout, so they are copied as they are). PEFT scales by
``lora_alpha / r`` as jaxrl does, so the adapted function is the same.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import numpy as np
from safetensors.numpy import save_file

from jaxrl.nn import hf, lora
from jaxrl.nn.model import ModelConfig
from jaxrl.parallel import distributed

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def _per_layer(kernel: tuple, leaf) -> Iterator[tuple[tuple, object, int | None]]:
  """(per-layer kernel path, leaf, layer index into a stacked leaf or None)."""
  if hf.is_stacked(kernel):
    for i in range(leaf.shape[0]):
      yield ("layers", i, *kernel[1:]), leaf, i
  else:
    yield kernel, leaf, None


def adapter_tensors(params) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT tensor name, float32 host array) for every adapter matrix, one at a
  time (a multi-process run's adapters are gathered: a collective every process takes part in)."""
  for kernel, a, b in lora.adapter_pairs(params):
    for key, _, layer in _per_layer(tuple(kernel), a):
      module = hf.hf_name(key).removesuffix(".weight")
      for suffix, leaf in (("lora_A", a), ("lora_B", b)):
        array = distributed.to_host(leaf[...] if layer is None else leaf[...][layer])
        yield f"{_PEFT_PREFIX}{module}.{suffix}.weight", np.asarray(array, np.float32)


def adapter_config(cfg: ModelConfig, base_model: str) -> dict:
  """PEFT's ``LoraConfig`` as JSON for ``cfg``'s adapters on ``base_model`` (a path or Hub id)."""
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model,
    "r": cfg.lora_rank,
    "lora_alpha": cfg.lora_alpha,
    "lora_dropout": 0.0,
    "target_modules": sorted(f"{t}_proj" for t in cfg.lora_targets),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "inference_mode": True,
    "modules_to_save": None,
  }


def save_adapter(
  cfg: ModelConfig, params, out_dir, base_model: str = "", every_process: bool = False
) -> pathlib.Path:
  """``params``' adapters as a PEFT directory ``out_dir`` (float32); returns it. Every process
  must call (the adapters are gathered); process 0 writes, or each process its own ``out_dir``
  with ``every_process`` (a weight push: each process has its own vLLM sidecar and tmpfs)."""
  tensors = dict(adapter_tensors(params))
  if not tensors:
    raise ValueError("the params have no LoRA adapters to save")
  out = pathlib.Path(out_dir)
  if every_process or distributed.is_main():
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(adapter_config(cfg, base_model), indent=2))
  return out
