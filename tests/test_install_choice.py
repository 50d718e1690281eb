"""`make` picks the CUDA builds when `nvidia-smi -L` finds an NVIDIA GPU and the CPU builds
otherwise, and says which (a dry run with a fake `nvidia-smi` first on PATH: nothing installed)."""

import os
import subprocess

import pytest
from run_helpers import ROOT


def _dry_run(tmp_path, nvidia_smi: str | None) -> str:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  if nvidia_smi is not None:
    (bin_dir / "nvidia-smi").write_text(nvidia_smi)
    (bin_dir / "nvidia-smi").chmod(0o755)
  env = {k: v for k, v in os.environ.items() if k not in ("GPU", "MAKEFLAGS")}
  env["PATH"] = f"{bin_dir}:{env['PATH']}"
  venvs = [f"VENV={tmp_path}/venv", f"VLLM_VENV={tmp_path}/venv-vllm"]
  done = subprocess.run(
    ["make", "-n", "run", "vllm-env", *venvs],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
    check=True,
  )
  return done.stdout


GPU_LISTED = '#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f0e)"\n'
DRIVER_MISSING = (
  '#!/bin/sh\necho "NVIDIA-SMI has failed because it could not communicate"\nexit 9\n'
)


def test_a_listed_gpu_selects_the_cuda_builds(tmp_path):
  out = _dry_run(tmp_path, GPU_LISTED)
  assert "an NVIDIA GPU (nvidia-smi -L): installing requirements-gpu.txt" in out
  assert "pip install -q -r requirements-gpu.txt" in out
  assert "pip install -q -r requirements-vllm-gpu.txt" in out
  assert "uninstall" not in out  # the GPU vLLM keeps its CUDA torchvision


@pytest.mark.parametrize("nvidia_smi", [None, DRIVER_MISSING], ids=["absent", "failing"])
def test_no_gpu_keeps_the_cpu_builds(tmp_path, nvidia_smi):
  out = _dry_run(tmp_path, nvidia_smi)
  assert "no NVIDIA GPU: CPU builds: installing requirements.txt" in out
  assert "pip install -q -r requirements.txt" in out
  assert "pip install -q -r requirements-vllm.txt" in out
  assert "uninstall -q -y torchvision torchaudio torchcodec" in out
  assert "requirements-gpu.txt" not in out and "requirements-vllm-gpu.txt" not in out
