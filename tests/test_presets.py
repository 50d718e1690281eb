"""Every method preset of configs/tiny.py runs end to end, and changing G_i, τ or ε between steps
never recompiles the train step or the sampler."""

import json
import os

import numpy as np
import pytest
from run_helpers import tiny_config

from jaxrl.run.train import Trainer

PRESETS = ("grpo", "e3", "dynamo", "eepo", "es", "all")


def rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_without_recompiling(tmp_path, preset):
  workdir = str(tmp_path / preset)
  Trainer(tiny_config(f"{preset},test", steps=8), workdir).run()
  r = rows(workdir)
  assert [x["step"] for x in r] == list(range(1, 9))
  # Compiled versions stay constant from step 1 on, while the decisions below change.
  for key in ("compiles_update", "compiles_sampler"):
    assert len({x[key] for x in r}) == 1, (key, [x[key] for x in r])
  taus = {round(x["tau"], 6) for x in r}
  eps = {round(x["eps_high"], 6) for x in r}
  hists = {tuple(x["alloc_hist"]) for x in r}
  if preset in ("e3", "all"):
    assert len(taus) > 1, taus  # the temperature controller moved τ
    assert len(hists) > 1, hists  # E3 re-ranked at the epoch end (step 4)
  if preset == "dynamo":
    assert len(hists) > 1, hists  # DynaMO priorities from live statistics
  if preset == "es":
    assert len(eps) > 1, eps  # adaptive clip-higher moved ε_high
  if preset in ("eepo", "all"):
    assert all(x["eepo_gate"] == 1.0 and np.isfinite(x["eepo_unlearn_loss"]) for x in r)
    assert all(x["eepo_unlearn_loss"] < 0 for x in r)  # mean of log(1 - p) terms
  else:
    assert len(taus) == 1 or preset in ("e3", "all")
  for x in r:
    assert np.isfinite(x["loss"]) and np.isfinite(x["grad_norm"]), x


@pytest.mark.slow
def test_eepo_forgetting_in_micro_batches_gives_the_same_step(tmp_path):
  """Trainer._forget accumulates θ' over loss.micro_batches chunks of the stage-1 rows: the
  unlearning loss, θ' (seen through the stage-2 rollouts' entropy) and the step match one pass."""
  runs = {}
  for micro in (1, 4):
    workdir = str(tmp_path / f"micro{micro}")
    Trainer(
      tiny_config("eepo,test", steps=1, **{"loss.micro_batches": micro, "sft.steps": 0}), workdir
    ).run()
    (runs[micro],) = rows(workdir)
  one, four = runs[1], runs[4]
  assert one["eepo_gate"] == four["eepo_gate"] == 1.0
  np.testing.assert_allclose(four["eepo_unlearn_loss"], one["eepo_unlearn_loss"], rtol=1e-5)
  for key in ("entropy_stage1", "entropy_stage2", "reward", "loss"):
    np.testing.assert_allclose(four[key], one[key], rtol=1e-4, err_msg=key)
