"""Where a run keeps its compiled programs (``jaxrl.workdir.compile_cache.cache_dir``). That a resumed run
loads them and still ends bitwise where an uninterrupted run ends is tested by the kill/resume test,
whose runs share one cache: the uninterrupted run fills it, the resumed runs read it."""

import os
import subprocess
import sys

from run_helpers import ROOT

from jaxrl.workdir.compile_cache import cache_dir


def test_default_is_in_the_workdir(monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  assert cache_dir("", "/runs/a") == os.path.join("/runs/a", "compile_cache")


def test_jax_own_variable_wins_over_the_default_only(monkeypatch):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/shared/xla")
  assert cache_dir("", "/runs/a") == "/shared/xla"
  assert cache_dir("/mine", "/runs/a") == "/mine"


def test_off_and_user_paths(monkeypatch):
  monkeypatch.setenv("HOME", "/home/u")
  assert cache_dir("off", "/runs/a") is None
  assert cache_dir("~/xla", "/runs/a") == "/home/u/xla"
  assert cache_dir("rel/xla", "/runs/a") == os.path.abspath("rel/xla")


def _private(path):
  path.mkdir(mode=0o700, exist_ok=True)
  os.chmod(path, 0o700)
  return path


def test_a_cache_directory_others_can_write_or_own_is_refused(tmp_path, monkeypatch):
  """Its entries are executables the trainer loads: a directory of another user's, one others can
  write into (even with the sticky bit: they could plant an entry before the run writes it), or
  one under a directory others can rename it in, is refused naming where it came from."""
  import pytest

  from jaxrl.config import ConfigError
  from jaxrl.workdir.compile_cache import enable

  root = _private(tmp_path / "root")
  shared = root / "shared"
  shared.mkdir()
  for mode in (0o777, 0o1777, 0o775):
    os.chmod(shared, mode)
    with pytest.raises(ConfigError, match="writable by other users") as e:
      enable(str(shared), str(root))
    assert e.value.field == "compile_cache"
  os.chmod(shared, 0o700)
  open_parent = root / "open"
  open_parent.mkdir()
  os.chmod(open_parent, 0o777)
  with pytest.raises(ConfigError, match="could replace"):
    enable(str(_private(open_parent / "cache")), str(root))
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(shared))
  os.chmod(shared, 0o777)
  with pytest.raises(ConfigError, match="JAX_COMPILATION_CACHE_DIR") as e:
    enable("", str(root))
  if os.geteuid() == 0:  # a directory of another user's (root can make one)
    foreign = _private(root / "foreign")
    os.chown(foreign, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
      enable(str(foreign), str(root))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  import jax

  before = (
    jax.config.jax_compilation_cache_dir,
    jax.config.jax_persistent_cache_min_compile_time_secs,
  )
  try:  # the session's own cache (tests/conftest.py) is put back after
    assert enable("", str(root)) == str(root / "compile_cache")  # the workdir's: made private
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
  assert oct(os.stat(root / "compile_cache").st_mode & 0o777) == "0o700"


def test_the_trainer_refuses_an_open_cache_directory_before_writing_the_run(tmp_path):
  """Through ``jaxrl-train``: a 0777 cache directory, and one still to be made under a 0777
  directory, exit 2 naming compile_cache, with neither the run's directory nor the cache made."""
  open_dir = tmp_path / "open"
  open_dir.mkdir()
  os.chmod(open_dir, 0o777)
  for cache in (open_dir, open_dir / "cache"):
    out = subprocess.run(
      [
        sys.executable, "-m", "jaxrl.main", "--config=tiny:test", f"--workdir={tmp_path}/run",
        f"--config.compile_cache={cache}",
      ],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
      timeout=300,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "config.compile_cache" in line and "writable by other users" in line, line
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(open_dir / "cache")
