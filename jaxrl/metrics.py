"""Reference functions (docs/algorithms.md §0) under ``jaxrl.metrics``; from ``jaxrl.rl.passk``."""

from jaxrl.rl.passk import (  # noqa: F401  (public re-exports)
  pass_at_k,
  pass_at_k_array,
)
