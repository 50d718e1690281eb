"""jaxrl as a package: ``pyproject.toml`` lists every module of the tree and the built-in configs,
and the wheel installs into a fresh venv outside the repository, where ``jaxrl-train`` runs a
built-in config by name and the other commands explain themselves."""

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from run_helpers import ROOT


def _packages_in_the_tree() -> set[str]:
  root = pathlib.Path(ROOT)
  return {
    ".".join(p.parent.relative_to(root).parts) for p in (root / "jaxrl").rglob("__init__.py")
  } | {"jaxrl.configs"}


def test_pyproject_lists_every_package_and_the_commands():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  assert set(project["tool"]["setuptools"]["packages"]) == _packages_in_the_tree()
  assert project["tool"]["setuptools"]["package-dir"] == {"jaxrl.configs": "configs"}
  assert set(project["project"]["scripts"]) == {"jaxrl-train", "jaxrl-eval", "jaxrl-export"}
  assert {"gpu", "vllm", "wandb", "dev"} <= set(project["project"]["optional-dependencies"])


def _run(cmd, **kwargs):
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, **kwargs)
  assert done.returncode == 0, (
    f"{' '.join(map(str, cmd))}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
  )
  return done


@pytest.mark.slow
def test_the_wheel_installs_and_trains_outside_the_repository(tmp_path):
  # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
  src = tmp_path / "src"
  shutil.copytree(
    ROOT,
    src,
    ignore=shutil.ignore_patterns(
      ".git", ".venv*", "runs", "__pycache__", "build", "*.egg-info", ".hypothesis", "notebooks"
    ),
  )
  _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", src])
  (wheel,) = (tmp_path / "dist").glob("jaxrl-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "jaxrl/configs/tiny.py" in names and "jaxrl/run/cli.py" in names
  assert not any(n.startswith(("tests/", "configs/", "bench/")) for n in names)

  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", venv])
  # The lock as constraints: the same versions as .venv, so pip takes them from its cache.
  pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
  _run([*pip, wheel, "-c", os.path.join(ROOT, "requirements.txt")])

  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  bin_ = venv / "bin"
  # The smallest built-in preset: what is checked is the installed package, not learning.
  flags = ["--config=tiny:test", f"--workdir={elsewhere / 'run'}", "--config.log.plot=False"]
  _run([bin_ / "jaxrl-train", *flags], cwd=elsewhere, env=env)
  with open(elsewhere / "run" / "metrics.jsonl") as f:
    assert len(f.readlines()) == 6  # tiny:test: 6 RL steps
  assert (elsewhere / "run" / "results.md").exists()
  assert "--benchmarks:" in _run([bin_ / "jaxrl-eval", "--help"], cwd=elsewhere, env=env).stdout
  _run(
    [bin_ / "jaxrl-export", f"--checkpoint={elsewhere / 'run'}", f"--out={elsewhere / 'hf'}"],
    cwd=elsewhere,
    env=env,
  )
  assert (elsewhere / "hf" / "model.safetensors").exists()
