"""``VllmEngine``: the rollout protocol served by vLLM sidecars (launched here, or attached by URL).

``generate(params, version, request)`` (``engine.SampleRequest``) first pushes the params
(``set_weights``: an HF-layout directory loaded into every server, skipped for the version they
hold), then sends one request per question with ``n = G_i`` and returns the same ``Rollouts``
layout as the JAX sampler; built with ``turns``, multi-turn rollouts with an environment
(``vllm_multiturn``: one request per running row and turn). The server returns sampled-token log-probs at τ but no
entropies (``provides_entropy = False``): the trainer scores the rollouts under the sampling params,
which gives both; token ids outside the model's vocabulary and impossible log-probs are refused.

The weights (their directory, LoRA adapters, ``sync_every``) and the servers' restarts on a fault
are ``vllm_weights.WeightSync``'s, which ``VllmEngine`` extends.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxrl.rollout import multiturn, vllm_multiturn
from jaxrl.rollout.engine import SampleRequest
from jaxrl.rollout.sampler import stop_ids
from jaxrl.rollout.vllm_weights import EngineConfig, WeightSync
from jaxrl.types import Rollouts


def _prompts(request: SampleRequest):
  """The request's prompt arrays on the host, and each prompt's real ids (a request's prompt)."""
  ids_BxP = np.asarray(request.prompt_ids_BxP)
  mask_BxP = np.asarray(request.prompt_mask_BxP, bool)
  return ids_BxP, mask_BxP, [row[m].tolist() for row, m in zip(ids_BxP, mask_BxP)]


def _tau(request: SampleRequest) -> float:
  """The server's temperature: 0 samples greedily."""
  return 0.0 if request.greedy else float(request.temperature)


class VllmEngine(WeightSync):
  provides_entropy = False
  concurrent = True  # HTTP to a server in another process

  def __init__(
    self,
    model_cfg,
    tokenizer,
    cfg: EngineConfig,
    *,
    workdir: str,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...],
    pad_id: int,
    top_p: float = 1.0,
    turns: vllm_multiturn.TurnStops | None = None,
    respond_factory: Callable[[np.ndarray], multiturn.Respond] | None = None,
  ):
    super().__init__(model_cfg, tokenizer, cfg, workdir=workdir)
    self.max_new_tokens = max_new_tokens  # the default; each phase passes its own to generate
    self._eos, self._pad, self._top_p = stop_ids(eos_id), pad_id, top_p
    self._turns, self._respond_factory = turns, respond_factory

  def generate(self, params, version: int, request: SampleRequest) -> Rollouts:
    """Push ``params`` as ``version`` (``set_weights``: nothing when the servers hold it), then
    sample: one request per question with ``n = G_i``; built with ``turns``, multi-turn rollouts
    (``vllm_multiturn``) with the request's ``respond`` or ``respond_factory``'s. A request that is
    one host's slice of a batch (``first_question``, ``first_row``) gets the seeds its questions
    would get in the whole batch."""
    self._check_open("rollout")
    self.set_weights(params, version)
    if self._turns is not None:
      return self._multiturn(request)
    if request.respond is not None:
      raise ValueError("respond is for an engine built with turns (multi-turn)")
    ids_BxP, mask_BxP, prompts = _prompts(request)
    counts_B, n = np.asarray(request.counts_B, np.int64), self._budget(request)
    # One seed per call from the step's key: a resumed run sends the same requests.
    seed = int(jax.random.randint(request.key, (), 0, 2**30)) + request.first_question
    done = self._with_restarts(
      "rollout",
      self._served_dir(),
      self.version,
      lambda: self.client.complete(
        prompts,
        counts_B.tolist(),
        temperature=_tau(request),
        max_tokens=n,
        stop_token_ids=list(self._eos),
        seed=seed,
        top_p=1.0 if request.greedy else self._top_p,
        model=self._adapter,  # with adapter sync every request names it (None: the model)
        vocab_size=self.model_cfg.vocab_size,
      ),
    )
    return self._assemble(ids_BxP, mask_BxP, counts_B, done, n)

  def _budget(self, request: SampleRequest) -> int:
    return request.max_new_tokens or self.max_new_tokens

  def _multiturn(self, request: SampleRequest) -> Rollouts:
    """One request per running row and turn (``vllm_multiturn``); each turn's requests are
    retried as a whole on a restarted server, so a failure never steps the environment twice."""
    ids_BxP, mask_BxP, prompts = _prompts(request)
    counts_B = np.asarray(request.counts_B, np.int64)
    group_ids_R = np.repeat(np.arange(len(counts_B), dtype=np.int32), counts_B)
    respond = request.respond_or(self._respond_factory)
    tokens_RxN, mask_RxN, loss_mask_RxN, logp_RxN, finished_R, counts = vllm_multiturn.generate(
      self._turn_requests(request),
      [prompts[i] for i in group_ids_R],
      respond,
      stops=self._turns,
      max_new_tokens=self._budget(request),
      eos_id=self._eos,
      pad_id=self._pad,
    )
    out = Rollouts(
      prompt_ids_RxP=ids_BxP[group_ids_R],
      prompt_mask_RxP=mask_BxP[group_ids_R],
      tokens_RxN=tokens_RxN,
      mask_RxN=mask_RxN,
      loss_mask_RxN=loss_mask_RxN,
      behaviour_logp_RxN=logp_RxN,
      entropy_RxN=np.zeros(tokens_RxN.shape, np.float32),
      lengths_R=mask_RxN.sum(axis=1, dtype=np.int32),
      group_ids_R=group_ids_R,
      finished_R=finished_R,
      turns_R=counts.turns_R,
      tool_calls_R=counts.tool_calls_R,
    )
    return multiturn.with_trajectory_reward(out, respond)

  def _turn_requests(self, request: SampleRequest) -> vllm_multiturn.Complete:
    """The requests of one turn (``vllm_multiturn.Complete``), with their seeds and restarts."""
    tau, stops = _tau(request), self._turns

    def complete(seqs, running_R, turn, max_tokens):
      # A seed per turn from the step's key, and the whole batch's row r's is seed + r: a resumed
      # run (or one host's slice) sends the same requests, and no two rows or turns share a draw.
      turn_key = jax.random.fold_in(request.key, turn)
      seed = request.first_row + int(jax.random.randint(turn_key, (), 0, 2**30))
      return self._with_restarts(
        f"rollout (turn {turn + 1})",
        self._served_dir(),
        self.version,
        lambda: self.client.complete(
          seqs,
          running_R.astype(np.int64).tolist(),
          temperature=tau,
          max_tokens=max_tokens,
          stop_token_ids=[*self._eos, *stops.turns.stop_ids],
          seed=seed,
          top_p=1.0 if tau == 0.0 else self._top_p,
          model=self._adapter,
          vocab_size=self.model_cfg.vocab_size,
          stop=stops.stop_strings,
        ),
      )

    return complete

  def _assemble(self, ids_BxP, mask_BxP, counts_B, done, n: int) -> Rollouts:
    """Rows grouped in question order, responses right-padded with pad_id to ``n`` tokens."""
    group_ids_R = np.repeat(np.arange(len(counts_B), dtype=np.int32), counts_B)
    flat = [c for per_question in done for c in per_question]
    r = len(flat)
    tokens_RxN = np.full((r, n), self._pad, np.int32)
    logp_RxN = np.zeros((r, n), np.float32)
    lengths_R = np.zeros((r,), np.int32)
    finished_R = np.zeros((r,), bool)
    for i, c in enumerate(flat):
      length = min(len(c.token_ids), n)
      tokens_RxN[i, :length] = c.token_ids[:length]
      logp_RxN[i, :length] = c.logprobs[:length]
      lengths_R[i] = length
      finished_R[i] = length > 0 and c.token_ids[length - 1] in self._eos
    mask_RxN = np.arange(n)[None, :] < lengths_R[:, None]
    return Rollouts(
      prompt_ids_RxP=ids_BxP[group_ids_R],
      prompt_mask_RxP=mask_BxP[group_ids_R],
      tokens_RxN=tokens_RxN,
      mask_RxN=mask_RxN,
      loss_mask_RxN=mask_RxN,  # single-turn: every response token is the model's
      behaviour_logp_RxN=logp_RxN,
      entropy_RxN=np.zeros((r, n), np.float32),
      lengths_R=lengths_R,
      group_ids_R=group_ids_R,
      finished_R=finished_R,
    )
