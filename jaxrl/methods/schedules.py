"""Entropy-steering schedules and controllers: E3 temperature, adaptive clip-higher, EEPO gate.

The reference formulas of docs/algorithms.md §0 (`e3_temperature`, `e3_entropy_target`,
`adaptive_clip`, `clip_saturated`, `eepo_gate`) are plain functions of arrays; the controllers
below are built on them, never beside them. Controllers look like optax: a factory closes over the static
hyperparameters and returns a NamedTuple of pure functions over a small pytree state, so the
trainer can run them inside its jitted step; every value they hand out is a traced f32 array.

Step indexing: steps are 1-based (t = 1 is the first training step), as in the papers. Each state
holds ``step`` = the number of steps whose entropy it has observed. Protocols per step t:

* temperature (E3 §4.2): ``tau_t = ctl.current(state)`` samples step t; after the step,
  ``state = ctl.update(state, h_t)`` with h_t the token-weighted mean entropy of step t's batch at
  tau_t under the sampling params. That update produces tau_{t+1} (Eq. 4 with target(t) and H_t); at
  t = 1 it records H_init = H_1 and keeps tau. ``ctl.target(state)`` is target(t) of the step just
  observed, i.e. what h_t is compared against.
* clip (Entropy Scheduling Algorithm 1): h_t (token mean at tau under θ_old) is known once step t's
  rollouts exist, before its gradient update. ``state = ctl.update(state, h_t)`` first, then
  ``eps_high_t = ctl.current(state)``: the window W_t = {t−w+1 … t} includes step t itself. This is
  the only order that reproduces example S1 of docs/algorithms.md §6 (at t = 5 the window {3,4,5}
  has mean .383 < .4, so ε_high rises; the window {2,3,4} would have lowered it).
* EEPO gate: ``fire, state = ctl.gate(state, h_stage1_t)``; the current step's stage-1 entropy is
  part of the window.

Local shape letter: W = steps of a history window (ring buffers, most recent m or w steps).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp

from jaxrl.types import Array, pytree_dataclass

Schedule = Callable[[Array], Array]  # step (1-based, int or traced) -> target entropy


def e3_temperature(tau, h_target, h_current, vocab_size) -> Array:
  """E3 Eq. 4: τ·(1 + τ·ln(H_target/H_current)/F), F = ln V + ln ln V."""
  tau = jnp.asarray(tau, jnp.float32)
  h_target = jnp.asarray(h_target, jnp.float32)
  h_current = jnp.asarray(h_current, jnp.float32)
  log_v = jnp.log(jnp.asarray(vocab_size, jnp.float32))
  f = log_v + jnp.log(log_v)
  # Equal entropies mean "no change"; this also keeps 0/0 (a fully deterministic policy) finite.
  log_alpha = jnp.where(h_target == h_current, 0.0, jnp.log(h_target / h_current))
  return tau * (1.0 + tau * log_alpha / f)


def e3_anneal_start(t_max):
  """E3's default t_anneal = ⌊0.6·t_max⌋, in integers: also exact for a traced t_max."""
  return (3 * t_max) // 5


def e3_entropy_target(step, h_init, t_max, eta=0.9, anneal_start=None) -> Array:
  """E3 Eq. 5: H_init before t_anneal (default ⌊0.6·t_max⌋), then cosine down to η·H_init."""
  if anneal_start is None:
    anneal_start = e3_anneal_start(t_max)
  step = jnp.asarray(step, jnp.float32)
  start = jnp.asarray(anneal_start, jnp.float32)
  span = jnp.maximum(jnp.asarray(t_max, jnp.float32) - start, 1.0)
  # Beyond t_max the paper is silent; hold η·H_init rather than letting the cosine climb back.
  progress = jnp.clip((step - start) / span, 0.0, 1.0)
  factor = eta + (1.0 - eta) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
  return jnp.asarray(h_init, jnp.float32) * jnp.where(step < start, 1.0, factor)


def adaptive_clip(c, h_sched, h_curr, delta, c_min, c_max) -> Array:
  """Entropy Scheduling Alg. 1 line 10–11: clamp(c + δ·sign(H_sched − H_curr), c_min, c_max)."""
  c = jnp.asarray(c, jnp.float32)
  direction = jnp.sign(jnp.asarray(h_sched, jnp.float32) - jnp.asarray(h_curr, jnp.float32))
  return jnp.clip(c + delta * direction, c_min, c_max)


def clip_saturated(c, c_min, c_max) -> Array:
  """1 where ε_high sits at a bound of [c_min, c_max] (compared in f32, as the clip stores it)."""
  c = jnp.asarray(c, jnp.float32)
  return ((c <= jnp.float32(c_min)) | (c >= jnp.float32(c_max))).astype(jnp.float32)


