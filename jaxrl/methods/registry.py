"""Name → factory for every allocator, temperature controller, clip controller and entropy
schedule a config can choose.

A factory takes the (phase's) ``Config`` and returns the policy object. Adding an allocator is its
factory in its own module plus one line in ``ALLOCATORS``; the config's ``allocation.method``
accepts every registered name (``check`` raises the one-line ``ConfigError`` for the others).
"""

from __future__ import annotations

from typing import Callable

from jaxrl.config import Config, ConfigError
from jaxrl.methods import allocation, schedules


def uniform_allocator(cfg: Config) -> allocation.Allocator:
  return allocation.uniform_allocator(cfg.rollout.group_size)


def e3_allocator(cfg: Config) -> allocation.Allocator:
  a = cfg.allocation
  return allocation.e3_allocator(
    cfg.rollout.group_size,
    step=a.e3.step,
    g_min_floor=a.e3.g_min_floor,
    g_max_cap=a.e3.g_max_cap,
    curriculum=a.e3.curriculum,
  )


def dynamo_allocator(cfg: Config) -> allocation.Allocator:
  a = cfg.allocation
  return allocation.dynamo_allocator(
    cfg.rollout.group_size,
    a.g_min,
    a.g_max,
    min_history=a.dynamo.min_history,
    floor=a.dynamo.floor,
    mastered=a.dynamo.mastered,
  )


def fixed_temperature(cfg: Config, vocab_size: int) -> schedules.TemperatureController:
  del vocab_size
  return schedules.fixed_temperature(cfg.rollout.temperature)


def e3_temperature(cfg: Config, vocab_size: int) -> schedules.TemperatureController:
  t = cfg.temperature
  return schedules.e3_temperature_controller(
    vocab_size,
    t_max=cfg.steps,
    tau0=cfg.rollout.temperature,
    eta=t.eta,
    anneal=t.anneal,
    anneal_start=t.anneal_start or None,
    tau_min=t.tau_min,
    tau_max=t.tau_max,
  )


def fixed_clip(cfg: Config) -> schedules.ClipController:
  return schedules.fixed_clip(cfg.loss.eps_high)


def adaptive_clip(cfg: Config) -> schedules.ClipController:
  c = cfg.clip
  return schedules.adaptive_clip_controller(
    SCHEDULES[c.schedule](cfg),
    c0=c.c0,
    c_min=c.c_min,
    c_max=c.c_max,
    delta=c.delta,
    window=c.window,
    warmup=c.warmup,
  )


ALLOCATORS: dict[str, Callable[[Config], allocation.Allocator]] = {
  "uniform": uniform_allocator,
  "e3": e3_allocator,
  "dynamo": dynamo_allocator,
}
TEMPERATURES: dict[str, Callable[[Config, int], schedules.TemperatureController]] = {
  "fixed": fixed_temperature,
  "e3": e3_temperature,
}
CLIPS: dict[str, Callable[[Config], schedules.ClipController]] = {
  "fixed": fixed_clip,
  "adaptive": adaptive_clip,
}
SCHEDULES: dict[str, Callable[[Config], schedules.Schedule]] = {
  "constant": lambda cfg: schedules.constant_schedule(cfg.clip.h_target),
  "cosine": lambda cfg: schedules.cosine_schedule(cfg.clip.h_target, cfg.clip.h_end, cfg.steps),
  "stable_then_anneal": lambda cfg: schedules.stable_then_anneal_schedule(
    cfg.clip.h_target, cfg.clip.h_end, cfg.steps, cfg.clip.rho
  ),
}

_FIELDS = (
  ("allocation.method", ALLOCATORS),
  ("temperature.method", TEMPERATURES),
  ("clip.method", CLIPS),
  ("clip.schedule", SCHEDULES),
)


def check(cfg: Config) -> None:
  """Every method name of the config is registered (one-line ``ConfigError`` naming the field)."""
  for field, registry in _FIELDS:
    section, name = field.split(".")
    value = getattr(getattr(cfg, section), name)
    if value not in registry:
      raise ConfigError(field, f"{value!r} is not one of {tuple(registry)}")
