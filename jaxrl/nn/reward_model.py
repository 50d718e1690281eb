"""A sequence-classification reward model: an HF ``Qwen2ForSequenceClassification`` /
``LlamaForSequenceClassification`` (any decoder ``jaxrl.nn.hf_config`` reads) with one label.

Its decoder is the policy's ``Decoder`` and loads with the same HF loader, sharded by the same
logical axes; the head ``score`` [1, D] (no bias) reads the final-norm hidden state at one
position per row. That position is transformers' own: the rightmost token that is not
``pad_token_id`` (the rightmost valid one when the config has no pad id), so a batch scores as
transformers scores it, right-padded or not.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.nn import hf, hf_config, hf_load
from jaxrl.nn import model as jaxrl_model
from jaxrl.nn.layers import dense
from jaxrl.nn.model import ModelConfig
from jaxrl.parallel import sharding
from jaxrl.types import Array


@dataclasses.dataclass(frozen=True)
class RewardModel:
  cfg: ModelConfig  # tie_embeddings true: the checkpoint has no LM head, none is built
  graphdef: nnx.GraphDef
  params: nnx.State
  score_1xD: Array
  pad_id: int | None  # config.json's pad_token_id: where a row's score is read

  def scores(self, tokens_RxT, mask_RxT) -> Array:
    """f32[R]: the model's score of each row (``reward_scores``, jitted)."""
    return _jitted_scores(self.graphdef, self.pad_id)(
      self.params, self.score_1xD, tokens_RxT, mask_RxT
    )


def reward_model_config(path, dtype: str = "float32", scan_layers: bool = False) -> ModelConfig:
  """The decoder's ModelConfig of a sequence-classification checkpoint (no LM head), in ``dtype``
  for both params and compute; e.g. for the memory plan, before anything is read."""
  config = hf_config.read_config_json(path)
  archs = config.get("architectures") or []
  if not any(str(a).endswith("ForSequenceClassification") for a in archs):
    raise ValueError(
      f"{path}: config.json architectures {archs} name no *ForSequenceClassification model"
    )
  labels = len(config.get("id2label") or {"0": ""})
  if labels != 1:
    raise ValueError(f"{path}: a reward model has one label, config.json has {labels}")
  cfg = hf_config.model_config_from_hf(
    config, dtype=dtype, param_dtype=dtype, scan_layers=scan_layers
  )
  return dataclasses.replace(cfg, tie_embeddings=True)


def load_reward_model(
  path, dtype: str = "float32", mesh=None, *, scan_layers: bool = False
) -> RewardModel:
  """The checkpoint at ``path`` in ``dtype``, sharded over ``mesh`` like the policy (by logical
  axes; the head replicated), or on the default device without one."""
  path = pathlib.Path(path)
  cfg = reward_model_config(path, dtype, scan_layers)
  shardings = score_sharding = None
  if mesh is not None:
    shardings = sharding.tree_shardings(jaxrl_model.abstract(cfg)[1], mesh)
    score_sharding = sharding.replicated(mesh)
  graphdef, params, score = hf_load.load_hf_score_model(path, cfg, dtype, shardings, score_sharding)
  if score.shape[0] != 1:
    raise ValueError(f"{path}: {hf.SCORE_HEAD} has {score.shape[0]} labels, a reward model one")
  pad_id = hf_config.read_config_json(path).get("pad_token_id")
  return RewardModel(cfg, graphdef, params, score, None if pad_id is None else int(pad_id))


def score_positions(tokens_RxT: Array, mask_RxT: Array, pad_id: int | None) -> Array:
  """i32[R]: where each row's score is read: transformers' rightmost non-pad token (0 if none)."""
  keep_RxT = mask_RxT.astype(bool)
  if pad_id is not None:
    keep_RxT = keep_RxT & (tokens_RxT != pad_id)
  t_T = jnp.arange(tokens_RxT.shape[1], dtype=jnp.int32)
  return jnp.argmax(t_T * keep_RxT, axis=-1).astype(jnp.int32)


def reward_scores(graphdef, params, score_1xD, tokens_RxT, mask_RxT, pad_id) -> Array:
  """f32[R]: score · h at each row's ``score_positions``, h the decoder's final-norm state."""
  positions_RxT = jaxrl_model.positions_from_mask(mask_RxT)
  hidden_RxTxD, _, _ = jaxrl_model.forward(graphdef, params, tokens_RxT, positions_RxT, mask_RxT)
  at_R = score_positions(tokens_RxT, mask_RxT, pad_id)
  last_Rx1xD = jnp.take_along_axis(hidden_RxTxD, at_R[:, None, None], axis=1)
  return dense(last_Rx1xD, score_1xD)[:, 0, 0].astype(jnp.float32)


@functools.cache
def _jitted_scores(graphdef, pad_id):
  return jax.jit(functools.partial(reward_scores, graphdef, pad_id=pad_id))
