"""A reward model trained in code: ``model:tiny-rm``, the built-in arithmetic task's scorer.

A tiny Qwen2 decoder with a score head (``jaxrl.nn.reward_model``'s forward, the one a run scores
with) learns from pairs over the task's training buckets: the question with its reference answer
and the same question with a wrong answer, the reference with one digit replaced by another. The
loss is Bradley–Terry's, -log σ(s⁺ - s⁻), plus a small penalty on (s⁺ + s⁻)² that keeps the scores
centred on 0 (the pairwise loss sees only their differences). Its held-out pairwise accuracy is
measured on the task's held-out split (the questions the policy is evaluated on, none of them
trained on), and it is saved as an HF ``Qwen2ForSequenceClassification`` checkpoint with the task's
tokenizer, which ``model:PATH`` loads like any other.

``reward.terms = "model:tiny-rm"`` names it for a run's own task config: the directory
``WORKDIR/tiny-rm-<key>`` of the run (like everything a run writes), ``<key>`` a hash of the task
fields and settings it is trained from, is trained on first use (about 30 s on 2 CPU cores) and
reused afterwards, a resumed run included. Without a run directory (``--plan``) it is
``$JAXRL_CACHE/tiny-rm-<key>`` (default ``~/.cache/jaxrl``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.fields import ConfigError
from jaxrl.nn import hf, reward_model
from jaxrl.nn import model as jaxrl_model
from jaxrl.nn.model import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.rl import optim
from jaxrl.tasks import arithmetic_task
from jaxrl.tasks.data import arithmetic
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.sections import TaskSection
from jaxrl.types import Array, PyTree, TrainState, pytree_dataclass

log = logging.getLogger(__name__)

NAME = "tiny-rm"  # model:tiny-rm
REPORT = "tiny_rm.json"  # written last into its directory: a complete checkpoint, how it trained
_FORMAT = "tiny-rm-v1"  # part of the cache key: change it when training changes what it makes


@dataclasses.dataclass(frozen=True)
class Settings:
  """How the reward model is trained (the cache key holds them all)."""

  steps: int = 600
  batch_pairs: int = 64
  learning_rate: float = 3e-3
  warmup_steps: int = 30
  centering: float = 1e-2  # weight of mean (s⁺ + s⁻)²
  train_pairs: int = 16384  # questions drawn from the training buckets, each with a wrong answer
  heldout_per_level: int = 64  # held-out questions per level (as tiny's evaluation draws them)
  seed: int = 0
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16


SETTINGS = Settings()


def rm_config(settings: Settings, vocab_size: int) -> ModelConfig:
  """The decoder: Qwen2 (q/k/v biases), no LM head, float32."""
  return ModelConfig(
    vocab_size=vocab_size,
    hidden_size=settings.hidden_size,
    intermediate_size=settings.intermediate_size,
    num_layers=settings.num_layers,
    num_heads=settings.num_heads,
    num_kv_heads=settings.num_kv_heads,
    head_dim=settings.head_dim,
    qkv_bias=True,
    qk_norm=False,
    tie_embeddings=True,
    max_position_embeddings=256,
  )


def wrong_answer(answer: str, rng: np.random.Generator) -> str:
  """``answer`` (digits) with one digit, at a uniform position, replaced by another digit."""
  i = int(rng.integers(len(answer)))
  digit = (int(answer[i]) + int(rng.integers(1, 10))) % 10
  return f"{answer[:i]}{digit}{answer[i + 1 :]}"


@dataclasses.dataclass(frozen=True)
class Pairs:
  """Each question with its reference answer (chosen) and a wrong one (rejected), as token rows
  right-padded with the pad id; a pair's two rows have one length."""

  chosen_NxT: np.ndarray
  chosen_mask_NxT: np.ndarray
  rejected_NxT: np.ndarray
  rejected_mask_NxT: np.ndarray

  def take(self, idx) -> tuple[np.ndarray, ...]:
    return tuple(x[idx] for x in dataclasses.astuple(self))


