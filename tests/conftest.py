"""Fixtures shared by the test modules, and one compilation cache for the whole session.

``file_size_limit``: real write failures without root. A file-size limit (RLIMIT_FSIZE) makes writes past it fail
with EFBIG, the way a full disk fails them with ENOSPC (a tmpfs of fixed size would need root).

The session's compiled programs go to one fresh directory (JAX's persistent cache, through
$JAX_COMPILATION_CACHE_DIR, which every pytest-xdist worker and every ``python -m jaxrl.main``
subprocess inherits): the many tiny-config runs of the suite compile the same programs, and the
kill/resume, interrupt and multi-process tests restart runs. Set the variable yourself to keep a
cache between sessions."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import tempfile

import pytest

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller (or a run without xdist)
  _SESSION_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl-xla-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
else:
  _SESSION_CACHE = None


def pytest_configure(config):
  """One matmul precision for every test module: full float32, so the float64 oracles' tolerances
  hold on backends whose default matmul uses bfloat16 or TF32 passes (on CPU it is the same either
  way). Runs in the controller and in every pytest-xdist worker (each loads this file), before
  collection; imported here, after the cache variables above, which JAX reads when it is imported.
  Subprocesses (``python -m jaxrl.main``, ``python -c`` scripts) do not load this file and keep
  their own setting (tests/sharded_step_check.py and test_logprobs' script set it themselves)."""
  del config
  import jax

  jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """Modules with slow tests run first: their tests take minutes each (servers, kills, several
  processes), so started early they overlap with the rest, and the many short modules fill both
  pytest-xdist workers at the end instead of one long module running alone (the Makefile passes
  --no-loadscope-reorder, which keeps this order; xdist's default orders modules by test count)."""
  del config
  slow = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow)  # stable: each module keeps its order


def pytest_unconfigure(config):
  if _SESSION_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture
def file_size_limit():
  """set(n): writes past n bytes fail from now on; set(None): no limit. Restored afterwards.
  SIGXFSZ is ignored so a write returns the error instead of the signal killing the process
  (``jaxrl.main`` does the same)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

  def set_limit(n):
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY if n is None else n, hard))

  yield set_limit
  resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  signal.signal(signal.SIGXFSZ, previous)
