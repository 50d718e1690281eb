"""Schedules and controllers (jaxrl.schedules) against docs/algorithms.md §3/§5/§6 and Python loops.

Tolerances: these are scalar float32 formulas and recurrences (no sums over arrays but a window's
mean of ≤ 6 entries), the same bits on every x86 CPU kind CI runs (IEEE operations, XLA's own
exp/log/cos polynomials, FMA on all three), so a tolerance only has to cover float32 against the
float64 oracles: a few ulps per operation. 1e-6 absolute on values ≤ 1.5 is ≥ 8 ulps (1e-7 on
values ≤ 0.8, ≥ 1.7 ulps, only for values one or two operations from exact: the endpoints, a
clamp, c ± δ). The τ recurrence's float32 trajectory (≤ 40 updates of ~10u each, which may
compound) is the same on every CPU kind: its measured 1.5e-7 against the oracle holds on all of
them, inside rtol 1e-5. Where a float comparison decides a branch (a window mean against α or
the schedule), the oracles assert it is decided by more than the window sums' rounding, so every
CPU takes the oracle's branch.
"""

import math
from collections import deque

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.methods import schedules as sch

QWEN_V = 151936
U = float(np.finfo(np.float32).eps) / 2  # u = 2⁻²⁴, float32's unit roundoff
S_KW = dict(c0=0.28, c_min=0.2, c_max=0.4, delta=0.02, window=3, warmup=2)  # §6 worked examples
S1_H = [0.50, 0.45, 0.41, 0.38, 0.36, 0.39]
S1_CLIP = [0.28, 0.28, 0.26, 0.24, 0.26, 0.28]
S2_H = [0.2] * 9
S2_CLIP = [0.28, 0.28, 0.30, 0.32, 0.34, 0.36, 0.38, 0.40, 0.40]
G1_H = [0.45, 0.32, 0.28, 0.25, 0.40]
G1_FIRE = [False, False, False, True, False]


def f32(xs):
  """Python floats exactly as float32 sees them, so oracles differ only in arithmetic."""
  return [float(x) for x in np.asarray(xs, np.float32)]


# Plain-Python oracles.


def tau_oracle(hs, vocab, t_max, tau0=1.0, eta=0.9, anneal=True, anneal_start=None, lo=0.1, hi=3.0):
  """τ used at steps 1..n and whether the update after each step hit the clamp."""
  f = math.log(vocab) + math.log(math.log(vocab))
  t_a = math.floor(0.6 * t_max) if anneal_start is None else anneal_start
  tau, taus, hits, targets = tau0, [], [], []
  for t, h in enumerate(hs, start=1):
    taus.append(tau)
    if t == 1:
      h_init = h
      hits.append(False)
      targets.append(h_init)
      continue
    target = h_init
    if anneal and t >= t_a:
      x = min((t - t_a) / (t_max - t_a), 1.0)
      target = h_init * (eta + (1 - eta) * 0.5 * (1 + math.cos(math.pi * x)))
    targets.append(target)
    raw = tau * (1 + tau * (math.log(target / h) if h > 0 else math.inf) / f)
    hits.append(raw < lo or raw > hi)
    tau = min(max(raw, lo), hi)
  return taus, hits, targets


def clip_oracle(hs, sched, c0, c_min, c_max, delta, window, warmup):
  """ε_high used at steps 1..n; Algorithm 1 with the window ending at the current step."""
  c, out, s_hist, h_hist = c0, [], deque(maxlen=window), deque(maxlen=window)
  for t, h in enumerate(hs, start=1):
    s_hist.append(sched(t))
    h_hist.append(h)
    if t <= warmup:
      c = c0
    else:
      diff = sum(s_hist) / len(s_hist) - sum(h_hist) / len(h_hist)
      # Two float32 window means (≤ window + 1 roundings each, of values ≤ max) and a difference:
      # the sign is the library's on any CPU only if |diff| exceeds that (or both are exact ties).
      err = 2 * (window + 2) * U * max(max(s_hist), max(h_hist))
      assert diff == 0 and len(set(s_hist)) == len(set(h_hist)) == 1 or abs(diff) > err, diff
      c = min(max(c + delta * (diff > 0) - delta * (diff < 0), c_min), c_max)
    out.append(c)
  return out


def gate_oracle(hs, m, alpha):
  means = [
    sum(hs[max(0, i + 1 - m) : i + 1]) / len(hs[max(0, i + 1 - m) : i + 1]) for i in range(len(hs))
  ]
  # A float32 mean of ≤ m entries (≤ 0.5) rounds within (m + 1)·u·0.5, α within u·α: each gate
  # decision is the library's on any CPU if the mean lies farther from α than that.
  assert all(abs(x - alpha) > (m + 2) * U for x in means), min(abs(x - alpha) for x in means)
  return [x < alpha for x in means]


