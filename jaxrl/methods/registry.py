"""Name → factory for every allocator, temperature controller, clip controller and entropy
schedule a config can choose.

A factory takes its section of the (phase's) config and the few run-wide values it reads, and
returns the policy object. Adding an allocator is its factory in its own module plus one line in
``ALLOCATORS``; the config's ``allocation.method`` accepts every registered name (``check`` raises
the one-line ``ConfigError`` for the others).
"""

from __future__ import annotations

from typing import Callable

from jaxrl.fields import ConfigError
from jaxrl.methods import allocation, schedules
from jaxrl.methods.sections import AllocationSection, ClipSection, TemperatureSection


def uniform_allocator(a: AllocationSection, group_size: int) -> allocation.Allocator:
  del a
  return allocation.uniform_allocator(group_size)


def e3_allocator(a: AllocationSection, group_size: int) -> allocation.Allocator:
  return allocation.e3_allocator(
    group_size,
    step=a.e3.step,
    g_min_floor=a.e3.g_min_floor,
    g_max_cap=a.e3.g_max_cap,
    curriculum=a.e3.curriculum,
  )


def dynamo_allocator(a: AllocationSection, group_size: int) -> allocation.Allocator:
  return allocation.dynamo_allocator(
    group_size,
    a.g_min,
    a.g_max,
    min_history=a.dynamo.min_history,
    floor=a.dynamo.floor,
    mastered=a.dynamo.mastered,
  )


def fixed_temperature(
  t: TemperatureSection, *, tau0: float, steps: int, vocab_size: int
) -> schedules.TemperatureController:
  del t, steps, vocab_size
  return schedules.fixed_temperature(tau0)


def e3_temperature(
  t: TemperatureSection, *, tau0: float, steps: int, vocab_size: int
) -> schedules.TemperatureController:
  return schedules.e3_temperature_controller(
    vocab_size,
    t_max=steps,
    tau0=tau0,
    eta=t.eta,
    anneal=t.anneal,
    anneal_start=t.anneal_start or None,
    tau_min=t.tau_min,
    tau_max=t.tau_max,
  )


def fixed_clip(c: ClipSection, *, eps_high: float, steps: int) -> schedules.ClipController:
  del c, steps
  return schedules.fixed_clip(eps_high)


def adaptive_clip(c: ClipSection, *, eps_high: float, steps: int) -> schedules.ClipController:
  del eps_high
  return schedules.adaptive_clip_controller(
    SCHEDULES[c.schedule](c, steps),
    c0=c.c0,
    c_min=c.c_min,
    c_max=c.c_max,
    delta=c.delta,
    window=c.window,
    warmup=c.warmup,
  )


# A factory takes its own section and the few run-wide values it reads: the group size G; the
# sampling temperature τ0 (``rollout.temperature``), the RL steps and the vocabulary size; the
# clip ``loss.eps_high`` and the RL steps.
ALLOCATORS: dict[str, Callable[[AllocationSection, int], allocation.Allocator]] = {
  "uniform": uniform_allocator,
  "e3": e3_allocator,
  "dynamo": dynamo_allocator,
}
TEMPERATURES: dict[str, Callable[..., schedules.TemperatureController]] = {
  "fixed": fixed_temperature,
  "e3": e3_temperature,
}
CLIPS: dict[str, Callable[..., schedules.ClipController]] = {
  "fixed": fixed_clip,
  "adaptive": adaptive_clip,
}
SCHEDULES: dict[str, Callable[[ClipSection, int], schedules.Schedule]] = {
  "constant": lambda c, steps: schedules.constant_schedule(c.h_target),
  "cosine": lambda c, steps: schedules.cosine_schedule(c.h_target, c.h_end, steps),
  "stable_then_anneal": lambda c, steps: schedules.stable_then_anneal_schedule(
    c.h_target, c.h_end, steps, c.rho
  ),
}

_FIELDS = (
  ("allocation.method", ALLOCATORS),
  ("temperature.method", TEMPERATURES),
  ("clip.method", CLIPS),
  ("clip.schedule", SCHEDULES),
)


def check(
  *, allocation: AllocationSection, temperature: TemperatureSection, clip: ClipSection
) -> None:
  """Every method name of the three sections is registered (one-line ``ConfigError`` naming the
  field, ``_FIELDS``'s dotted path)."""
  sections = dict(allocation=allocation, temperature=temperature, clip=clip)
  for field, registry in _FIELDS:
    section, name = field.split(".")
    value = getattr(sections[section], name)
    if value not in registry:
      raise ConfigError(field, f"{value!r} is not one of {tuple(registry)}")
