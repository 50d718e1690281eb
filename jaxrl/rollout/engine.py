"""The rollout protocol the trainer talks to, and its in-process JAX engine.

The trainer only calls ``set_weights(params, version)`` and then ``generate(prompt ids, counts G_i,
temperature, key)``; a vLLM sidecar engine implements the same two methods. Two functions call
them, each naming the params it samples from right before it samples: ``Collector.sample``
(rollouts) and ``run/heldout.py: engine_sampler`` (evaluation). No sample relies on weights another
caller set, so none comes from params older than its caller's, and the JAX engine's reference
(the train state's arrays, which the next update donates) is replaced before it is read again.

Weight versions are ints. A training step's version (>= 0) is the number of updates its params
have had; params that no training step samples from get negative versions (``eval_version``,
``forget_version``), which never collide with a step's or with each other. An engine may skip
loading a version it already holds (the vLLM engine does: a push costs seconds), so one version
always names the same params.

``JaxEngine`` built with a ``multiturn.TurnConfig`` generates multi-turn rollouts with an
environment (``jaxrl.rollout.multiturn``) through the same ``generate``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.parallel import distributed
from jaxrl.rollout import compaction, multiturn, sampler
from jaxrl.types import Rollouts


def eval_version(step: int) -> int:
  """The version of the params evaluated after ``step`` updates: -1, -3, -5, ... (odd, < 0)."""
  return -1 - 2 * check_version(step)


def forget_version(step: int) -> int:
  """The version of EEPO's θ', forgotten from step version ``step``'s params: -2, -4, ... (even,
  < 0)."""
  return -2 - 2 * check_version(step)


def is_step_version(version: int) -> bool:
  """A training step's version (not the evaluation's params nor EEPO's θ')."""
  return check_version(version) >= 0


def check_version(version) -> int:
  """``version`` as an int; anything else (a string, a float, a bool) is a ``TypeError``."""
  if isinstance(version, bool) or not isinstance(version, numbers.Integral):
    raise TypeError(
      f"a weight version is an int (a training step's >= 0; eval_version / forget_version "
      f"for the others), not {type(version).__name__} {version!r}"
    )
  return int(version)


class RolloutEngine(Protocol):
  provides_entropy: bool  # False: the trainer scores the rollouts for ℓ_prox and entropies
  # True: generation may run on a thread beside the trainer's programs (rollout.max_staleness
  # >= 1 overlaps them); False: it shares their devices or collectives, so it runs inline
  concurrent: bool
  max_new_tokens: int  # the default response length (a call may ask for another)

  def set_weights(self, params, version: int) -> None:
    """Sample from ``params`` (named ``version``, an int: ``check_version``) from now on."""
    ...

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
  ) -> Rollouts:
    """Rollouts from the weights of the last ``set_weights``; before any, an error."""
    ...


class JaxEngine:
  """Samples with ``jaxrl.rollout.sampler`` from params held in device memory (no copy on sync).

  It holds a reference to the params of the last ``set_weights``: the trainer's own arrays, which
  its next update donates. Each sampling caller sets its params right before it samples, so a
  donated reference is only ever replaced, never read; were it read, ``generate`` says so instead
  of failing inside the sampler.

  With ``turns`` it samples multi-turn rollouts (``multiturn.generate``) instead: each call's
  environment is ``generate``'s ``respond`` or, without one, ``respond_factory(group_ids_R)`` (the
  row's question index among the call's B prompts, e.g. to build one environment per row). The
  last call's ``multiturn.TurnCounts`` are kept in ``turn_counts``.

  With ``compact_every`` > 0 single-turn rollouts drop their finished rows from the decode every
  that many tokens (``jaxrl.rollout.compaction``: the same tokens for the same key).
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
    compact_every: int = 0,
  ):
    self._graphdef = graphdef
    self._model_cfg = model_cfg
    self.max_new_tokens = max_new_tokens  # the default; each phase passes its own to generate
    self._eos, self._pad = eos_id, pad_id
    self._top_p = jnp.float32(top_p)
    self._params = None
    self.version: int | None = None
    self._turns, self._respond_factory = turns, respond_factory
    if compact_every and jax.process_count() > 1:
      # The host reads which rows finished between chunks: every row must be on this process.
      raise ValueError("rollout.compact_every needs one process (0 on several hosts)")
    self._compact_every = compact_every
    self.turn_counts: multiturn.TurnCounts | None = None

  def set_weights(self, params, version: int) -> None:
    # Always the caller's arrays, even for the version held: the same version may come as other
    # arrays (a copy for the rollout thread, the train state's own), and the held ones may have
    # been donated since.
    self.version = check_version(version)
    self._params = params

  def _live_params(self):
    if self._params is None:
      raise RuntimeError("JaxEngine.generate() before set_weights(): it holds no params")
    if any(x.is_deleted() for x in jax.tree.leaves(self._params) if isinstance(x, jax.Array)):
      raise RuntimeError(
        f"JaxEngine.generate(): the params set as version {self.version} were donated (an "
        "update ran since set_weights); set the params to sample from first"
      )
    return self._params

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
      return self._multiturn(
        prompt_ids_BxP, prompt_mask_BxP, counts_B, temperature, key, max_new_tokens, greedy, respond
      )
    if respond is not None:
      raise ValueError("respond is for an engine built with turns (multi-turn)")
    compacted = {"compact_every": self._compact_every} if self._compact_every else {}
    out = (compaction.generate if compacted else sampler.generate)(
      self._graphdef,
      self._live_params(),
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
      **compacted,
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
    out_and_counts = multiturn.generate(
      self._graphdef,
      self._live_params(),
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
    # Several processes: every one sees all rollouts and their turn counts, as single-turn.
    out, self.turn_counts = (
      distributed.to_host(out_and_counts) if jax.process_count() > 1 else out_and_counts
    )
    return multiturn.with_trajectory_reward(out, respond)
