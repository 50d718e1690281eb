"""LoRA adapters as part of the params tree: which leaves train, what a checkpoint keeps, what the
base model is.

The model (``jaxrl.nn.model``, ``ModelConfig.lora_rank`` > 0) holds each adapter beside its kernel
as ``<proj>_lora_a`` [r, in] and ``<proj>_lora_b`` [out, r] params, so every consumer of params
(the sampler, π_old rescoring, evaluation, sharding, layer scan) runs the adapted model with no
change. What differs is only which leaves an update moves, named by ``Trainable``:

  "all":      every param (full fine-tuning; a model without adapters);
  "adapters": the adapters only — the base is frozen: no gradient, no optimizer state;
  "base":     everything but the adapters (the SFT warm start of a LoRA run: adapters are added
              for RL, and with B = 0 they leave the warm-started model unchanged).

The KL reference of a LoRA run is the same tree with the adapters switched off
(``without_adapters``): no second copy of the weights.
"""

from __future__ import annotations

import typing
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.nn import model
from jaxrl.parallel import distributed

Trainable = Literal["all", "adapters", "base"]
ADAPTER_A, ADAPTER_B = "_lora_a", "_lora_b"
FINGERPRINT = "lora_base_fingerprint"  # the checkpoint metadata key of ``fingerprint``


def _is_adapter(path, _value=None) -> bool:
  return str(path[-1]).endswith((ADAPTER_A, ADAPTER_B))


def has_adapters(params) -> bool:
  return any(_is_adapter(path) for path, _ in nnx.to_flat_state(params))


def policy_trainable(params) -> Trainable:
  """What an RL update trains: the adapters when the model has them, else everything."""
  return "adapters" if has_adapters(params) else "all"


def partition(params, trainable: Trainable):
  """(the trained part, the frozen part) of ``params``; "all" gives (params, None)."""
  if trainable not in typing.get_args(Trainable):
    raise ValueError(f"trainable={trainable!r} is not one of {typing.get_args(Trainable)}")
  if trainable == "all":
    return params, None
  adapters, base = params.split(_is_adapter, ...)
  if trainable == "base" and not jax.tree.leaves(adapters):
    return params, None  # no adapters: the base is everything (the same program as "all")
  return (adapters, base) if trainable == "adapters" else (base, adapters)


def combine(trained, frozen):
  """The whole params tree again (inverse of ``partition``)."""
  return trained if frozen is None else nnx.merge_state(trained, frozen)


def fresh_adapters(cfg: model.ModelConfig, seed: int, shardings):
  """The adapters ``model.create(cfg, seed)`` makes (A random, B zero) on their shardings (the
  params' shardings tree), without the base: under jit XLA drops the unused base initialisers.
  How a LoRA run started from an HF checkpoint gets the same adapters as one built from scratch."""
  adapter_shardings = partition(shardings, "adapters")[0]
  return jax.jit(
    lambda: partition(model.create(cfg, seed)[1], "adapters")[0], out_shardings=adapter_shardings
  )()


def without_adapters(params):
  """The base model's function: the same tree with every adapter zero (x A B = 0 exactly).

  Under jit the zeros are constants, so the KL reference costs a forward, not a copy."""
  adapters, base = partition(params, "adapters")
  if not jax.tree.leaves(adapters):
    raise ValueError("the model has no LoRA adapters to switch off (a KL reference needs one)")
  return combine(jax.tree.map(jnp.zeros_like, adapters), base)


def _flat(params) -> dict:
  return dict(nnx.to_flat_state(params))


def adapter_pairs(params) -> list[tuple[tuple, object, object]]:
  """(kernel path, A leaf, B leaf) of every adapter, in the params' order."""
  flat = _flat(params)
  out = []
  for path, a in flat.items():
    name = str(path[-1])
    if name.endswith(ADAPTER_A):
      kernel = (*path[:-1], name.removesuffix(ADAPTER_A))
      out.append((kernel, a, flat[(*path[:-1], kernel[-1] + ADAPTER_B)]))
  return out


def merged(params, alpha: float, rank: int):
  """The base-model params (no adapter leaves) whose function is the adapted model's: each
  kernel W [out, in] becomes W + (alpha / r) · B A in float32 (the other leaves keep their
  dtype). Float32, because an update far below W's precision (a bfloat16 base) would round away:
  the writer casts."""
  flat = _flat(params)
  for kernel, a, b in adapter_pairs(params):
    w = flat[kernel]
    # matmul broadcasts a scanned model's leading [L] axis
    delta = jnp.matmul(b[...].astype(jnp.float32), a[...].astype(jnp.float32)) * (alpha / rank)
    flat[kernel] = w.replace(w[...].astype(jnp.float32) + delta)
  base = {path: v for path, v in flat.items() if not _is_adapter(path)}
  return nnx.from_flat_state(base)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@jax.jit
def bit_sums(tree) -> list:
  """Per leaf, two sums modulo 2**32 of its elements' bit patterns: plain, and weighted by a hash
  of the element's position. Integer sums are exact in any order, so the fingerprint does not
  depend on the mesh (or the devices) that holds the leaf."""
  out = []
  for x in jax.tree.leaves(tree):
    bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    position = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape)
    weight = position * jnp.uint32(2654435761) + jnp.uint32(1)  # Knuth's multiplicative hash
    out.append(
      jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)])
    )
  return out


def fingerprint(params) -> list[list[int]]:
  """What a LoRA checkpoint records of the base its adapters were trained on (every non-adapter
  leaf's ``bit_sums``), so a resume or an export onto another base fails: the base must be
  rebuilt bit for bit (``model.checkpoint``, the cached warm start, or the seed's init)."""
  _, base = partition(params, "adapters")
  return [[int(v) for v in s] for s in distributed.to_host(bit_sums(base))]


class BaseMismatch(ValueError):
  """A LoRA checkpoint read onto another base than its adapters were trained on: the checkpoint is
  whole, the run's setup differs (never a damaged checkpoint to fall back past)."""


def check_base(saved: list | None, params, where: str) -> None:
  """Raise ``BaseMismatch`` unless ``params``' base has the ``saved`` fingerprint (a LoRA
  checkpoint's)."""
  if saved is None:
    raise BaseMismatch(f"{where}: the checkpoint has no LoRA adapters (written with rank 0?)")
  if saved != fingerprint(params):
    raise BaseMismatch(
      f"{where}: the checkpoint's LoRA adapters were trained on another base model than the one "
      "rebuilt here (did the warm start or model.checkpoint change, or model.param_dtype?)"
    )
