"""Reference functions (docs/algorithms.md §0) re-exported from ``jaxrl.rl.losses``."""

from jaxrl.rl.losses import (  # noqa: F401  (public re-exports)
  DynamoStats,
  LossConfig,
  LossHparams,
  behaviour_metrics,
  behaviour_weights,
  dynamo_modulate,
  dynamo_statistics,
  eepo_unlearning_loss,
  group_advantages,
  grpo_loss,
  informative_rollouts,
  mismatch_kl,
)
