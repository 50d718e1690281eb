"""A ConfigDict (or nested dict) into a validated ``Config``: types and allowed values per field,
each section's own checks, then the checks that span sections (batch shapes, the math task, eval,
the methods' bounds, the annealing phase in its own shapes)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from jaxrl.config.derived import annealing, loss_config
from jaxrl.config.schema import Config
from jaxrl.fields import ConfigError, check_type, need
from jaxrl.rollout.sections import shortest_response
from jaxrl.tasks.mixture import parse_mixture
from jaxrl.tasks.term_specs import parse_terms


def _build(cls, data: Any, prefix: str):
  if not hasattr(data, "keys"):
    raise ConfigError(prefix.rstrip("."), f"expected a section, got {data!r}")
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  for key in data.keys():
    if key not in names:
      raise ConfigError(prefix + key, f"unknown field (known: {', '.join(sorted(names))})")
  kwargs = {}
  for f in dataclasses.fields(cls):
    if f.name not in data:
      continue
    hint = hints[f.name]
    path = prefix + f.name
    if dataclasses.is_dataclass(hint):
      kwargs[f.name] = _build(hint, data[f.name], path + ".")
    else:
      kwargs[f.name] = check_type(path, data[f.name], hint)
  return cls(**kwargs)


def _validate(cfg: Config) -> None:
  """Each section's own checks (``Section.check``), then the checks that span sections."""
  need(cfg.steps >= 0, "steps", f"must be >= 0, got {cfg.steps}")
  need(cfg.seed >= 0, "seed", f"must be >= 0, got {cfg.seed}")
  need(cfg.batch_questions > 0, "batch_questions", "must be > 0")
  need(
    cfg.rollout.max_staleness <= cfg.steps,
    "rollout.max_staleness",
    f"must be <= steps={cfg.steps} (no rollout can be older than the run), "
    f"got {cfg.rollout.max_staleness}",
  )
  for f in dataclasses.fields(cfg):
    section = getattr(cfg, f.name)
    if hasattr(section, "check"):
      section.check()
  loss_config(cfg)  # the update's static fields, checked where they are built
  parse_terms(cfg.reward.terms)
  _check_batch_shapes(cfg)
  _check_math_task(cfg)
  _check_countdown_task(cfg)
  _check_environment(cfg)
  _check_chat_template(cfg)
  _check_eval(cfg)
  _check_methods(cfg)
  if cfg.anneal_phase.enabled:
    _validate_anneal_phase(cfg)


