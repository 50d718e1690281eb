"""Reference functions (docs/algorithms.md §0) re-exported from ``jaxrl.methods.allocation``."""

from jaxrl.methods.allocation import (  # noqa: F401  (public re-exports)
  Allocator,
  dynamo_allocate,
  dynamo_allocator,
  dynamo_priority,
  e3_allocate,
  e3_allocator,
  e3_bounds,
  e3_difficulty,
  uniform_allocator,
)
