"""jaxrl: reinforcement learning of language models with verifiable rewards, in JAX.

Layers, lowest first (a module imports only from its own layer and the ones below it; checked by
``tests/test_layering.py``):

  types, fields, private_dirs, rng    pytrees and the shape legend, how a config field is checked,
                                      directories only the run controls, random streams
  parallel/                           mesh, logical-axis sharding, multi-process helpers
  nn/                                 the decoder, fused log-probs, HF checkpoints
  rl/                                 losses, jitted steps, optimizer, statistics, compiled programs
  methods/                            allocation, schedules, controllers (registry)
  tasks/                              datasets, prompts, verifiers, bounded worker pools,
                                      environments of multi-turn rollouts (tools)
  rollout/                            the JAX sampler, the vLLM sidecar, EEPO's two-stage rollouts
  workdir/                            a run's files: checkpoints, metric writers, log, compile cache,
                                      profiler traces
  config/, run/                       the whole config (assembled from the sections), the commands,
                                      the trainer and its loop, phases, SFT, held-out evaluation,
                                      --plan, params in and out (weights)

Each package's config section is defined beside what it configures, in its ``sections`` module
(``nn/sections.py``: ``model``; ``rl/sections.py``: ``optim``, ``loss``, ``modulation``; …): plain
dataclasses with their checks, no JAX. ``jaxrl.config`` assembles them into ``Config``.

The reference functions of docs/algorithms.md §0 are the public API under the names that section
uses: ``jaxrl.allocation``, ``jaxrl.schedules``, ``jaxrl.losses`` and ``jaxrl.metrics``. Each only
re-exports from the module that implements them (``methods/allocation.py``,
``methods/schedules.py``, ``rl/losses.py``, ``rl/advantages.py``, ``rl/behaviour.py``;
``rl/passk.py``, ``rl/paper_metrics.py``, ``rl/grad_variance.py``): a stable name for users, not a
second implementation.

Commands (``run/cli.py`` holds what they share): ``jaxrl-train`` (``python -m jaxrl.main``)
trains, ``jaxrl-eval`` (``python -m jaxrl.eval``) evaluates a checkpoint, ``jaxrl-export``
(``python -m jaxrl.export``) writes any checkpoint in HF layout. ``jaxrl.paper_configs`` holds the
papers' settings the ``configs/qwen*.py`` files select. Each ``python -m`` module here
runs its command's flags, ``run/*_cli.py``, which call the library (``run/launch.py``,
``run/checkpoint_eval.py``, ``run/weights.py``). The built-in configs are the checkout's
``configs/``, installed as ``jaxrl/configs``.
"""
