"""A tiny model and its helpers shared by the sampler's tests (test_sampler.py,
test_sampler_compaction.py): the config, left padding, and the training forward's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.nn import model

PAD, EOS = 0, 1
# A small vocabulary so that EOS is sampled often (per-row stops happen within N tokens).
CFG = model.ModelConfig(
  vocab_size=16,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  rope_theta=1e6,
  tie_embeddings=False,
)


def left_pad(prompts, p):
  ids = np.full((len(prompts), p), PAD, np.int32)
  for i, row in enumerate(prompts):
    ids[i, p - len(row) :] = row
  mask = np.zeros_like(ids, bool)
  for i, row in enumerate(prompts):
    mask[i, p - len(row) :] = True
  return ids, mask


@jax.jit
def full_logits(graphdef, params, ids_BxT, mask_BxT):
  """The training forward (no cache) over a whole padded sequence, as [B, T, V] logits."""
  hidden, lm_head, _ = model.forward(
    graphdef, params, ids_BxT, model.positions_from_mask(mask_BxT), mask_BxT
  )
  return hidden @ lm_head.T


def teacher_forced_logits(tiny, out):
  """Float64 logits predicting each response token: one no-cache forward, prompt ++ response."""
  ids = jnp.concatenate([out.prompt_ids_RxP, out.tokens_RxN], axis=1)
  mask = jnp.concatenate([out.prompt_mask_RxP, out.mask_RxN], axis=1)
  logits = np.asarray(full_logits(*tiny, ids, mask), np.float64)
  p = out.prompt_ids_RxP.shape[1]
  return logits[:, p - 1 : -1]
