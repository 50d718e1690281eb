"""The papers' own per-step diagnostics (docs/algorithms.md §12) and pass@k at large k (§8), on
examples worked by hand."""

import math
import os

import jax
import numpy as np
import pytest

from jaxrl.config import default_configdict, from_configdict, resolve_ks
from jaxrl.methods import schedules as sch
from jaxrl.methods.controllers import ControllerStates
from jaxrl.rl.paper_metrics import eepo_entropy_ratio, entropy_rel_init, entropy_tracking_error
from jaxrl.rl.passk import pass_at_k, pass_at_k_array
from jaxrl.run.heldout import Sampled, evaluate
from jaxrl.run.records import paper_metrics_row
from jaxrl.workdir.metric_writers import MetricsWriter, plot_run, read_jsonl

CLIP_KW = dict(c0=0.28, c_min=0.2, c_max=0.4, delta=0.02, window=3, warmup=2)  # §6 S1/S2


def test_entropy_rel_init_worked():
  assert entropy_rel_init(1.2, 1.6) == pytest.approx(0.75, abs=1e-15)
  assert entropy_rel_init(np.float32(0.5), np.float32(0.5)) == 1.0
  assert math.isnan(entropy_rel_init(1.2, float("nan")))  # no step observed yet
  assert math.isnan(entropy_rel_init(1.2, 0.0))


def test_entropy_tracking_error_worked():
  assert entropy_tracking_error(0.3, 0.4) == pytest.approx(-0.25, abs=1e-15)
  assert entropy_tracking_error(0.5, 0.4) == pytest.approx(0.25, abs=1e-15)
  assert math.isnan(entropy_tracking_error(0.3, float("nan")))  # no schedule


def test_eepo_entropy_ratio_worked():
  assert eepo_entropy_ratio(0.2, 0.5, True) == pytest.approx(2.5, abs=1e-15)
  assert math.isnan(eepo_entropy_ratio(0.2, 0.5, False))  # the gate did not fire
  assert math.isnan(eepo_entropy_ratio(0.2, float("nan"), True))  # a stage 2 without entropies


def saturation(ctl, hs):
  state, out = ctl.init(), []
  for h in hs:
    state = ctl.update(state, h)
    out.append(float(ctl.saturated(state)))
  return out


def test_clip_saturated_at_either_bound():
  # §6 S2: entropies ≡ 0.2 under S ≡ 0.4 raise ε_high 0.28, 0.28, 0.30, …, 0.38, 0.40, 0.40: the
  # upper bound from step 8. Entropies ≡ 0.6 lower it 0.28, 0.28, 0.26, 0.24, 0.22, 0.20, 0.20:
  # the lower bound from step 6. A target the clip cannot reach shows as sustained saturation.
  ctl = sch.adaptive_clip_controller(sch.constant_schedule(0.4), **CLIP_KW)
  assert saturation(ctl, [0.2] * 9) == [0.0] * 7 + [1.0] * 2
  assert saturation(ctl, [0.6] * 7) == [0.0] * 5 + [1.0] * 2
  assert math.isnan(saturation(sch.fixed_clip(0.28), [0.2])[0])  # no bounds to sit at


class _Methods:
  def __init__(self, clip):
    self.clip = clip


def test_paper_metrics_row_follows_the_controllers():
  # Fixed τ (which records H_init = H_1 all the same) and an adaptive clip steering to S ≡ 0.4.
  temp = sch.fixed_temperature(1.0)
  clip = sch.adaptive_clip_controller(sch.constant_schedule(0.4), **CLIP_KW)
  ctl = ControllerStates(alloc=None, temperature=temp.init(), clip=clip.init(), gate=None)
  rows = []
  for h in (0.5, 0.4, 0.3):
    ctl = ControllerStates(
      alloc=None,
      temperature=temp.update(ctl.temperature, h),
      clip=clip.update(ctl.clip, h),
      gate=None,
    )
    rows.append(paper_metrics_row(_Methods(clip), ctl, h))
  # H/H_init: 0.5/0.5, 0.4/0.5, 0.3/0.5; (H − 0.4)/0.4: 0.25, 0, −0.25; ε_high stays 0.28 or 0.26.
  np.testing.assert_allclose([r["entropy_rel_init"] for r in rows], [1.0, 0.8, 0.6], rtol=1e-6)
  np.testing.assert_allclose(
    [r["entropy_tracking_error"] for r in rows], [0.25, 0.0, -0.25], atol=1e-6
  )
  assert [r["clip_saturated"] for r in rows] == [0.0, 0.0, 0.0]


