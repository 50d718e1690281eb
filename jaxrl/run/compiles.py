"""Counting compiled versions of the hot programs, through JAX's public monitoring events.

Every time a jitted function is traced (new shapes, new static arguments, a Python scalar where an
array belongs) JAX records a trace event naming the function. The loop reports the counts per step:
constant after the first step, +1 at a phase switch (new shapes), else something recompiles.
"""

from __future__ import annotations

import collections

import jax

# JAX's event for "a jitted function was traced" (jax._src.dispatch.JAXPR_TRACE_EVENT), the same
# name from jax 0.4 to 0.11; a rename would leave the counts at 0, which test_sampler's trace
# counts catch.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


class CompileCounter:
  """Traces of the named functions since ``start()``; ``counts()`` maps metric name → count."""

  def __init__(self, **functions: str):
    self._metric = {fn: metric for metric, fn in functions.items()}
    self._counts = collections.Counter()
    self._listening = False

  def _listen(self, event: str, duration: float, **kwargs) -> None:
    del duration
    metric = self._metric.get(kwargs.get("fun_name"))
    if event == TRACE_EVENT and metric is not None:
      self._counts[metric] += 1

  def start(self) -> CompileCounter:
    if not self._listening:
      jax.monitoring.register_event_duration_secs_listener(self._listen)
      self._listening = True
    return self

  def stop(self) -> None:
    if self._listening:
      jax.monitoring.unregister_event_duration_listener(self._listen)
      self._listening = False

  def counts(self) -> dict[str, int]:
    return {metric: self._counts[metric] for metric in self._metric.values()}
