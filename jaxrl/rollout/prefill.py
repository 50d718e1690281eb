"""Where every JAX decode starts: the B left-padded prompts expanded to R = Σ G_i rollout rows
(question i's prompt counts_B[i] times) and prefilled, once per distinct prompt, into the rows'
KV cache, with the logits that predict response token 0 (``prefill_rows`` → ``Prefilled``).

The single-turn sampler (``rollout.sampler``), its compacted form and the multi-turn decode
(``rollout.multiturn``) all start from a ``Prefilled``. The expansion has a static
``total_repeat_length``, so a new allocation (same R) never recompiles.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl.nn import kv_cache, model
from jaxrl.nn.logprobs import logits_f32
from jaxrl.types import Array, pytree_dataclass


def _expand(prompt_ids_BxP: Array, prompt_mask_BxP: Array, counts_B: Array, num_rollouts: int):
  """Repeat question i's prompt counts_B[i] times: the R prompt rows, their masks and group ids.

  The static ``total_repeat_length`` keeps R fixed, so new counts (same R) reuse the compilation.
  """

  def expand(x_B):
    return kv_cache.repeat_by_counts(x_B, counts_B, num_rollouts)

  prompt_ids_RxP = expand(prompt_ids_BxP).astype(jnp.int32)
  prompt_mask_RxP = expand(prompt_mask_BxP).astype(bool)
  group_ids_R = expand(jnp.arange(prompt_ids_BxP.shape[0], dtype=jnp.int32))
  return prompt_ids_RxP, prompt_mask_RxP, group_ids_R


def _prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, *, rows, model_cfg):
  """Run each distinct prompt through the model once, then give each of its counts_B[i] rollouts
  a copy of its cache (``rows`` rows in all, P slots: the decode grows it,
  ``sampler.sample_program``).

  A GRPO batch repeats every prompt G times: prefilling the B prompts rather than the R = Σ G_i
  rows does 1/G of the work (vLLM's prefix cache does the same for a request's n samples; HF
  ``generate`` prefills every row). The rows are independent, so the values are those of a
  prefill over the R rows. Returns the R-row cache and the logits that predict token 0.
  """
  cache = model.init_cache(
    model_cfg, prompt_ids_BxP.shape[0], prompt_ids_BxP.shape[1], jnp.dtype(model_cfg.dtype)
  )
  hidden_BxPxD, lm_head_VxD, cache = model.forward(
    graphdef,
    params,
    prompt_ids_BxP,
    model.positions_from_mask(prompt_mask_BxP),
    prompt_mask_BxP,
    cache,
    0,
  )
  # Token 0 comes from the prefill's last slot (P-1 holds every row's last prompt token).
  logits_BxV = logits_f32(hidden_BxPxD[:, -1], lm_head_VxD)
  logits_RxV = kv_cache.repeat_by_counts(logits_BxV, counts_B, rows)
  return cache.repeat_rows(counts_B, rows), logits_RxV


@pytree_dataclass
class Prefilled:
  """R rollout rows before their token 0: where every decode starts, single- or multi-turn."""

  prompt_ids_RxP: Array  # i32
  prompt_mask_RxP: Array  # bool
  group_ids_R: Array  # i32, the row's prompt
  prompt_len_R: Array  # i32, real prompt tokens: the RoPE position of response token 0
  cache: kv_cache.KVCache  # the prompts' keys and values, P slots
  kv_valid_RxS: Array  # bool over P + N slots: the real prompt slots, none of the response's yet
  logits_RxV: Array  # f32, predict token 0


def prefill_rows(
  graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, *, rows, max_new_tokens, model_cfg
) -> Prefilled:
  """Expand the B prompts to ``rows`` = R rows (``_expand``) and prefill them (``_prefill``: once
  per distinct prompt), for responses of at most ``max_new_tokens`` tokens."""
  prompt_ids_RxP, prompt_mask_RxP, group_ids_R = _expand(
    prompt_ids_BxP, prompt_mask_BxP, counts_B, rows
  )
  cache, logits_RxV = _prefill(
    graphdef, params, prompt_ids_BxP, prompt_mask_BxP, counts_B, rows=rows, model_cfg=model_cfg
  )
  return Prefilled(
    prompt_ids_RxP=prompt_ids_RxP,
    prompt_mask_RxP=prompt_mask_RxP,
    group_ids_R=group_ids_R,
    # Response token n sits at RoPE position prompt_len + n (no gap after a left-padded prompt).
    prompt_len_R=jnp.sum(prompt_mask_RxP, axis=-1, dtype=jnp.int32),
    cache=cache,
    kv_valid_RxS=jnp.concatenate(
      [prompt_mask_RxP, jnp.zeros((rows, max_new_tokens), bool)], axis=1
    ),
    logits_RxV=logits_RxV,
  )