def test_resolve_ks_pow2_follows_num_samples():
  assert resolve_ks("pow2", 64) == (1, 2, 4, 8, 16, 32, 64)
  assert resolve_ks("pow2", 24) == (1, 2, 4, 8, 16, 24)
  assert resolve_ks("pow2", 1) == (1,)
  assert resolve_ks("1,8", 64) == (1, 8)  # a list stays as written
  cd = default_configdict()
  cd.eval.num_samples, cd.eval.ks = 64, "pow2"
  assert from_configdict(cd).eval_ks == (1, 2, 4, 8, 16, 32, 64)
  assert from_configdict(default_configdict()).eval_ks == (1, 8)  # the default is unchanged


def test_pass_at_large_k_worked():
  # n = 64, c = 2: pass@32 = 1 − (1 − 32/63)(1 − 32/64) = 1 − 31/126; pass@64 = 1 (n − c < k).
  assert pass_at_k(64, 2, 32) == pytest.approx(95 / 126, abs=1e-15)
  assert pass_at_k(64, 2, 64) == 1.0
  np.testing.assert_allclose(pass_at_k_array(64, [0, 2, 64], 32), [0.0, 95 / 126, 1.0], atol=1e-15)


def test_a_metric_of_some_steps_is_written_and_plotted(tmp_path):
  # EEPO's ratio exists on fired steps only: NaN is written "nan" and the curve skips those steps;
  # a metric NaN throughout (no schedule) is left out of the plot, which is still drawn.
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  for step, ratio in enumerate([float("nan"), 1.5, float("nan"), 1.25], 1):
    writer.write(
      step,
      {"reward": 0.25 * step, "eepo_entropy_ratio": ratio, "entropy_tracking_error": float("nan")},
    )
  writer.close()
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["eepo_entropy_ratio"] for r in rows] == ["nan", 1.5, "nan", 1.25]
  assert os.path.getsize(plot_run(str(tmp_path / "metrics.jsonl"), str(tmp_path / "run.png"))) > 0


def test_evaluation_reports_pass_at_every_power_of_two():
  # One question, n = 64 samples of which the first 2 are correct: eval.ks = "pow2" reports
  # pass@1 = 2/64, pass@32 = 95/126 (above), pass@64 = 1.
  def sample_fn(ids_BxP, mask_BxP, counts_B, key, greedy):
    group_ids_R = np.repeat(np.arange(len(counts_B)), counts_B)
    return Sampled([str(r) for r in range(len(group_ids_R))], group_ids_R)

  result = evaluate(
    sample_fn,
    np.zeros((1, 1), np.int32),
    np.ones((1, 1), bool),
    np.array([0]),
    lambda responses, q: (np.asarray([int(r) for r in responses]) < 2).astype(np.float32),
    num_samples=64,
    ks=resolve_ks("pow2", 64),
    questions_per_call=1,
    key=jax.random.PRNGKey(0),
  )
  assert sorted(result.pass_at) == [1, 2, 4, 8, 16, 32, 64]
  assert result.pass_at[1]["all"] == pytest.approx(2 / 64, abs=1e-15)
  assert result.pass_at[32]["all"] == pytest.approx(95 / 126, abs=1e-15)
  assert result.pass_at[64]["all"] == 1.0