def cosine_py(h0, h1, x):
  x = min(max(x, 0.0), 1.0)
  return h1 + (h0 - h1) * 0.5 * (1 + math.cos(math.pi * x))


# Controller runners: eager loop and one jitted scan.


def run_tau_eager(ctl, hs):
  state, taus, hits, targets = ctl.init(), [], [], []
  for h in hs:
    taus.append(float(ctl.current(state)))
    state = ctl.update(state, h)
    hits.append(bool(state.clamped))
    targets.append(float(ctl.target(state)))
  return taus, hits, targets


def run_tau_scan(ctl, hs):
  def body(state, h):
    tau = ctl.current(state)
    state = ctl.update(state, h)
    return state, (tau, state.clamped, ctl.target(state))

  _, out = jax.jit(lambda h_: jax.lax.scan(body, ctl.init(), h_))(jnp.asarray(hs, jnp.float32))
  return [np.asarray(o) for o in out]


def run_clip_eager(ctl, hs):
  state, out = ctl.init(), []
  for h in hs:
    state = ctl.update(state, h)
    out.append(float(ctl.current(state)))
  return out


def run_clip_scan(ctl, hs):
  def body(state, h):
    state = ctl.update(state, h)
    return state, ctl.current(state)

  _, out = jax.jit(lambda h_: jax.lax.scan(body, ctl.init(), h_))(jnp.asarray(hs, jnp.float32))
  return np.asarray(out)


def run_gate_scan(ctl, hs):
  def body(state, h):
    fire, state = ctl.gate(state, h)
    return state, fire

  _, out = jax.jit(lambda h_: jax.lax.scan(body, ctl.init(), h_))(jnp.asarray(hs, jnp.float32))
  return np.asarray(out).tolist()


# Reference functions: worked examples.


@pytest.mark.parametrize("fn", [sch.e3_temperature, jax.jit(sch.e3_temperature)])
def test_e3_temperature_worked_t1_t2(fn):
  assert abs(float(fn(1.0, 0.5, 0.4, QWEN_V)) - 1.0154849) <= 1e-6
  assert abs(float(fn(1.1, 0.5, 0.6, QWEN_V)) - 1.0846910) <= 1e-6
  assert float(fn(0.7, 0.3, 0.3, QWEN_V)) == f32([0.7])[0]  # α = 1 keeps τ bit for bit
  assert float(fn(0.7, 0.0, 0.0, QWEN_V)) == f32([0.7])[0]  # 0/0 is "no change"


def test_e3_temperature_matches_formula_and_compiles_once():
  # Every draw has new values, but the same shapes and dtypes: a second trace raises.
  chex.clear_trace_counter()
  fn = jax.jit(chex.assert_max_traces(sch.e3_temperature, n=1))
  rng = np.random.default_rng(0)
  vocabs = [151936, 32000, 50257, 1000, 128256, 256]
  draws = zip(
    rng.uniform(0.2, 2, 6), rng.uniform(0.05, 1, 6), rng.uniform(0.05, 1, 6), vocabs, strict=True
  )
  for tau, ht, hc, v in draws:
    tau, ht, hc = f32([tau, ht, hc])
    f = math.log(v) + math.log(math.log(v))
    got = fn(jnp.float32(tau), jnp.float32(ht), jnp.float32(hc), jnp.int32(v))
    assert float(got) == pytest.approx(tau * (1 + tau * math.log(ht / hc) / f), rel=2e-6)


def test_e3_entropy_target_worked_t4():
  steps = [287, 288, 384, 480]
  want = [0.5, 0.5, 0.475, 0.45]
  eager = [float(sch.e3_entropy_target(s, 0.5, 480)) for s in steps]
  jitted = jax.jit(jax.vmap(lambda s: sch.e3_entropy_target(s, 0.5, 480)))(jnp.asarray(steps))
  np.testing.assert_allclose(eager, want, atol=1e-6)
  np.testing.assert_allclose(jitted, want, atol=1e-6)


def test_e3_entropy_target_against_loop():
  for t_max, start, eta in [(480, None, 0.9), (10, None, 0.8), (100, 30, 0.0), (7, 7, 0.5)]:
    t_a = math.floor(0.6 * t_max) if start is None else start
    span = max(t_max - t_a, 1)
    steps = np.arange(0, t_max + 5)
    got = jax.vmap(sch.e3_entropy_target, in_axes=(0, None, None, None, None))(
      jnp.asarray(steps), 1.3, t_max, eta, start
    )
    want = [
      1.3 if s < t_a else 1.3 * (eta + (1 - eta) * cosine_py(1.0, 0.0, (s - t_a) / span))
      for s in steps
    ]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert float(got[-1]) == pytest.approx(1.3 * eta, rel=1e-6)  # held after t_max


