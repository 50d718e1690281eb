"""The run's own config sections: ``eval`` (held-out evaluation, ``jaxrl.run.heldout``), ``log``
(metric writers, the plot, profiles: ``jaxrl.run.progress``) and ``diagnostics``
(``jaxrl.run.diagnostics``); the k of pass@k an ``eval.ks`` names.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

from jaxrl.fields import AT_LEAST_1, ConfigError, Range, check_ranges, need


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
    check_ranges(
      "eval",
      self,
      dict(num_samples=AT_LEAST_1, every=Range(0, note=" (0 = before and after training)")),
    )
    need(
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
    need(self.samples_per_step >= 0, "log.samples_per_step", "must be >= 0")
    check_ranges("log", self, dict(peak_tflops=Range(0, note=" (0 = from the device kind)")))
    need(self.profile_from >= 0, "log.profile_from", "must be >= 0 (0: no trace)")
    need(self.profile_steps >= 1, "log.profile_steps", "must be >= 1")
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
    need(self.grad_variance_every >= 0, "diagnostics.grad_variance_every", "must be >= 0")
    need(self.grad_variance_draws >= 2, "diagnostics.grad_variance_draws", "must be >= 2")


POWERS_OF_TWO = "pow2"


def resolve_ks(spec: str, num_samples: int) -> tuple[int, ...]:
  """The k of pass@k that ``spec`` names for n = ``num_samples`` samples: "1,8" → (1, 8);
  "pow2" → every power of two ≤ n, then n (n = 24: 1, 2, 4, 8, 16, 24). ValueError if malformed."""
  if spec.strip() == POWERS_OF_TWO:
    powers = [2**e for e in range(max(num_samples, 1).bit_length()) if 2**e <= num_samples]
    return tuple(sorted({*powers, num_samples}))
  return tuple(int(k) for k in spec.split(","))
