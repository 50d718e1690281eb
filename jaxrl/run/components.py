"""The run's config split for the components below ``run/``: each takes the sections it reads,
picked here from the whole ``Config`` (a phase's, for the controllers), and the components built
from them (the rollout engine, a phase's controllers)."""

from __future__ import annotations

import dataclasses

from jaxrl.config import Config
from jaxrl.methods.controllers import Methods
from jaxrl.rollout.build import build_engine
from jaxrl.rollout.sections import rollout_limits
from jaxrl.tasks.sections import TaskSections


def task_sections(cfg: Config) -> TaskSections:
  """What the task (its loader, inputs, environment and reward terms) reads: each field of
  ``TaskSections`` is the ``Config`` field of its name, and ``rollout`` the limits the rollout and
  annealing-phase sections imply."""
  limits = rollout_limits(cfg.rollout, cfg.anneal_phase)
  names = [f.name for f in dataclasses.fields(TaskSections) if f.name != "rollout"]
  return TaskSections(rollout=limits, **{name: getattr(cfg, name) for name in names})


def engine_sections(cfg: Config) -> dict:
  """What ``rollout.build.build_engine`` reads of the config, as its keyword arguments."""
  return dict(
    rollout=cfg.rollout,
    vllm=cfg.vllm,
    model=cfg.model,
    anneal_phase=cfg.anneal_phase,
    environment_name=cfg.task.environment,
  )


def task_engine(cfg: Config, graphdef, model_cfg, task, workdir: str):
  """The rollout engine for a loaded task: its tokenizer, special ids, prompt width and environment
  (the trainer's engine and ``jaxrl-eval``'s are built alike)."""
  return build_engine(
    graphdef,
    model_cfg,
    **engine_sections(cfg),
    tokenizer=task.tokenizer,
    eos_id=task.eos_id,
    pad_id=task.pad_id,
    prompt_len=task.train_prompt_ids.shape[1],
    workdir=workdir,
    environment=task.environment,
  )


def phase_methods(pc: Config, vocab_size: int) -> Methods:
  """The controllers of a phase whose config is ``pc``: its sections and the run-wide values they
  read."""
  return Methods(
    allocation=pc.allocation,
    temperature=pc.temperature,
    clip=pc.clip,
    eepo=pc.eepo,
    modulation=pc.modulation,
    group_size=pc.rollout.group_size,
    tau0=pc.rollout.temperature,
    eps_high=pc.loss.eps_high,
    steps=pc.steps,
    vocab_size=vocab_size,
  )
