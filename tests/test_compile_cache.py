"""Where a run keeps its compiled programs (``jaxrl.workdir.compile_cache.cache_dir``). That a resumed run
loads them and still ends bitwise where an uninterrupted run ends is tested by the kill/resume test,
whose runs share one cache: the uninterrupted run fills it, the resumed runs read it."""

import os

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
