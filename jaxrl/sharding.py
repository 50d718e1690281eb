"""The mesh and the one table of logical-axis rules.

Model code names logical axes (``logical_axes`` metadata on every ``nnx.Param``); this module alone
knows how they map onto the mesh axes (data, fsdp, tensor). Params, optimizer state (whose moment
trees carry the same Param metadata) and batches are all sharded from here.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "layers": None,   # the stacked layer axis of scan_layers: lax.scan slices it, so never split
}


def make_mesh(data: int, fsdp: int, tensor: int, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh in Auto mode: XLA propagates shardings inside jit."""
  devices = jax.devices() if devices is None else devices
  need = data * fsdp * tensor
  if need > len(devices):
    raise ValueError(f"mesh {data}x{fsdp}x{tensor} needs {need} devices, have {len(devices)}")
  grid = np.asarray(devices[:need]).reshape(data, fsdp, tensor)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _mesh_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return int(np.prod([mesh.shape[a] for a in axes]))


def logical_to_spec(logical_axes, shape, mesh: Mesh) -> P:
  """PartitionSpec for an array; a dimension the mesh axis does not divide stays replicated."""
  spec = []
  for name, dim in zip(logical_axes, shape):
    axes = LOGICAL_AXIS_RULES[name]
    spec.append(axes if axes is not None and dim % _mesh_size(mesh, axes) == 0 else None)
  return P(*spec)


def tree_shardings(tree, mesh: Mesh):
  """NamedShardings for a pytree of Params (by logical axes) and plain arrays (replicated)."""

  def one(x):
    if isinstance(x, nnx.Variable):
      axes = x.get_metadata().get("logical_axes")
      spec = logical_to_spec(axes, x.shape, mesh) if axes else P()
      return x.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (row) axis over the data axes, the rest replicated."""
  return NamedSharding(mesh, P(LOGICAL_AXIS_RULES["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def shard_batch(batch, mesh: Mesh):
  """device_put every leaf of a host batch with rows over the data axes (scalars replicated)."""
  rows, rep = batch_sharding(mesh), replicated(mesh)
  if jax.process_count() == 1:
    return jax.tree.map(lambda x: jax.device_put(x, rows if np.ndim(x) else rep), batch)

  def put(x):   # every process holds the whole host batch and hands over its devices' blocks
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, rows if x.ndim else rep, lambda index: x[index])

  return jax.tree.map(put, batch)
