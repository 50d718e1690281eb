"""jaxrl: reinforcement learning of language models with verifiable rewards, in JAX.

Layers, lowest first (a module imports only from its own layer and the ones below it; checked by
``tests/test_layering.py``):

  types, config, rng, paper_configs   the typed config, pytrees and the shape legend, random streams
  parallel/                           mesh, logical-axis sharding, multi-process helpers
  nn/                                 the decoder, fused log-probs, HF checkpoints
  rl/                                 losses, jitted steps, optimizer, statistics, compiled programs
  methods/                            allocation, schedules, controllers (registry), phases
  tasks/                              datasets, prompts, verifiers, bounded worker pools,
                                      environments of multi-turn rollouts (tools)
  rollout/                            the JAX sampler, the vLLM sidecar, EEPO's two-stage rollouts
  workdir/                            a run's files: checkpoints, metric writers, log, compile cache,
                                      profiler traces
  run/                                the commands, the trainer and its loop, SFT, held-out
                                      evaluation, --plan, params in and out (weights)

The reference functions of docs/algorithms.md §0 are importable from ``jaxrl.allocation``,
``jaxrl.schedules``, ``jaxrl.losses`` and ``jaxrl.metrics``. Commands (``run/cli.py`` holds what they
share): ``jaxrl-train`` (``python -m jaxrl.main``) trains, ``jaxrl-eval`` (``python -m jaxrl.eval``)
evaluates a checkpoint, ``jaxrl-export`` (``python -m jaxrl.export``) writes any checkpoint in HF
layout. The built-in configs are the checkout's ``configs/``, installed as ``jaxrl/configs``.
"""
