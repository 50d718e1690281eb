"""The RL core as pure functions: losses, jitted steps, the optimizer, question statistics, and
the compiled programs a run and ``--plan`` share."""