def _check_batch_shapes(cfg: Config) -> None:
  """R rollouts split into mini- and micro-batches, each split over the data axes."""
  chunks = cfg.loss.mini_batches * cfg.loss.micro_batches
  need(
    cfg.num_rollouts % chunks == 0,
    "loss.micro_batches",
    f"R = batch_questions*group_size = {cfg.num_rollouts} is not divisible by "
    f"mini_batches*micro_batches = {chunks}",
  )
  rows = cfg.mesh.data * cfg.mesh.fsdp
  need(
    (cfg.num_rollouts // chunks) % rows == 0,
    "batch_questions",
    f"a micro-batch of {cfg.num_rollouts // chunks} rollouts is not divisible "
    f"over the data axes (data*fsdp = {rows})",
  )
  need(
    cfg.sft.batch_size % rows == 0,
    "sft.batch_size",
    f"{cfg.sft.batch_size} is not divisible over the data axes (data*fsdp = {rows})",
  )
  need(
    not cfg.eepo.enabled or cfg.num_rollouts % 2 == 0,
    "eepo.enabled",
    f"EEPO splits the step's R = {cfg.num_rollouts} rollouts into two equal stages: R must be even",
  )
  need(
    not cfg.eepo.enabled or (cfg.num_rollouts // 2) % rows == 0,
    "eepo.enabled",
    f"an EEPO stage of R/2 = {cfg.num_rollouts // 2} rollouts is not divisible over the data "
    f"axes (data*fsdp = {rows})",
  )


def _check_math_task(cfg: Config) -> None:
  if cfg.task.name != "math":
    return
  need(
    bool(cfg.model.checkpoint),
    "model.checkpoint",
    "the math task starts from a pretrained HF checkpoint: set model.checkpoint",
  )
  need(
    bool(cfg.data.train),
    "data.train",
    "the math task needs a training set: data.train = PATH[:WEIGHT],...",
  )
  need(
    cfg.sft.steps == 0,
    "sft.steps",
    "the math task has no SFT corpus (it starts from a pretrained checkpoint): set sft.steps=0",
  )


def _check_countdown_task(cfg: Config) -> None:
  if cfg.task.name != "countdown":
    return
  need(
    cfg.task.digit_width == 0,
    "task.digit_width",
    "the countdown task writes numbers as usual: set task.digit_width=0",
  )
  need(
    not cfg.task.environment,
    "task.environment",
    "the countdown task is single-turn: its verifier reads the whole response as the expression",
  )


def _check_chat_template(cfg: Config) -> None:
  need(
    not cfg.task.chat_template or (cfg.task.name == "arithmetic" and bool(cfg.task.environment)),
    "task.chat_template",
    "is the built-in calculator task's chat variant (task.environment=calculator); the math task "
    "frames prompts and observations by data.chat_template",
  )


def _check_environment(cfg: Config) -> None:
  """Multi-turn rollouts: an observation leaves room in the response, and a turn follows it."""
  if not cfg.task.environment:
    return
  r = cfg.rollout
  need(
    r.max_turns >= 2,
    "rollout.max_turns",
    f"task.environment={cfg.task.environment!r} answers a turn only when another follows: "
    f"need >= 2, got {r.max_turns}",
  )
  # An observation is asked for where its block and one token of the reply fit after the turn
  # (multiturn.answers_fit): the shortest call (one token) is answered only if 1 + O + 1 <= N, with
  # N the shortest phase's response (docs/algorithms.md §11).
  o, n = r.max_observation_tokens, shortest_response(r, cfg.anneal_phase)
  n_from = " (the shortest phase's)" if n < r.max_new_tokens else ""
  need(
    o + 2 <= n,
    "rollout.max_observation_tokens",
    f"a call, an observation of O={o} tokens and one token of the reply need O + 2 = {o + 2} > "
    f"max_new_tokens={n}{n_from}: no tool call could be answered",
  )


def _check_eval(cfg: Config) -> None:
  try:
    ks = cfg.eval_ks
  except ValueError:
    raise ConfigError(
      "eval.ks", f"expected comma-separated integers or 'pow2', got {cfg.eval.ks!r}"
    ) from None
  need(
    all(1 <= k <= cfg.eval.num_samples for k in ks),
    "eval.ks",
    f"every k must be in [1, eval.num_samples={cfg.eval.num_samples}], got {ks}",
  )


def _check_methods(cfg: Config) -> None:
  """The methods' bounds must contain the rollout section's group size and temperature."""
  a, g = cfg.allocation, cfg.rollout.group_size
  need(
    a.g_min <= g <= a.g_max,
    "allocation.g_max",
    f"the mean group size rollout.group_size={g} must lie in "
    f"[g_min, g_max] = [{a.g_min}, {a.g_max}]",
  )
  need(
    a.e3.g_min_floor <= g <= a.e3.g_max_cap,
    "allocation.e3.g_min_floor",
    "need e3.g_min_floor <= rollout.group_size <= e3.g_max_cap",
  )
  t = cfg.temperature
  need(
    t.tau_min <= cfg.rollout.temperature <= t.tau_max,
    "rollout.temperature",
    f"must lie in [temperature.tau_min, temperature.tau_max] = [{t.tau_min}, {t.tau_max}]",
  )


def _validate_anneal_phase(cfg: Config) -> None:
  parse_mixture(cfg.anneal_phase.mixture, "anneal_phase.mixture")
  try:
    _validate(annealing(cfg))
  except ConfigError as e:  # the same checks, in the phase's shapes: name the phase field
    raise ConfigError("anneal_phase.group_size", f"in the annealing phase, {e}") from None


def from_configdict(config_dict) -> Config:
  """Validated ``Config`` from a ConfigDict (or nested dict); raises ``ConfigError``."""
  data = config_dict.to_dict() if hasattr(config_dict, "to_dict") else dict(config_dict)
  cfg = _build(Config, data, "")
  _validate(cfg)
  return cfg


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)


def default_configdict():
  """A ConfigDict holding every field at its default: config files start from it and override."""
  # Lazy: ml_collections (with absl, ~0.1 s) only where a ConfigDict is built; checking a config,
  # or reading a run's config.json, needs none.
  import ml_collections

  return ml_collections.ConfigDict(to_dict(Config()))
