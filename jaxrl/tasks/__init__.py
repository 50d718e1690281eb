"""Tasks: datasets and prompts (``data/``), verifiers and the reward pool (``rewards/``),
environments of multi-turn rollouts (``envs/``), bounded calls in worker processes (``workers``),
the task as arrays."""
