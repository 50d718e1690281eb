"""The rollout protocol the trainer talks to, and its in-process JAX engine.

The trainer only calls ``generate(prompt ids, counts G_i, temperature, key)`` and
``set_weights(params, version)``; a vLLM sidecar engine implements the same two methods.
``JaxEngine`` built with a ``multiturn.TurnConfig`` generates multi-turn rollouts with an
environment (``jaxrl.rollout.multiturn``) through the same ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.parallel import distributed
from jaxrl.rollout import multiturn, sampler
from jaxrl.types import Rollouts


class RolloutEngine(Protocol):
  provides_entropy: bool  # False: the trainer scores the rollouts for ℓ_prox and entropies
  # True: generation may run on a thread beside the trainer's programs (rollout.max_staleness
  # >= 1 overlaps them); False: it shares their devices or collectives, so it runs inline
  concurrent: bool
  max_new_tokens: int  # the default response length (a call may ask for another)

  def set_weights(self, params, version) -> None: ...

  def close(self) -> None: ...

  def stop_restarts(self) -> None:
    """The run is stopping (a signal): a server that fails from now on is not restarted (the
    signal may have been the whole job's). Called from a signal handler: it only sets a flag."""
    ...

  def generate(
    self,
    prompt_ids_BxP,
    prompt_mask_BxP,
    counts_B,
    temperature,
    key,
    *,
    max_new_tokens: int | None = None,
    greedy: bool = False,
  ) -> Rollouts: ...


class JaxEngine:
  """Samples with ``jaxrl.rollout.sampler`` from params held in device memory (no copy on sync).

  With ``turns`` it samples multi-turn rollouts (``multiturn.generate``) instead: each call's
  environment is ``generate``'s ``respond`` or, without one, ``respond_factory(group_ids_R)`` (the
  row's question index among the call's B prompts, e.g. to build one environment per row). The
  last call's ``multiturn.TurnCounts`` are kept in ``turn_counts``.
  """

  provides_entropy = True
  concurrent = False  # the trainer's own devices

  def __init__(
    self,
    graphdef,
    model_cfg,
    *,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    top_p: float = 1.0,
    turns: multiturn.TurnConfig | None = None,
    respond_factory: Callable[[np.ndarray], multiturn.Respond] | None = None,
  ):
    self._graphdef = graphdef
    self._model_cfg = model_cfg
    self.max_new_tokens = max_new_tokens  # the default; each phase passes its own to generate
    self._eos, self._pad = eos_id, pad_id
    self._top_p = jnp.float32(top_p)
    self._params = None
    self.version = -1
    self._turns, self._respond_factory = turns, respond_factory
    self.turn_counts: multiturn.TurnCounts | None = None

  def set_weights(self, params, version) -> None:
    self._params = params
    self.version = version

  def close(self) -> None:
    self._params = None

  def stop_restarts(self) -> None:
    """Nothing to restart: the sampler runs in the trainer."""

  def generate(
    self,
    prompt_ids_BxP,
    prompt_mask_BxP,
    counts_B,
    temperature,
    key,
    *,
    max_new_tokens: int | None = None,
    greedy: bool = False,
    respond: multiturn.Respond | None = None,
  ) -> Rollouts:
    counts_B = np.asarray(counts_B, np.int32)
    if self._turns is not None:
      out = self._multiturn(
        prompt_ids_BxP, prompt_mask_BxP, counts_B, temperature, key, max_new_tokens, greedy, respond
      )
      return distributed.to_host(out) if jax.process_count() > 1 else out
    if respond is not None:
      raise ValueError("respond is for an engine built with turns (multi-turn)")
    out = sampler.generate(
      self._graphdef,
      self._params,
      jnp.asarray(prompt_ids_BxP),
      jnp.asarray(prompt_mask_BxP),
      jnp.asarray(counts_B),
      key,
      jnp.float32(temperature),
      self._top_p,
      num_rollouts=int(counts_B.sum()),
      max_new_tokens=max_new_tokens or self.max_new_tokens,
      eos_id=self._eos,
      pad_id=self._pad,
      model_cfg=self._model_cfg,
      greedy=greedy,
    )
    # Several processes: every one decodes and scores all rollouts (identical rewards everywhere).
    return distributed.to_host(out) if jax.process_count() > 1 else out

  def _multiturn(
    self, ids_BxP, mask_BxP, counts_B, temperature, key, max_new_tokens, greedy, respond
  ) -> Rollouts:
    if respond is None:
      if self._respond_factory is None:
        raise ValueError("a multi-turn JaxEngine needs respond= or a respond_factory")
      respond = self._respond_factory(np.repeat(np.arange(len(counts_B)), counts_B))
    out, self.turn_counts = multiturn.generate(
      self._graphdef,
      self._params,
      ids_BxP,
      mask_BxP,
      counts_B,
      key,
      temperature,
      self._top_p,
      respond,
      num_rollouts=int(counts_B.sum()),
      max_new_tokens=max_new_tokens or self.max_new_tokens,
      turns=self._turns,
      eos_id=self._eos,
      pad_id=self._pad,
      model_cfg=self._model_cfg,
      greedy=greedy,
    )
    return out
