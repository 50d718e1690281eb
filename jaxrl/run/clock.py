"""When device work is done, not when it was queued.

JAX dispatches asynchronously: a jitted call returns as soon as its work is queued, so a clock
read right after it measures the dispatch (~1 ms) and the work's time lands on whatever next waits
for its arrays. Every duration the trainer logs ends at ``ready_at``, which blocks on what the
timed work produced before it reads the clock.
"""

from __future__ import annotations

import time

import jax


def ready_at(*outputs) -> float:
  """The wall-clock time (``time.time()``) once every array in ``outputs`` is computed."""
  jax.block_until_ready(outputs)
  return time.time()
