"""Fixtures shared by the test modules.

``file_size_limit``: real write failures without root. A file-size limit (RLIMIT_FSIZE) makes writes past it fail
with EFBIG, the way a full disk fails them with ENOSPC (a tmpfs of fixed size would need root)."""
from __future__ import annotations

import resource
import signal

import pytest


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
