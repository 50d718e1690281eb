"""The same command on several processes: `configs/tiny.py` as 2 processes x 2 CPU devices
(jax.distributed over Gloo, real subprocesses) trains exactly like 1 process with 4 devices, and a
2-process run resumes from its own checkpoint in a new 2-process run; params split across processes
are exported whole by each. The runs start RL from one warm start, trained once for the module
(a 2-process SFT is tests/test_multihost_vllm.py's), so what is compared is the RL steps. The same
holds for multi-turn rollouts with a tool (`tiny:tools`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from multihost_export_check import SEED, config
from multihost_helpers import assert_same_metrics, checkpoint_params, free_port, run_ranks
from run_helpers import ROOT, read_metrics
from safetensors.numpy import load_file

from jaxrl.nn import hf, model

pytestmark = pytest.mark.slow
FLAGS = [
  "--config=configs/tiny.py:test",
  "--config.mesh.fsdp=4",
  "--config.sft.steps=40",
  "--config.checkpoint.every=2",
  # a seed whose steps 1 and 4 have mixed-reward groups: the policy moves before the checkpoint
  # the second run resumes from and after it (seed 0's five steps draw no learning signal)
  "--config.seed=1",
]


# LoRA: the adapters (and their moments) are what the processes update and checkpoint; the base
# is rebuilt by each process from the shared warm start. The KL reference is the base.
LORA = {
  "model.lora.rank": 8,
  "model.lora.alpha": 16.0,
  "loss.kl_coef": 0.05,
  "optim.learning_rate": 1e-3,
}


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
  """The SFT checkpoint of FLAGS (steps=0: the warm start and its evaluation only); a LoRA run
  starts from the same one (its adapters are fresh)."""
  workdir = tmp_path_factory.mktemp("warm_start")
  run_ranks(FLAGS, workdir, steps=0, processes=1, devices=4)
  return workdir / "sft"


@pytest.mark.parametrize("overrides", [{}, LORA], ids=["full", "lora"])
def test_two_processes_train_like_one_and_resume(tmp_path, warm_start, overrides):
  single, multi = tmp_path / "one_process", tmp_path / "two_processes"
  for workdir in (single, multi):
    shutil.copytree(warm_start, workdir / "sft")
  flags = FLAGS + [f"--config.{k}={v}" for k, v in overrides.items()]
  run_ranks(flags, single, steps=5, processes=1, devices=4)
  errs = run_ranks(flags, multi, steps=3, processes=2, devices=2)  # checkpoints at steps 2 and 3
  assert all("SFT warm start loaded" in e for e in errs)
  errs = run_ranks(flags, multi, steps=5, processes=2, devices=2)  # a new 2-process run resumes
  assert all("resumed from step 3" in e for e in errs)
  one, two = read_metrics(single), read_metrics(multi)
  assert [r["step"] for r in two] == [1, 2, 3, 4, 5]
  assert_same_metrics(one, two, rtol=1e-4)
  # Gloo's all-reduce sums the 4 devices' gradients in another order than the in-process one, and
  # Adam's normalisation magnifies those last-bit differences for near-zero gradients (measured max
  # |diff| 2.3e-7 and 1.4e-5 in two runs), so the params are compared as trajectories: the two runs'
  # distance must be tiny next to the distance both travelled from the warm start (measured 1.1e-3).
  same = {"seed": 1, **overrides}  # FLAGS' seed: a LoRA run's fresh adapters depend on it
  one, two = checkpoint_params(single, 5, **same), checkpoint_params(multi, 5, **same)
  start = checkpoint_params(single, sft=True, **same)
  assert np.linalg.norm(two - one) < 1e-2 * np.linalg.norm(one - start)
  # Files are written once: metrics by process 0 only, a log per process.
  assert (multi / "log.txt").exists() and (multi / "log.process1.txt").exists()


# tiny:tools at the test size, on the two easiest levels: 200 SFT steps teach the 32-wide model
# to call the calculator on them, so that most steps before and after the resume have groups of
# mixed reward (measured for seed 0: steps 1, 2, 3 and 5).
TOOLS_FLAGS = [
  "--config=configs/tiny.py:test,tools",
  "--config.mesh.fsdp=4",
  "--config.sft.steps=200",
  "--config.task.levels=1x1+,2x1+",
  "--config.task.sft_levels=",
  "--config.checkpoint.every=2",
  "--config.seed=0",
]


def test_two_processes_run_multi_turn_rollouts_like_one_and_resume(tmp_path):
  """Multi-turn rollouts on 2 processes: every process runs the calculator for the rows that
  called and feeds the same observations to its devices' turns in lockstep. The run equals the
  1-process one (turns, calls, rewards, losses) and resumes from its own checkpoint."""
  single, multi = tmp_path / "one_process", tmp_path / "two_processes"
  run_ranks(TOOLS_FLAGS, single, steps=5, processes=1, devices=4)
  shutil.copytree(single / "sft", multi / "sft")  # its warm start
  run_ranks(TOOLS_FLAGS, multi, steps=3, processes=2, devices=2)  # checkpoints at steps 2 and 3
  errs = run_ranks(TOOLS_FLAGS, multi, steps=5, processes=2, devices=2)
  assert all("resumed from step 3" in e for e in errs)
  one, two = read_metrics(single), read_metrics(multi)
  assert [r["step"] for r in two] == [1, 2, 3, 4, 5]
  assert all(r["tool_calls_mean"] > 0 for r in one)
  # The policy moves before the checkpoint the resume starts from, and after it.
  assert any(r["grad_norm"] > 0 for r in one[:3]) and any(r["grad_norm"] > 0 for r in one[3:])
  # Compile counts are skipped: they count misses of the workdir's compile cache, which the
  # 2-process run's first half filled for its second.
  assert_same_metrics(one, two, rtol=1e-4, skip=[k for k in one[0] if k.startswith("compiles_")])
  same = dict(variant="test,tools", seed=0, **{"task.levels": "1x1+,2x1+", "task.sft_levels": ""})
  a, b = checkpoint_params(single, 5, **same), checkpoint_params(multi, 5, **same)
  start = checkpoint_params(single, sft=True, **same)
  assert np.linalg.norm(b - a) < 1e-2 * np.linalg.norm(a - start)


def test_every_process_exports_the_whole_model(tmp_path):
  """Params split over 2 processes' devices, exported by each (tensor-by-tensor gathers): both
  exports equal the one a single process writes from the same seed, bitwise."""
  port = free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, "tests/multihost_export_check.py", str(port), str(r), str(tmp_path)],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for r in range(2)
  ]
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and out.splitlines()[-1].startswith("ok"), err[-3000:]
  for layout in ("loop", "scan"):
    cfg = config(layout == "scan")
    params = jax.jit(lambda cfg=cfg: model.create(cfg, SEED)[1])()  # jitted, as the ranks did
    hf.save_hf_checkpoint(cfg, params, tmp_path / layout, untie=True)
    expected = load_file(tmp_path / layout / "model.safetensors")
    for rank in range(2):
      got = load_file(tmp_path / f"{layout}.rank{rank}" / "model.safetensors")
      assert got.keys() == expected.keys()
      for name, value in expected.items():
        assert np.array_equal(got[name], value), (layout, rank, name)
