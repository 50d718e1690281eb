"""Model FLOPs utilisation of the train step: XLA's count of the update's FLOPs
(``cost_analysis()``, once per phase) over the update's time and the devices' peak.

The peak is per device: ``log.peak_tflops`` when set, else looked up from the device kind (dense
bfloat16 figures of the vendors' data sheets); CPUs have no entry, so on CPU ``train_mfu`` is left
out unless a peak is configured.
"""

from __future__ import annotations

import dataclasses

from jaxrl.nn import arch, model
from jaxrl.rl.programs import Programs
from jaxrl.run import plan_compile

PEAK_TFLOPS = {  # dense bfloat16, per device; matched as a substring of jax's device_kind
  "H100": 989.0,  # SXM
  "H100 PCIe": 756.0,
  "H200": 989.0,
  "H800": 989.0,
  "B200": 2250.0,
  "A100": 312.0,
  "A800": 312.0,
  "L40S": 362.0,
  "L4": 121.0,
  "TPU v4": 275.0,
  "TPU v5 lite": 197.0,
  "TPU v5e": 197.0,
  "TPU v5p": 459.0,
  "TPU v6 lite": 918.0,
  "TPU v6e": 918.0,
}


def peak_flops(configured_tflops: float, device_kind: str) -> float | None:
  """Peak FLOP/s of one device: the configured figure, else the table's longest matching name
  ("H100 PCIe" before "H100"); None when neither knows the device (CPUs)."""
  if configured_tflops > 0:
    return configured_tflops * 1e12
  kind = device_kind.lower()
  names = [name for name in PEAK_TFLOPS if name.lower() in kind]
  return PEAK_TFLOPS[max(names, key=len)] * 1e12 if names else None


def update_flops(pc, vocab_size: int, mesh) -> float:
  """XLA's FLOP count (``cost_analysis()``) of one call of the phase's update: the whole
  unpartitioned program, recomputation included. XLA counts a loop's body once, so it is counted
  on the same update with the layers unrolled (``model.scan_layers`` off); the log-prob chunks
  and attention blocks stay loops, counted once: at long sequences the count is low by their
  share (see ``--plan`` for the shapes)."""
  flat = dataclasses.replace(pc, model=dataclasses.replace(pc.model, scan_layers=False))
  graphdef, params = model.abstract(arch.model_config(flat.model, vocab_size))
  programs = Programs.for_run(flat.optim, graphdef, params, mesh)
  cost = plan_compile.lower_train_step(flat, programs, params).cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))


def mfu(flops: float, seconds: float, peak_per_device: float, num_devices: int) -> float:
  return flops / max(seconds, 1e-9) / (peak_per_device * num_devices)
