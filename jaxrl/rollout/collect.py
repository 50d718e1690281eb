"""A step's rollouts with the log-probs of docs/algorithms.md §9: the engine's own (ℓ_μ,
behaviour) and the trainer's (ℓ_prox, under the params the update starts from), with entropies
at τ.

``Collector`` is the one place that turns host rows into device rows for the rescoring and
forgetting programs (rows sharded over the data axes, ``step.sequential_chunks`` sequential
chunks: what ``--plan`` compiles).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.parallel import distributed, sharding
from jaxrl.rl import packing, step
from jaxrl.rl.programs import ForgetConfig, Programs
from jaxrl.rollout import multiturn
from jaxrl.rollout.engine import RolloutEngine, SampleRequest
from jaxrl.types import Rollouts


def turn_metrics(rollouts: Rollouts) -> dict:
  """Multi-turn rollouts' mean model turns and tool calls per row ({} single-turn)."""
  if rollouts.turns_R is None:
    return {}
  return dict(
    turns_mean=float(np.mean(np.asarray(rollouts.turns_R))),
    tool_calls_mean=float(np.mean(np.asarray(rollouts.tool_calls_R))),
  )


def token_mean_entropy(rollouts: Rollouts) -> float:
  """Token-weighted mean entropy at τ over the model's sampled tokens (the loss mask: an
  environment's tokens were not sampled, docs/algorithms.md §11)."""
  mask = np.asarray(rollouts.loss_mask_RxN)
  # where, not a product: the value at a position off the loss mask is never read
  entropy = np.where(mask, np.asarray(rollouts.entropy_RxN), 0.0)
  return float(entropy.sum() / max(mask.sum(), 1))


@dataclasses.dataclass(frozen=True)
class Collector:
  """Samples from ``engine`` and scores / forgets with the run's ``programs``."""

  engine: RolloutEngine
  programs: Programs
  logprob_chunk: int
  micro_batches: int  # loss.micro_batches: the rescoring's chunks are at most this many
  environment: object = None  # the run's Environment (multi-turn rollouts); None = single-turn
  # loss.pack_buckets with loss.packing on: the rescoring's forward packs each chunk; 0: padded
  pack_buckets: int = 0

  def sample(
    self,
    params,
    version: int,
    ids_BxP,
    mask_BxP,
    counts_B,
    tau,
    key,
    max_new_tokens: int,
    *,
    score=True,
    qids_B=None,
  ) -> Rollouts:
    """Rollouts sampled from ``params`` (weight version ``version``) at τ, with the engine's
    behaviour log-probs.

    Every call names its params to the engine (which skips loading a version it holds), so
    nothing samples from weights someone else set.

    ``score``: the rollouts also get ℓ_prox and entropies under ``params`` (the update will start
    from them: an on-policy batch). The JAX sampler's own numbers are both (its full-softmax ℓ,
    which with top_p < 1 is not its ℓ_μ, docs/algorithms.md §9.1); a vLLM sidecar gives no
    entropies, so the rollouts are scored here (one forward, as the update does). Without
    ``score`` they get neither (the loop rescores a stale batch under its update's params).

    With an environment, each row's trajectory starts from ``environment.reset`` with its question
    (``qids_B``, the prompts' question ids); the engine gives the environment's
    ``trajectory_reward``, if any, as the rollouts' ``rewards_R`` (the loop adds the verifier's).
    """
    respond = None
    if self.environment is not None and qids_B is not None:
      qids_R = np.repeat(np.asarray(qids_B), np.asarray(counts_B))
      respond = multiturn.EnvironmentRespond(self.environment, qids_R)
    request = SampleRequest(
      ids_BxP, mask_BxP, counts_B, key, tau, max_new_tokens=max_new_tokens, respond=respond
    )
    out = self.engine.generate(params, version, request)
    if self.engine.provides_entropy:
      return dataclasses.replace(out, prox_logp_RxN=out.prox_logp_RxN if score else None)
    return self.anchor(params, out, tau) if score else out

  def anchor(self, params, rollouts: Rollouts, tau) -> Rollouts:
    """``rollouts`` with ℓ_prox and entropies at τ under ``params`` (the update's start)."""
    logp, ent = distributed.to_host(self.logp(params, rollouts, tau))
    return jax.tree.map(
      jnp.asarray, dataclasses.replace(rollouts, prox_logp_RxN=logp, entropy_RxN=ent)
    )

  def _rows(self, rollouts: Rollouts, *more):
    """The rows a forward reads (and ``more`` per-row arrays after them), sharded over the data
    axes; and how many sequential chunks."""
    rows = (
      rollouts.prompt_ids_RxP,
      rollouts.prompt_mask_RxP,
      rollouts.tokens_RxN,
      rollouts.mask_RxN,
      *more,
    )
    batch = sharding.shard_batch(tuple(np.asarray(x) for x in rows), self.programs.mesh)
    return batch, step.sequential_chunks(len(rows[0]), self.micro_batches)

  def logp(self, params, rollouts: Rollouts, tau):
    """(logp_RxN, entropy_RxN) at τ of the rollouts under ``params``."""
    batch, micro = self._rows(rollouts)
    pack = self._plan(rollouts, micro, self.pack_buckets)
    return self.programs.logp(self.logprob_chunk)(
      params, *batch, jnp.float32(tau), micro=micro, pack=pack
    )

  def _plan(self, rollouts: Rollouts, micro: int, buckets: int):
    """The rows' packed layout over ``micro`` chunks (``buckets`` 0: None, padded), sharded as
    the rows."""
    if not buckets:
      return None
    pack = packing.plan(rollouts.prompt_mask_RxP, rollouts.mask_RxN, 1, micro, buckets)
    return sharding.shard_batch(pack, self.programs.mesh)

  def forget(self, params, rollouts: Rollouts, tau, fc: ForgetConfig):
    """EEPO's (θ', unlearning loss) from the rollouts' rows: the forward reads every response
    token, the objective the model's own (the loss mask, docs/algorithms.md §11)."""
    batch, micro = self._rows(rollouts, rollouts.loss_mask_RxN)
    pack = self._plan(rollouts, micro, fc.pack_buckets)
    return self.programs.forget(fc)(params, *batch, jnp.float32(tau), pack, micro=micro)
