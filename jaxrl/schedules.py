"""Reference functions (docs/algorithms.md §0) re-exported from ``jaxrl.methods.schedules``."""

from jaxrl.methods.schedules import (  # noqa: F401  (public re-exports)
  adaptive_clip,
  adaptive_clip_controller,
  clip_saturated,
  constant_schedule,
  cosine_schedule,
  e3_entropy_target,
  e3_temperature,
  e3_temperature_controller,
  eepo_gate,
  eepo_gate_controller,
  fixed_clip,
  fixed_temperature,
  stable_then_anneal_schedule,
)
