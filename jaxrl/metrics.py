"""Reference functions (docs/algorithms.md §0) under ``jaxrl.metrics``; from ``jaxrl.rl.passk``,
``jaxrl.rl.paper_metrics`` and ``jaxrl.rl.grad_variance``."""

from jaxrl.rl.grad_variance import (  # noqa: F401  (public re-exports)
  grad_variance_ratio,
  trace_variance,
)
from jaxrl.rl.paper_metrics import (  # noqa: F401  (public re-exports)
  eepo_entropy_ratio,
  entropy_rel_init,
  entropy_tracking_error,
)
from jaxrl.rl.passk import (  # noqa: F401  (public re-exports)
  pass_at_k,
  pass_at_k_array,
)
