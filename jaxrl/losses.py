"""Reference functions (docs/algorithms.md §0) re-exported from where they live: ``jaxrl.rl.losses``
(the GRPO loss, EEPO's unlearning loss), ``jaxrl.rl.advantages`` (group advantages, DynaMO's
modulation) and ``jaxrl.rl.behaviour`` (§9's behaviour weights and metrics)."""

from jaxrl.rl.advantages import (  # noqa: F401  (public re-exports)
  DynamoStats,
  dynamo_modulate,
  dynamo_statistics,
  group_advantages,
  informative_rollouts,
)
from jaxrl.rl.behaviour import (  # noqa: F401  (public re-exports)
  behaviour_metrics,
  behaviour_weights,
  mismatch_kl,
)
from jaxrl.rl.losses import (  # noqa: F401  (public re-exports)
  LossConfig,
  LossHparams,
  eepo_unlearning_loss,
  grpo_loss,
)
