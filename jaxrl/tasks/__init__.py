"""Tasks: datasets and prompts (``data/``), verifiers and the reward pool (``rewards/``), the task as
arrays."""
