"""Environments of multi-turn rollouts: the model writes a turn, the environment answers with
observation tokens, the model goes on; only the model's tokens train.

``environment``: the ``Environment`` protocol (batched ``reset`` / ``step``), ``StepResult``,
``TurnState`` and the token helpers; ``tool``: ``ToolEnvironment``, one tool called with tags and
run in bounded workers (``jaxrl.tasks.workers``); ``calculator``: the calculator tool (a parser,
never ``eval``); ``registry``: ``task.environment`` name → factory, ``build_environment``;
``trajectory``: a trajectory as parts, each with its author, for samples. Guide:
``docs/environments.md``.

Nothing is imported here: a tool worker imports its tool's module alone.
"""
