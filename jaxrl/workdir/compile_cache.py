"""JAX's persistent compilation cache for a run.

A resumed run (after a preemption or a kill) or a repeated one loads its compiled programs — the
train step, the sampler, the scoring and evaluation programs — from disk instead of compiling them
again (at 7B on GPUs, compiling takes minutes). The cache is keyed by
the program, the compile options, the devices and the JAX version, so a stale entry is never used.
JAX writes entries in place: a kill in the middle of a write leaves a truncated entry, which JAX
reports ("Error reading persistent compilation cache entry ... truncated stream") and compiles
again, at every start, until the file (or the directory) is deleted; results are never affected.

Its entries are executables the trainer loads, so the directory must be this user's and closed to
others (``jaxrl.private_dirs.check_private_dir``): a shared or foreign-writable one is refused.

In multi-process runs every process reads the cache and process 0 writes it (JAX's own rule), so
the directory should be on the shared filesystem, as the workdir already is for checkpoints.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxrl.private_dirs import check_private_dir

log = logging.getLogger(__name__)

OFF = "off"
# JAX's default keeps only programs that took >= 1 s to compile; a run's many small programs
# (sampling, scoring, metrics) add up to seconds at start-up and cost kilobytes on disk.
MIN_COMPILE_TIME_S = 0.0


def cache_dir(setting: str, workdir: str) -> str | None:
  """Where the run's compiled programs are kept: ``setting`` "" means WORKDIR/compile_cache,
  unless the user set JAX's own $JAX_COMPILATION_CACHE_DIR (theirs wins: e.g. one cache shared
  by many runs); "off" means none; anything else is a directory ("~" expanded)."""
  if setting == OFF:
    return None
  if setting:
    return os.path.abspath(os.path.expanduser(setting))
  return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(workdir, "compile_cache")


def _field(setting: str) -> str:
  return (
    "compile_cache" if setting else "compile_cache ($JAX_COMPILATION_CACHE_DIR or the workdir's)"
  )


def check(setting: str, workdir: str) -> None:
  """``enable``'s check before anything is made (the command calls it before it writes the run's
  directory): the cache directory, or for one not made yet the directories above it, closed to
  others (a ConfigError naming where it came from)."""
  path = cache_dir(setting, workdir)
  if path is not None:
    check_private_dir(path, _field(setting), missing_ok=True)


def enable(setting: str, workdir: str) -> str | None:
  """Point JAX at the run's cache before anything is compiled; returns the directory (or None).
  Its entries are executables the process loads: a directory of another user's, or one others
  can write into, is refused (a ConfigError naming where it came from)."""
  path = cache_dir(setting, workdir)
  if path is None:
    return None
  check(setting, workdir)
  os.makedirs(path, mode=0o700, exist_ok=True)
  check_private_dir(path, _field(setting))  # again: made (or replaced) since the first check
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  log.info("compiled programs are cached in %s", path)
  return path