def test_adaptive_clip_reference():
  chex.clear_trace_counter()
  fn = jax.jit(chex.assert_max_traces(sch.adaptive_clip, n=1))  # a second trace raises
  cases = [  # (c, h_sched, h_curr, delta, c_min, c_max) -> expected
    ((0.28, 0.4, 0.5, 0.02, 0.2, 0.4), 0.26),
    ((0.28, 0.4, 0.3, 0.02, 0.2, 0.4), 0.30),
    ((0.28, 0.4, 0.4, 0.02, 0.2, 0.4), 0.28),  # tie: Δc = 0
    ((0.39, 0.4, 0.1, 0.02, 0.2, 0.4), 0.40),
    ((0.21, 0.1, 0.4, 0.05, 0.2, 0.4), 0.20),
  ]
  for args, want in cases:
    assert float(sch.adaptive_clip(*args)) == pytest.approx(want, abs=1e-7)
    assert float(fn(*(jnp.float32(a) for a in args))) == pytest.approx(want, abs=1e-7)


def test_eepo_gate_worked_g1_growing_history():
  assert [bool(sch.eepo_gate(G1_H[: i + 1], 3, 0.3)) for i in range(5)] == G1_FIRE
  # The buffer + count form under jit: one trace for every count (a second trace raises).
  chex.clear_trace_counter()
  gate = chex.assert_max_traces(lambda h, m, a, count: sch.eepo_gate(h, m, a, count), n=1)
  fn = jax.jit(gate)  # m traced too
  buf = jnp.asarray(G1_H + [9.0, 9.0], jnp.float32)  # trailing slots are garbage, never read
  assert [bool(fn(buf, 3, 0.3, count=jnp.int32(n))) for n in range(1, 6)] == G1_FIRE
  assert not bool(sch.eepo_gate([], 3, 0.3))
  assert not bool(fn(buf, 3, 0.3, count=jnp.int32(0)))


def test_eepo_gate_against_loop():
  rng = np.random.default_rng(1)
  hs = f32(rng.uniform(0.1, 0.5, 40))
  buf = jnp.asarray(hs, jnp.float32)
  counts = jnp.arange(1, len(hs) + 1)
  every_count = jax.jit(jax.vmap(sch.eepo_gate, in_axes=(None, None, None, 0)))
  for m in (1, 3, 5):
    want = gate_oracle(hs, m, 0.3)
    assert any(want) and not all(want)
    assert np.asarray(every_count(buf, m, 0.3, counts)).tolist() == want
    # The plain list form, eagerly (each new length re-traces, so only a few prefixes).
    assert [bool(sch.eepo_gate(hs[: n + 1], m, 0.3)) for n in range(6)] == want[:6]


# Schedules.


def test_constant_schedule():
  s = sch.constant_schedule(0.4)
  np.testing.assert_allclose(jax.jit(jax.vmap(s))(jnp.arange(0, 50)), np.full(50, 0.4, np.float32))
  assert float(s(7)) == pytest.approx(0.4)


