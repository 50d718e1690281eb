"""The stateful shell: the CLI, the trainer and its loop, SFT, evaluation, ``--plan``, checkpoints,
metrics and progress."""
