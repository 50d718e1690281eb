"""The rollout protocol the trainer talks to, and its in-process JAX engine.

Every engine has one sampling call, ``generate(params, version, request) -> Rollouts``: the params
to sample from and their int weight version, and a ``SampleRequest`` (the prompts, counts G_i,
key, τ, response budget, greedy, and for multi-turn rollouts the environment's callback). The
JAX sampler (single-turn, compacted or multi-turn) and the vLLM sidecar engines all take it; the
``Rollouts`` it returns carry a multi-turn call's turn counts (``turns_R``, ``tool_calls_R``).
Every call names its params, so no sample comes from weights another caller set, nor from arrays
an update has donated since (the JAX engine holds none between calls).

Weight versions are ints. A training step's version (>= 0) is the number of updates its params
have had; params that no training step samples from get negative versions (``eval_version``,
``forget_version``), which never collide with a step's or with each other. An engine may skip
loading a version it already holds (the vLLM engine does: a push costs seconds), so one version
always names the same params.

``JaxEngine`` built with a ``multiturn.TurnConfig`` generates multi-turn rollouts with an
environment (``jaxrl.rollout.multiturn``) through the same ``generate``.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.parallel import distributed
from jaxrl.rollout import compaction, multiturn, sampler
from jaxrl.types import Rollouts

log = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class SampleRequest:
  """One sampling call, as every engine's ``generate`` takes it."""

  prompt_ids_BxP: Any  # i32, left-padded
  prompt_mask_BxP: Any  # bool
  counts_B: Any  # i32 rollouts per prompt, G_i (Σ = R)
  key: Any  # the call's PRNG key
  temperature: Any  # τ, a float or f32[]
  max_new_tokens: int | None = None  # N; None: the engine's default
  greedy: bool = False  # argmax tokens (evaluation), τ and top-p unused
  # Multi-turn: the environment's callback for these rows (``multiturn.Respond``, e.g. an
  # ``EnvironmentRespond`` of the rows' questions); None: the engine's ``respond_factory``
  respond: multiturn.Respond | None = None
  # The prompts are questions first_question.. (rows first_row..) of a larger batch (one host's
  # slice, ``hosts.PerHostEngine``): an engine draws for them what the whole batch would draw
  first_question: int = 0
  first_row: int = 0

  def respond_or(self, factory: Callable[[np.ndarray], Any] | None):
    """The call's ``respond``; without one ``factory(question_ids_R)`` (each row's prompt index
    in the whole batch, e.g. to reset one environment per row)."""
    if self.respond is not None:
      return self.respond
    if factory is None:
      raise ValueError("a multi-turn engine needs a request's respond or a respond_factory")
    counts_B = np.asarray(self.counts_B)
    return factory(np.repeat(np.arange(len(counts_B)), counts_B) + self.first_question)


class RolloutEngine(Protocol):
  provides_entropy: bool  # False: the trainer scores the rollouts for ℓ_prox and entropies
  # True: generation may run on a thread beside the trainer's programs (rollout.max_staleness
  # >= 1 overlaps them); False: it shares their devices or collectives, so it runs inline
  concurrent: bool
  max_new_tokens: int  # the default response length (a request may ask for another)

  def generate(self, params, version: int, request: SampleRequest) -> Rollouts:
    """``request``'s rollouts sampled from ``params``, whose weight version is ``version`` (an
    int: ``check_version``), with the engine's own sampled-token log-probs as
    ``behaviour_logp_RxN``; multi-turn, with the turn counts and the environment's trajectory
    reward (``rewards_R``, if it has one)."""
    ...

  def close(self) -> None: ...

  def stop_restarts(self) -> None:
    """The run is stopping (a signal): a server that fails from now on is not restarted (the
    signal may have been the whole job's). Called from a signal handler: it only sets a flag."""
    ...


def live_params(params, version: int):
  """``params`` to sample from; params an update has donated are an error naming ``version``."""
  if any(x.is_deleted() for x in jax.tree.leaves(params) if isinstance(x, jax.Array)):
    raise RuntimeError(
      f"generate(): the params of version {version} were donated (an update ran since they "
      "were read); pass the params to sample from"
    )
  return params


class JaxEngine:
  """Samples with ``jaxrl.rollout.sampler`` from the params each call names (device arrays, no
  copy; the engine keeps no reference between calls).

  With ``turns`` it samples multi-turn rollouts (``multiturn.generate``) instead, with the
  request's ``respond`` or ``respond_factory``'s (``SampleRequest.respond_or``).

  With ``compact_every`` > 0 single-turn rollouts longer than it drop their finished rows from the
  decode every that many tokens (``jaxrl.rollout.compaction``: the same tokens for the same key);
  on several processes it is off, with a warning.
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
    self.max_new_tokens = max_new_tokens  # the default; each phase passes its own
    self._eos, self._pad = eos_id, pad_id
    self._top_p = jnp.float32(top_p)
    self._turns, self._respond_factory = turns, respond_factory
    if compact_every and jax.process_count() > 1:
      # The host reads which rows finished between chunks: every row must be on this process.
      log.warning("rollout.compact_every=%d: off on several processes (rows decode to the end)",
                  compact_every)  # fmt: skip
      compact_every = 0
    self._compact_every = compact_every

  def close(self) -> None:
    """Nothing held: the params are each call's."""

  def stop_restarts(self) -> None:
    """Nothing to restart: the sampler runs in the trainer."""

  def generate(self, params, version: int, request: SampleRequest) -> Rollouts:
    params = live_params(params, check_version(version))
    counts_B = np.asarray(request.counts_B, np.int32)
    # The sampler's positional arguments (its programs' order) and its static ones.
    args = (
      self._graphdef,
      params,
      jnp.asarray(request.prompt_ids_BxP),
      jnp.asarray(request.prompt_mask_BxP),
      jnp.asarray(counts_B),
      request.key,
      jnp.float32(request.temperature),
      self._top_p,
    )
    static = dict(
      num_rollouts=int(counts_B.sum()),
      max_new_tokens=request.max_new_tokens or self.max_new_tokens,
      eos_id=self._eos,
      pad_id=self._pad,
      model_cfg=self._model_cfg,
      greedy=request.greedy,
    )
    if self._turns is not None:
      respond = request.respond_or(self._respond_factory)
      out = multiturn.generate(*args, respond, turns=self._turns, **static)
    elif request.respond is not None:
      raise ValueError("respond is for an engine built with turns (multi-turn)")
    elif 0 < self._compact_every < static["max_new_tokens"]:  # one chunk: nothing to compact
      out = compaction.generate(*args, compact_every=self._compact_every, **static)
    else:
      out = sampler.generate(*args, **static)
    # Several processes: every one decodes and scores all rollouts (identical rewards everywhere).
    out = distributed.to_host(out) if jax.process_count() > 1 else out
    return out if self._turns is None else multiturn.with_trajectory_reward(out, respond)
