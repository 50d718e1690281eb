"""What the RL loop carries from one step to the next (``LoopState``), and its checkpoint:
``save_loop`` writes exactly it (batches in flight included), ``restore_loop`` reads it back."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl.methods.controllers import ControllerStates
from jaxrl.nn import lora
from jaxrl.parallel import sharding
from jaxrl.run import batches
from jaxrl.tasks.data.cursor import MixtureCursor
from jaxrl.types import QuestionStats, Rollouts, TrainState, pytree_dataclass, static_field
from jaxrl.workdir.checkpoint import Checkpointer

# The checkpoint item that holds ``ControllerStates``: a name in the checkpoint format, so it stays
# what checkpoints already on disk call it.
CONTROLLERS = "policies"


@pytree_dataclass
class LoopState:
  """Everything the loop carries from one step to the next, and exactly what a checkpoint holds:
  arrays (train state, question statistics, controller states) as leaves, the data cursor and the
  phase index as static fields (saved as JSON)."""

  train: TrainState
  stats: QuestionStats
  controllers: ControllerStates  # the gate's state is the one after the last trained batch
  cursor: MixtureCursor = static_field()  # after the last issued batch
  phase: int = static_field()  # of the last issued batch
  # Batches issued for the next steps (``batches.InFlight``, in step order): none between steps
  # when k = 0; a checkpoint holds them generated (``save_loop``).
  pending: tuple = static_field(default=())


def _replicated_global(tree, mesh):
  """Host-side state (question statistics, controllers) as arrays replicated over the global
  mesh: what a multi-process orbax save needs (a no-op with one process)."""
  if jax.process_count() == 1:
    return tree
  rep = sharding.replicated(mesh)
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(
      np.shape(x), rep, lambda index, x=np.asarray(x): x[index]
    ),
    tree,
  )


def _restored_rollouts(fields: dict) -> Rollouts:
  """A pending batch's rollouts from its checkpointed fields; one saved before the loss mask
  existed was single-turn, so its loss mask is its response mask (docs/algorithms.md §11)."""
  fields = {k: np.asarray(v) for k, v in fields.items()}
  fields.setdefault("loss_mask_RxN", fields["mask_RxN"])
  return Rollouts(**fields)


def _pending_tree(batch: batches.Batch) -> dict:
  """A generated batch's arrays: its rollouts' fields that are set, and its gate state."""
  fields = {
    f.name: np.asarray(v)
    for f in dataclasses.fields(Rollouts)
    if (v := getattr(batch.rollouts, f.name)) is not None
  }
  return {"rollouts": fields, "gate": batch.gate}


def _kept(train: TrainState) -> TrainState:
  """The train state as a checkpoint keeps it (also a ``TrainState`` of shardings): a LoRA run's
  adapters and their moments, not the frozen base, which the resumed run rebuilds as the first
  one did (warm start or HF checkpoint); a full fine-tuning run's whole state."""
  kept, _ = lora.partition(train.params, lora.policy_trainable(train.params))
  return dataclasses.replace(train, params=kept)


def save_loop(ckpt: Checkpointer, step: int, loop: LoopState, mesh, *, wait: bool = True) -> bool:
  """One checkpoint of the loop after ``step`` steps (asynchronous when the checkpointer is).

  Batches in flight are saved generated (waited for when ``wait``): a resumed run trains on
  exactly them. From the first one that is not (still running when not waited for, or failed),
  the checkpoint records their decisions alone, and the resumed run generates them again by its
  params (``RolloutSource._regenerate_deferred``): a batch's failure never costs the trained step."""
  done: list[batches.Batch] = []
  for p in loop.pending:
    if (batch := p.generated(wait)) is None:
      break
    done.append(batch)
  deferred = [p.issue.to_json() for p in loop.pending[len(done) :]]
  tree = {
    "state": _kept(loop.train),
    "stats": _replicated_global(loop.stats, mesh),
    CONTROLLERS: _replicated_global(loop.controllers, mesh),
  }
  meta = {"cursor": loop.cursor.to_json(), "phase": loop.phase, "step": step}
  if lora.has_adapters(loop.train.params):
    meta[lora.FINGERPRINT] = lora.fingerprint(loop.train.params)
  if done:
    tree["pending"] = [_replicated_global(_pending_tree(b), mesh) for b in done]
    meta["pending"] = [
      {
        "issue": b.issue.to_json(),
        "metrics": b.metrics,
        "fields": {
          k: [list(v.shape), v.dtype.name] for k, v in _pending_tree(b)["rollouts"].items()
        },
      }
      for b in done
    ]
  if deferred:
    meta["deferred"] = deferred
  return ckpt.save(step, tree, meta)


def restore_loop(
  ckpt: Checkpointer, step: int, like: LoopState, state_shardings, mesh
) -> LoopState:
  """The loop saved after ``step`` steps; ``like`` gives the structure (a fresh ``initial_loop``)."""
  rep = sharding.replicated(mesh)
  tree = {"state": _kept(like.train), "stats": like.stats, CONTROLLERS: like.controllers}
  target = {
    "state": _kept(state_shardings),
    "stats": jax.tree.map(lambda _: rep, like.stats),
    CONTROLLERS: jax.tree.map(lambda _: rep, like.controllers),
  }
  saved_meta = ckpt.restore_meta(step)
  saved = saved_meta.get("pending", [])
  if saved:
    tree["pending"] = [
      {
        "rollouts": {k: np.zeros(shape, dtype) for k, (shape, dtype) in p["fields"].items()},
        "gate": like.controllers.gate,
      }
      for p in saved
    ]
    target["pending"] = jax.tree.map(lambda _: rep, tree["pending"])
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, target
  )
  tree, meta = ckpt.restore(step, abstract)
  pending = tuple(
    batches.InFlight.done(
      batches.Batch(
        batches.Issue.from_json(p["issue"]),
        _restored_rollouts(arrays["rollouts"]),
        arrays["gate"],
        p["metrics"],
      )
    )
    for p, arrays in zip(saved, tree.get("pending", []))
  ) + tuple(
    batches.InFlight.later(batches.Issue.from_json(d)) for d in saved_meta.get("deferred", [])
  )
  cursor = MixtureCursor.from_json(meta["cursor"])
  train = _with_base(tree["state"], like.train, meta, ckpt.directory)
  return LoopState(train, tree["stats"], tree[CONTROLLERS], cursor, meta["phase"], pending)


def _with_base(restored: TrainState, like: TrainState, meta: dict, where: str) -> TrainState:
  """A LoRA run's restored adapters on the base this run rebuilt, after checking it is the one
  they were trained on; a full fine-tuning state as restored."""
  if not lora.has_adapters(like.params):
    return restored
  lora.check_base(meta.get(lora.FINGERPRINT), like.params, where)
  _, base = lora.partition(like.params, "adapters")
  return dataclasses.replace(restored, params=lora.combine(restored.params, base))
