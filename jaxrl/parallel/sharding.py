"""The mesh and the one table of logical-axis rules.

Model code names logical axes (``logical_axes`` metadata on every ``nnx.Param``); this module alone
knows how they map onto the mesh axes (data, fsdp, tensor). Params, optimizer state (whose moment
trees carry the same Param metadata) and batches are all sharded from here.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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
  "lora": None,  # the rank r of a LoRA adapter (A [r, in], B [out, r]): small, never split
  "layers": None,  # the stacked layer axis of scan_layers: lax.scan slices it, so never split
  # Activations (``constrain``). Rows stay split over the data axes ("batch") and the hidden
  # dimension whole on every device: the FSDP weights are all-gathered one layer at a time.
  # Left to itself, XLA's propagation followed the fsdp-split weights and split activations
  # along hidden instead, all-gathering [rows, T, D] inputs and all-reducing [rows, T, F] MLP
  # outputs, so every device ran the MLP on the whole micro-batch (--plan on the 7B config).
  "act_seq": None,
  "act_embed": None,
  "act_heads": "tensor",
  "act_mlp": "tensor",
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


def mesh_of(tree):
  """The (abstract) mesh a traced pytree's arrays live on; None for concrete arrays, on one device,
  or when the arrays carry no mesh (uncommitted inputs). Meant for jitted code: under an eager
  ``jax.grad`` of mesh-sharded arrays the leaves are tracers too, and ``constrain`` then fails."""
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.core.Tracer):
      continue  # eager arrays: a constraint would be a no-op anyway
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and mesh.size > 1:
      return mesh
  return None


@contextlib.contextmanager
def activation_mesh(tree):
  """Within a jitted function, make the mesh of ``tree`` (e.g. the params) the context mesh, so
  ``constrain`` acts; without one (single device, eager, uncommitted arrays) do nothing.

  The mesh comes from the arrays' own types, so callers need no ``jax.set_mesh``: every jitted
  step that runs the model on sharded params (the trainer's, --plan's, the sampler's) constrains
  its activations the same way.
  """
  mesh = mesh_of(tree)
  current = jax.sharding.get_abstract_mesh()
  if mesh is None or not current.empty:
    yield
    return
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def constrain(x, *logical_axes):
  """``with_sharding_constraint`` of an activation by logical axis names (``LOGICAL_AXIS_RULES``),
  against the context mesh; a no-op without one. A dimension its mesh axes do not divide is left
  to XLA (unconstrained) rather than forced whole. Never changes values."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  spec = []
  for name, dim in zip(logical_axes, x.shape):
    axes = LOGICAL_AXIS_RULES[name] if name is not None else None
    if axes is None:
      spec.append(None)
    else:
      spec.append(axes if dim % _mesh_size(mesh, axes) == 0 else P.UNCONSTRAINED)
  return jax.lax.with_sharding_constraint(x, P(*spec))


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

  def put(x):  # every process holds the whole host batch and hands over its devices' blocks
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, rows if x.ndim else rep, lambda index: x[index])

  return jax.tree.map(put, batch)