def eepo_gate(entropy_history, m, alpha, count=None) -> Array:
  """EEPO gate: mean of the last m entries (fewer if fewer exist) < α; empty history → False.

  With ``count`` the history is a fixed-size buffer whose first ``count`` entries are valid (jit
  form); their order matters only when count > m.
  """
  h_W = jnp.asarray(entropy_history, jnp.float32).reshape(-1)
  size = h_W.shape[0]
  n = size if count is None else jnp.minimum(jnp.asarray(count, jnp.int32), size)
  idx_W = jnp.arange(size)
  in_window_W = (idx_W < n) & (idx_W >= n - m)
  k = jnp.sum(in_window_W)
  mean = jnp.sum(jnp.where(in_window_W, h_W, 0.0)) / jnp.maximum(k, 1)
  return (k > 0) & (mean < alpha)


# Entropy schedules (Entropy Scheduling §4.2): pure functions of the 1-based step, defined on
# [0, total] and held at their end value afterwards.


def constant_schedule(h_c) -> Schedule:
  """S(t) = H_c."""
  return lambda step: jnp.full(jnp.shape(step), h_c, jnp.float32)


def _cosine(h_from, h_to, progress):
  return h_to + (h_from - h_to) * 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.clip(progress, 0.0, 1.0)))


def cosine_schedule(h0, h_end, total) -> Schedule:
  """S(t) = H_end + (H_0 − H_end)·½(1 + cos(π·t/T))."""
  return lambda step: _cosine(h0, h_end, jnp.asarray(step, jnp.float32) / total)


def stable_anneal_start(total, rho=0.1) -> float:
  """Where the stable-then-anneal schedule leaves H_c: (1−ρ)·T."""
  return (1.0 - rho) * total


def stable_then_anneal_schedule(h_c, h_end, total, rho=0.1) -> Schedule:
  """S(t) = H_c until (1−ρ)·T, then a cosine from H_c to H_end at T (WSD-like)."""
  start = stable_anneal_start(total, rho)
  span = max(total - start, 1e-9)
  return lambda step: _cosine(h_c, h_end, (jnp.asarray(step, jnp.float32) - start) / span)


@pytree_dataclass
class TemperatureState:
  """Sampling temperature and what it was derived from."""

  tau: Array  # f32[] temperature for the next step (step + 1)
  h_init: Array  # f32[] H_1, the entropy of the first step (NaN until observed)
  step: Array  # i32[] steps observed so far
  clamped: Array  # bool[] the last update hit [tau_min, tau_max]


class TemperatureController(NamedTuple):
  """current(state) → τ for the next step; update(state, H_t); target(state) → target(t)."""

  init: Callable[[], TemperatureState]
  current: Callable[[TemperatureState], Array]
  update: Callable[[TemperatureState, Array], TemperatureState]
  target: Callable[[TemperatureState], Array]


def _temperature_init(tau0):
  return lambda: TemperatureState(
    tau=jnp.asarray(tau0, jnp.float32),
    h_init=jnp.full((), jnp.nan, jnp.float32),
    step=jnp.zeros((), jnp.int32),
    clamped=jnp.zeros((), bool),
  )


def _current_tau(state):
  return state.tau


def fixed_temperature(tau) -> TemperatureController:
  """Constant τ; still records H_init and counts steps so logs look the same; target is NaN."""

  def update(state, h_measured):
    h_t = jnp.asarray(h_measured, jnp.float32)
    return TemperatureState(
      tau=state.tau,
      h_init=jnp.where(state.step == 0, h_t, state.h_init),
      step=state.step + 1,
      clamped=jnp.zeros((), bool),
    )

  return TemperatureController(
    _temperature_init(tau), _current_tau, update, lambda state: jnp.full((), jnp.nan, jnp.float32)
  )


def e3_temperature_controller(
  vocab_size, t_max, tau0=1.0, eta=0.9, anneal=True, anneal_start=None, tau_min=0.1, tau_max=3.0
) -> TemperatureController:
  """E3 temperature scheduler (Eq. 4, optionally with Eq. 5 annealing), τ clamped to the bounds."""
  if not tau_min <= tau0 <= tau_max:
    raise ValueError(f"tau0={tau0} outside [{tau_min}, {tau_max}]")

  def target_at(step, h_init):
    if not anneal:
      return h_init
    return e3_entropy_target(step, h_init, t_max, eta, anneal_start)

  def update(state, h_measured):
    h_t = jnp.asarray(h_measured, jnp.float32)
    t = state.step + 1
    first = t == 1
    h_init = jnp.where(first, h_t, state.h_init)
    raw = e3_temperature(state.tau, target_at(t, h_init), h_t, vocab_size)
    hit = ~first & ((raw < tau_min) | (raw > tau_max))
    tau = jnp.where(first, state.tau, jnp.clip(raw, tau_min, tau_max))
    return TemperatureState(tau=tau, h_init=h_init, step=t, clamped=hit)

  def target(state):
    value = target_at(state.step, state.h_init)
    return jnp.where(state.step > 0, value, jnp.nan)

  return TemperatureController(_temperature_init(tau0), _current_tau, update, target)