def _rows(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Token rows of ``texts``, tokenised as a ``model:`` term tokenises prompt + response."""
  ids = tok(texts)["input_ids"]
  tokens_NxT = np.full((len(ids), max(map(len, ids))), vocab.PAD_ID, np.int32)
  mask_NxT = np.zeros(tokens_NxT.shape, bool)
  for r, x in enumerate(ids):
    tokens_NxT[r, : len(x)], mask_NxT[r, : len(x)] = x, True
  return tokens_NxT, mask_NxT


def encode_pairs(tok, problems: list[tuple[str, str]], rng: np.random.Generator) -> Pairs:
  """``problems`` (question, reference answer) as pairs, each with a ``wrong_answer``."""
  chosen = [q + a for q, a in problems]
  rejected = [q + wrong_answer(a, rng) for q, a in problems]
  return Pairs(*_rows(tok, chosen), *_rows(tok, rejected))


def task_pairs(tcfg: arithmetic.TaskConfig, tok, settings: Settings) -> tuple[Pairs, Pairs]:
  """(training pairs, held-out pairs): questions drawn from every level's training buckets
  (uniformly over levels, with replacement), and the task's held-out split."""
  rng = np.random.default_rng([settings.seed, 3])
  uniform = [1.0] * len(tcfg.levels)
  train = arithmetic.sft_corpus(tcfg, settings.train_pairs, settings.seed, uniform)
  # One training question per level: build_task draws the held-out split from its own streams,
  # so these are the questions the run evaluates on, whatever its training split's size.
  heldout_cfg = dataclasses.replace(
    tcfg, num_train_per_level=1, num_heldout_per_level=settings.heldout_per_level
  )
  heldout = [(q.prompt, q.answer) for q in arithmetic.build_task(heldout_cfg)[1]]
  return encode_pairs(tok, train, rng), encode_pairs(tok, heldout, rng)


@pytree_dataclass
class RMParams:
  decoder: PyTree  # nnx.State of the Decoder's params
  score_1xD: Array


def pair_scores(
  graphdef, params: RMParams, chosen_BxT, chosen_mask_BxT, rejected_BxT, rejected_mask_BxT
):
  """(s⁺ [B], s⁻ [B]): the scores of the pairs' two rows, in one forward."""
  tokens_2BxT = jnp.concatenate([chosen_BxT, rejected_BxT])
  mask_2BxT = jnp.concatenate([chosen_mask_BxT, rejected_mask_BxT])
  s_2B = reward_model.reward_scores(
    graphdef, params.decoder, params.score_1xD, tokens_2BxT, mask_2BxT, vocab.PAD_ID
  )
  b = chosen_BxT.shape[0]
  return s_2B[:b], s_2B[b:]


def pair_loss(graphdef, centering: float, params: RMParams, *rows):
  """(Bradley–Terry loss + centering · mean (s⁺ + s⁻)², the share of pairs ranked right)."""
  chosen_B, rejected_B = pair_scores(graphdef, params, *rows)
  margin_B = chosen_B - rejected_B
  loss = -jnp.mean(jax.nn.log_sigmoid(margin_B))
  loss = loss + centering * jnp.mean(jnp.square(chosen_B + rejected_B))
  return loss, jnp.mean(margin_B > 0)


def train_step(
  graphdef, tx: optax.GradientTransformation, centering: float, state: TrainState, *rows
):
  """One AdamW step on a batch of pairs: (state, {loss, accuracy})."""
  grad_fn = jax.value_and_grad(functools.partial(pair_loss, graphdef, centering), has_aux=True)
  (loss, accuracy), grads = grad_fn(state.params, *rows)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return TrainState(state.step + 1, params, opt_state), dict(loss=loss, accuracy=accuracy)


@dataclasses.dataclass(frozen=True)
class TrainedRM:
  cfg: ModelConfig
  graphdef: object
  params: RMParams
  heldout_accuracy: float  # share of held-out pairs whose reference scores above the wrong answer
  heldout_pairs: int
  seconds: float

  @property
  def model(self) -> reward_model.RewardModel:
    """As a run holds it: ``model.scores(tokens, mask)`` are the scores a ``model:`` term reads."""
    p = self.params
    return reward_model.RewardModel(self.cfg, self.graphdef, p.decoder, p.score_1xD, vocab.PAD_ID)

  def scores(self, tokens_RxT, mask_RxT) -> np.ndarray:
    return np.asarray(self.model.scores(tokens_RxT, mask_RxT))


def pairwise_accuracy(rm: TrainedRM, pairs: Pairs) -> float:
  chosen_N = rm.scores(pairs.chosen_NxT, pairs.chosen_mask_NxT)
  rejected_N = rm.scores(pairs.rejected_NxT, pairs.rejected_mask_NxT)
  return float(np.mean(chosen_N > rejected_N))


def _init(cfg: ModelConfig, settings: Settings) -> tuple[object, RMParams]:
  graphdef, decoder = jaxrl_model.create(cfg, settings.seed)
  key = jax.random.fold_in(jax.random.key(settings.seed), 1)
  score_1xD = jax.random.normal(key, (1, cfg.hidden_size), jnp.float32) * cfg.hidden_size**-0.5
  return graphdef, RMParams(decoder, score_1xD)


def train_reward_model(
  tcfg: arithmetic.TaskConfig, tok, settings: Settings = SETTINGS
) -> TrainedRM:
  """The reward model of ``tcfg``'s task trained for ``settings.steps`` steps, with its held-out
  pairwise accuracy."""
  start = time.monotonic()
  train, heldout = task_pairs(tcfg, tok, settings)
  cfg = rm_config(settings, vocab.vocab_size())
  graphdef, params = _init(cfg, settings)
  tx = optim.adamw(
    settings.learning_rate,
    settings.warmup_steps,
    decay_steps=settings.steps - settings.warmup_steps,
    weight_decay=0.0,
  )
  state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
  step = jax.jit(
    functools.partial(train_step, graphdef, tx, settings.centering), donate_argnums=(0,)
  )
  rng = np.random.default_rng([settings.seed, 4])
  for i in range(settings.steps):
    idx = rng.integers(len(train.chosen_NxT), size=settings.batch_pairs)
    state, metrics = step(state, *train.take(idx))
    if (i + 1) % 100 == 0:
      log.info("%s step %d: loss %.4f", NAME, i + 1, float(metrics["loss"]))
  rm = TrainedRM(cfg, graphdef, state.params, 0.0, len(heldout.chosen_NxT), 0.0)
  accuracy = pairwise_accuracy(rm, heldout)
  return dataclasses.replace(rm, heldout_accuracy=accuracy, seconds=time.monotonic() - start)


def save(rm: TrainedRM, out_dir, tok=None) -> pathlib.Path:
  """``rm`` as an HF ``Qwen2ForSequenceClassification`` checkpoint (with ``tok`` when given)."""
  return hf.save_hf_score_model(
    rm.cfg, rm.params.decoder, rm.params.score_1xD, out_dir, tok, pad_id=vocab.PAD_ID
  )


def cache_root() -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAXRL_CACHE") or pathlib.Path.home() / ".cache" / "jaxrl")


def cache_key(tcfg: arithmetic.TaskConfig, settings: Settings) -> str:
  """What the trained model depends on, hashed: the task's questions and layout, the settings."""
  fields = {
    "format": _FORMAT,
    "levels": [s.name for s in tcfg.levels],
    "digit_width": tcfg.digit_width,
    "reverse_answer": tcfg.reverse_answer,
    "heldout_modulus": tcfg.heldout_modulus,
    "settings": dataclasses.asdict(settings),
  }
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def train_into(path: pathlib.Path, tcfg: arithmetic.TaskConfig, settings: Settings) -> pathlib.Path:
  """The checkpoint at ``path``, trained there unless a complete one is (built in a directory of
  its own, renamed into place whole: a concurrent trainer's finished one is kept)."""
  if (path / REPORT).is_file():
    return path
  log.info("training the reward model %s on the task's training split into %s", NAME, path)
  tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  tok = vocab.build_tokenizer(tmp)  # the task's vocabulary, saved with the checkpoint
  rm = train_reward_model(tcfg, tok, settings)
  save(rm, tmp)
  report = dict(
    heldout_pairwise_accuracy=rm.heldout_accuracy,
    heldout_pairs=rm.heldout_pairs,
    seconds=round(rm.seconds, 1),
    levels=[s.name for s in tcfg.levels],
    settings=dataclasses.asdict(settings),
  )
  (tmp / REPORT).write_text(json.dumps(report, indent=1))
  log.info(
    "%s: held-out pairwise accuracy %.3f over %d pairs, trained in %.0f s",
    NAME,
    rm.heldout_accuracy,
    rm.heldout_pairs,
    rm.seconds,
  )
  try:
    os.replace(tmp, path)
  except OSError:  # another process put a complete one there first
    shutil.rmtree(tmp, ignore_errors=True)
  return path


def builtin_dir(
  task: TaskSection, seed: int, settings: Settings | None = None, workdir: str | None = None
) -> str:
  """``model:tiny-rm``'s checkpoint for the run's ``task`` (its problems drawn with the run's
  ``seed``), trained into the run's ``workdir`` (else the cache) on first use (process 0 trains
  it, the others wait and read it); ``settings`` default ``SETTINGS``."""
  settings = settings or SETTINGS
  if task.name != arithmetic_task.NAME or task.environment:
    raise ConfigError(
      "reward.terms",
      f"model:{NAME} is trained on the arithmetic task without tools "
      f"(task.name = {task.name!r}, task.environment = {task.environment!r})",
    )
  tcfg = arithmetic_task.task_config(task, seed)
  root = pathlib.Path(workdir) if workdir else cache_root()
  path = root / f"{NAME}-{cache_key(tcfg, settings)}"
  path.parent.mkdir(parents=True, exist_ok=True)
  return str(distributed.main_first(lambda: train_into(path, tcfg, settings)))