@pytest.mark.parametrize("h0,h1", [(0.8, 0.2), (0.2, 0.6)])
def test_cosine_schedule_endpoints_and_monotone(h0, h1):
  total = 100
  s = sch.cosine_schedule(h0, h1, total)
  vals = np.asarray(jax.jit(jax.vmap(s))(jnp.arange(0, total + 11)))
  np.testing.assert_allclose(
    vals, [cosine_py(h0, h1, t / total) for t in range(total + 11)], atol=1e-6
  )
  assert vals[0] == pytest.approx(h0, abs=1e-7) and vals[total] == pytest.approx(h1, abs=1e-7)
  assert vals[total // 2] == pytest.approx((h0 + h1) / 2, abs=1e-6)
  d = np.diff(vals[: total + 1]) * np.sign(h1 - h0)
  assert np.all(d > 0)  # strictly monotone towards the end value
  np.testing.assert_allclose(vals[total:], h1, atol=1e-7)  # held after T


def test_stable_then_anneal_schedule_endpoints_and_segments():
  total, rho, h_c, h_end = 200, 0.1, 0.45, 0.1
  s = sch.stable_then_anneal_schedule(h_c, h_end, total, rho)
  vals = np.asarray(jax.jit(jax.vmap(s))(jnp.arange(0, total + 6)))
  start = int((1 - rho) * total)  # 180
  want = [
    h_c if t <= start else cosine_py(h_c, h_end, (t - start) / (total - start))
    for t in range(total + 6)
  ]
  np.testing.assert_allclose(vals, want, atol=1e-6)
  np.testing.assert_allclose(vals[: start + 1], h_c, atol=1e-7)  # stable phase, including its end
  assert np.all(np.diff(vals[start : total + 1]) < 0)  # annealing strictly decreasing
  assert vals[total] == pytest.approx(h_end, abs=1e-7)
  assert vals[start + (total - start) // 2] == pytest.approx((h_c + h_end) / 2, abs=1e-6)
  assert float(sch.stable_then_anneal_schedule(0.4, 0.1, 100)(90)) == pytest.approx(0.4)  # ρ = 0.1


# Temperature controllers.


def test_e3_controller_protocol_step1_keeps_tau():
  ctl = sch.e3_temperature_controller(QWEN_V, t_max=480, tau0=1.0)
  state = ctl.init()
  assert float(ctl.current(state)) == 1.0 and int(state.step) == 0
  assert math.isnan(float(ctl.target(state)))  # nothing measured yet
  state = ctl.update(state, 0.4)  # step 1: H_init = H_1, τ kept for step 2
  assert float(ctl.current(state)) == 1.0 and float(state.h_init) == pytest.approx(0.4)
  assert float(ctl.target(state)) == pytest.approx(0.4)
  state = ctl.update(state, 0.5)  # step 2: τ_3 from H_2 and target(2) = H_init
  want = float(sch.e3_temperature(1.0, 0.4, 0.5, QWEN_V))
  assert float(ctl.current(state)) == pytest.approx(want, abs=1e-7) and want < 1.0
  assert int(state.step) == 2 and not bool(state.clamped)


@pytest.mark.parametrize(
  "anneal,start,t_max", [(True, None, 40), (False, None, 40), (True, 10, 30)]
)
def test_e3_controller_matches_loop(anneal, start, t_max):
  rng = np.random.default_rng(2)
  hs = f32(rng.uniform(0.05, 0.9, t_max))
  ctl = sch.e3_temperature_controller(
    1000, t_max, tau0=0.8, eta=0.85, anneal=anneal, anneal_start=start, tau_min=0.5, tau_max=1.5
  )
  taus, hits, targets = tau_oracle(hs, 1000, t_max, 0.8, 0.85, anneal, start, 0.5, 1.5)
  assert any(hits) and not all(hits)  # the sequence exercises both regimes
  e_taus, e_hits, e_targets = run_tau_eager(ctl, hs)
  j_taus, j_hits, j_targets = run_tau_scan(ctl, hs)
  for got_t, got_h, got_g in [(e_taus, e_hits, e_targets), (j_taus, j_hits, j_targets)]:
    # τ: the same float32 trajectory on every CPU (module docstring); targets: a few ops each.
    np.testing.assert_allclose(got_t, taus, rtol=1e-5)
    assert list(map(bool, got_h)) == hits
    np.testing.assert_allclose(got_g, targets, rtol=1e-6)


def test_e3_controller_clamps_when_entropy_collapses_or_explodes():
  ctl = sch.e3_temperature_controller(QWEN_V, t_max=100, tau0=1.0, anneal=False)
  hs = [0.5, 0.5, 0.1, 1e-3, 1e-6, 0.0, 0.0, 0.5, 1e12, 1e12, 1e12, 1e12]
  taus, hits, _ = tau_oracle(f32(hs), QWEN_V, 100, anneal=False)
  e_taus, e_hits, _ = run_tau_eager(ctl, hs)
  j_taus, j_hits, _ = run_tau_scan(ctl, hs)
  for got_t, got_h in [(e_taus, e_hits), (j_taus, j_hits)]:
    np.testing.assert_allclose(got_t, taus, rtol=1e-5)
    assert list(map(bool, got_h)) == hits
    assert all(0.1 <= t <= 3.0 for t in got_t)
  assert hits[5] and taus[6] == 3.0  # H_t = 0: ln(H_init/0) = +inf, τ pinned to τ_max
  assert not any(hits[:3])
  assert all(hits[8:]) and taus[9:] == [0.1] * 3  # huge H_t: raw τ < 0, pinned to τ_min
  assert float(e_taus[-1]) == f32([0.1])[0]


def test_e3_controller_update_compiles_once():
  ctl = sch.e3_temperature_controller(QWEN_V, t_max=480)
  chex.clear_trace_counter()
  update = jax.jit(chex.assert_max_traces(ctl.update, n=1))  # a second trace raises
  state = ctl.init()
  for h in [0.4, 0.3, 0.2, 0.1, 0.0, 2.0]:
    state = update(state, jnp.float32(h))
  assert float(ctl.current(state)) != 1.0  # the six updates did run (τ moved from τ0 = 1)


def test_fixed_temperature():
  ctl = sch.fixed_temperature(0.7)
  taus, hits, targets = run_tau_eager(ctl, [0.4, 0.0, 5.0])
  assert taus == pytest.approx([0.7] * 3) and hits == [False] * 3
  assert all(math.isnan(t) for t in targets)
  j_taus, _, _ = run_tau_scan(ctl, [0.4, 0.0, 5.0])
  np.testing.assert_allclose(j_taus, 0.7)


def test_e3_controller_rejects_tau0_outside_clamp():
  with pytest.raises(ValueError):
    sch.e3_temperature_controller(QWEN_V, 10, tau0=5.0)


# Clip controllers.


@pytest.mark.parametrize("hs,want", [(S1_H, S1_CLIP), (S2_H, S2_CLIP)], ids=["S1", "S2"])
def test_adaptive_clip_worked_s1_s2(hs, want):
  ctl = sch.adaptive_clip_controller(sch.constant_schedule(0.4), **S_KW)
  np.testing.assert_allclose(run_clip_eager(ctl, hs), want, atol=1e-6)
  np.testing.assert_allclose(run_clip_scan(ctl, hs), want, atol=1e-6)
  assert clip_oracle(hs, lambda t: 0.4, **S_KW) == pytest.approx(want)  # the oracle agrees too
  chex.clear_trace_counter()  # parametrized: the two cases share one trace count otherwise
  update = jax.jit(chex.assert_max_traces(ctl.update, n=1))  # a second trace raises
  state, out = ctl.init(), []
  for h in hs:
    state = update(state, jnp.float32(h))
    out.append(float(ctl.current(state)))
  np.testing.assert_allclose(out, want, atol=1e-6)


@pytest.mark.parametrize("window,warmup", [(4, 5), (4, 0), (1, 3), (6, 2)])
def test_adaptive_clip_controller_matches_loop(window, warmup):
  total = 60
  rng = np.random.default_rng(3 + window)

  def sched_py(t):
    return cosine_py(0.5, 0.2, t / total)

  hs = f32([sched_py(t) + rng.normal(0, 0.05) for t in range(1, total + 1)])
  kw = dict(c0=0.28, c_min=0.2, c_max=0.4, delta=0.01, window=window, warmup=warmup)
  want = clip_oracle(hs, sched_py, **kw)
  assert len(set(np.round(want, 6))) > 3  # the controller actually moves
  ctl = sch.adaptive_clip_controller(sch.cosine_schedule(0.5, 0.2, total), **kw)
  np.testing.assert_allclose(run_clip_eager(ctl, hs), want, atol=1e-6)
  np.testing.assert_allclose(run_clip_scan(ctl, hs), want, atol=1e-6)
  state = ctl.init()
  for h in hs[:7]:
    state = ctl.update(state, h)
  assert float(ctl.target(state)) == pytest.approx(sched_py(7), abs=1e-6)


def test_fixed_clip():
  ctl = sch.fixed_clip(0.28)
  np.testing.assert_allclose(run_clip_eager(ctl, S1_H), 0.28)
  np.testing.assert_allclose(run_clip_scan(ctl, S1_H), 0.28)
  assert math.isnan(float(ctl.target(ctl.init())))


# EEPO gate controller.


def test_eepo_gate_controller_worked_g1():
  ctl = sch.eepo_gate_controller(m=3, alpha=0.3)
  state, fires = ctl.init(), []
  for h in G1_H:
    fire, state = ctl.gate(state, h)
    fires.append(bool(fire))
  assert fires == G1_FIRE
  assert run_gate_scan(ctl, G1_H) == G1_FIRE
  chex.clear_trace_counter()
  gate = jax.jit(chex.assert_max_traces(ctl.gate, n=1))  # a second trace raises
  state, fires = ctl.init(), []
  for h in G1_H:
    fire, state = gate(state, jnp.float32(h))
    fires.append(bool(fire))
  assert fires == G1_FIRE


@pytest.mark.parametrize("m", [1, 3, 5])
def test_eepo_gate_controller_matches_loop(m):
  rng = np.random.default_rng(4)
  hs = f32(rng.uniform(0.15, 0.45, 50))
  want = gate_oracle(hs, m, 0.3)
  assert any(want) and not all(want)
  assert run_gate_scan(sch.eepo_gate_controller(m, 0.3), hs) == want