@pytree_dataclass
class ClipState:
  """ε_high and the sliding window it is steered by."""

  c: Array  # f32[] ε_high of the last observed step
  step: Array  # i32[] steps observed so far
  sched_W: Array  # f32[W] ring buffer of schedule values S(t), slot (t−1) % W
  entropy_W: Array  # f32[W] ring buffer of measured entropies H(t), same slots


class ClipController(NamedTuple):
  """update(state, H_t) first, then current(state) → ε_high for step t; target(state) → S(t);
  saturated(state) → 1 when ε_high sits at a bound (NaN for a fixed ε_high, which has none)."""

  init: Callable[[], ClipState]
  current: Callable[[ClipState], Array]
  update: Callable[[ClipState, Array], ClipState]
  target: Callable[[ClipState], Array]
  saturated: Callable[[ClipState], Array]


def _nan(state):
  return jnp.full((), jnp.nan, jnp.float32)


def _ring_push(buf_W, count, value):
  """Write ``value`` as entry number ``count`` (0-based) of a ring buffer."""
  return buf_W.at[count % buf_W.shape[0]].set(value)


def _ring_mean(buf_W, count):
  """Mean of the min(count, W) valid entries (the first ``count`` slots until the ring wraps)."""
  valid_W = jnp.arange(buf_W.shape[0]) < count
  n = jnp.minimum(count, buf_W.shape[0])
  return jnp.sum(jnp.where(valid_W, buf_W, 0.0)) / jnp.maximum(n, 1)


def _clip_init(c0, window):
  return lambda: ClipState(
    c=jnp.asarray(c0, jnp.float32),
    step=jnp.zeros((), jnp.int32),
    sched_W=jnp.zeros((window,), jnp.float32),
    entropy_W=jnp.zeros((window,), jnp.float32),
  )


def _current_clip(state):
  return state.c


def fixed_clip(eps_high) -> ClipController:
  """Constant ε_high; records the last measured entropy; target is NaN."""

  def update(state, h_measured):
    h_t = jnp.asarray(h_measured, jnp.float32)
    return ClipState(
      c=state.c,
      step=state.step + 1,
      sched_W=state.sched_W,
      entropy_W=_ring_push(state.entropy_W, state.step, h_t),
    )

  return ClipController(_clip_init(eps_high, 1), _current_clip, update, _nan, _nan)


def adaptive_clip_controller(
  schedule: Schedule, c0=0.28, c_min=0.2, c_max=0.4, delta=0.01, window=4, warmup=5
) -> ClipController:
  """Adaptive clip-higher (Entropy Scheduling Alg. 1): steer ε_high to follow ``schedule``."""
  if window < 1 or warmup < 0:
    raise ValueError(f"need window >= 1 and warmup >= 0, got {window}, {warmup}")
  if not c_min <= c0 <= c_max:
    raise ValueError(f"c0={c0} outside [{c_min}, {c_max}]")

  def update(state, h_measured):
    t = state.step + 1
    sched_W = _ring_push(state.sched_W, state.step, schedule(t))
    entropy_W = _ring_push(state.entropy_W, state.step, jnp.asarray(h_measured, jnp.float32))
    adapted = adaptive_clip(
      state.c, _ring_mean(sched_W, t), _ring_mean(entropy_W, t), delta, c_min, c_max
    )
    c = jnp.where(t <= warmup, jnp.float32(c0), adapted)
    return ClipState(c=c, step=t, sched_W=sched_W, entropy_W=entropy_W)

  def target(state):
    return jnp.asarray(schedule(state.step), jnp.float32)

  def saturated(state):
    return clip_saturated(state.c, c_min, c_max)

  return ClipController(_clip_init(c0, window), _current_clip, update, target, saturated)


@pytree_dataclass
class GateState:
  """The last m stage-1 entropies."""

  entropy_W: Array  # f32[m] ring buffer, slot (t−1) % m
  count: Array  # i32[] steps observed so far


class EepoGateController(NamedTuple):
  """gate(state, H_stage1_t) → (unlearn at step t?, new state)."""

  init: Callable[[], GateState]
  gate: Callable[[GateState, Array], tuple[Array, GateState]]


def eepo_gate_controller(m=3, alpha=0.3) -> EepoGateController:
  """EEPO's unlearning gate over a ring buffer of stage-1 entropies."""
  if m < 1:
    raise ValueError(f"need m >= 1, got {m}")

  def init():
    return GateState(entropy_W=jnp.zeros((m,), jnp.float32), count=jnp.zeros((), jnp.int32))

  def gate(state, h_stage1):
    entropy_W = _ring_push(state.entropy_W, state.count, jnp.asarray(h_stage1, jnp.float32))
    count = state.count + 1
    # The ring holds exactly the last min(count, m) entries; their order does not change the mean.
    fire = eepo_gate(entropy_W, m, alpha, count=jnp.minimum(count, m))
    return fire, GateState(entropy_W=entropy_W, count=count)

  return EepoGateController(init, gate)
