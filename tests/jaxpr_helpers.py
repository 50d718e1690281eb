"""Inspecting traced programs in tests (e.g. asserting that no gather on the vocab axis exists)."""

import jax
import jax.extend


def contains_primitive(jaxpr, name: str) -> bool:
  """True if ``name`` appears in ``jaxpr`` or any sub-jaxpr (scan/map/checkpoint bodies)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      return True
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      if contains_primitive(sub, name):
        return True
  return False


def output_shapes(jaxpr, name: str) -> list[tuple[int, ...]]:
  """The output shapes of every ``name`` equation in ``jaxpr`` and its sub-jaxprs."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      shapes += [tuple(v.aval.shape) for v in eqn.outvars]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes += output_shapes(sub, name)
  return shapes
