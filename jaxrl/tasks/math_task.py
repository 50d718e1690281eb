"""The math task as arrays: a pretrained checkpoint's tokenizer, math datasets as prompts, and
math-verify rewards from a bounded worker pool.

Questions come from ``data.train`` (a weighted mixture of local datasets) and ``data.heldout``;
each is rendered with the checkpoint's chat template and the configured instruction, tokenised and
left-padded to ``task.max_prompt_len`` (over-long prompts dropped or truncated, and counted).
Levels are the datasets' ``data.level_field`` values, or the dataset names when there is none.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from jaxrl.fields import ConfigError
from jaxrl.nn.sections import ModelSection
from jaxrl.tasks.data import datasets, math_prompts
from jaxrl.tasks.data.cursor import Mixture
from jaxrl.tasks.envs.registry import build_environment
from jaxrl.tasks.rewards.math import MATH_REWARD, WARM_UP, answer_window
from jaxrl.tasks.rewards.pool import VerifierPool
from jaxrl.tasks.sections import DataSection, RewardSection, TaskSections

log = logging.getLogger(__name__)


def fields(d: DataSection) -> datasets.Fields:
  return datasets.Fields(
    question=d.question_field, answer=d.answer_field, id=d.id_field, level=d.level_field
  )


def level_labels(questions: datasets.Questions) -> list[str]:
  """Each question's level: its level field, else the name of the dataset it came from."""
  return [
    level or os.path.splitext(os.path.basename(source.rstrip("/")))[0]
    for level, source in zip(questions.levels, questions.sources)
  ]


def encode(
  d: DataSection, max_prompt_len: int, tokenizer, questions: list[str], what: str
) -> math_prompts.EncodedPrompts:
  """The questions as prompts of ``max_prompt_len`` (task.max_prompt_len) tokens."""
  enc = math_prompts.encode_math_prompts(
    tokenizer,
    questions,
    max_prompt_len,
    overlength=d.overlength,
    template=d.template,
    system_prompt=d.system_prompt,
    chat_template=d.chat_template,
  )
  if enc.truncated or enc.dropped:
    log.warning(
      "%s: %d of %d prompts longer than task.max_prompt_len=%d (%s: %d truncated, %d dropped)",
      what,
      enc.truncated + enc.dropped,
      len(questions),
      max_prompt_len,
      d.overlength,
      enc.truncated,
      enc.dropped,
    )
  if len(enc.kept_Q) == 0:
    raise ConfigError(
      "task.max_prompt_len", f"{what}: every prompt is longer than {max_prompt_len} tokens"
    )
  return enc


def keep_pools(mixture: Mixture, kept_Q: np.ndarray, num_questions: int) -> Mixture:
  """The mixture over the kept questions only (indices renumbered; weights kept)."""
  new_index = np.full(num_questions, -1, np.int64)
  new_index[kept_Q] = np.arange(len(kept_Q))
  pools = []
  for pool in mixture.pools:
    renumbered = new_index[pool]
    pools.append(renumbered[renumbered >= 0].astype(np.int32))
  if any(len(p) == 0 for p in pools):
    raise ConfigError(
      "data.train", "a dataset of the mixture has no prompt that fits task.max_prompt_len"
    )
  return Mixture(tuple(pools), mixture.weights, mixture.stream)


class MathScorer:
  """Rewards of decoded responses against gold answers, from the worker pool (``reward.*``)."""

  def __init__(self, r: RewardSection):
    spec = r.fn or MATH_REWARD
    if spec == MATH_REWARD:
      # Only the answer window is parsed (cuts counted), and math-verify warms up before ready.
      hooks = dict(prepare=answer_window, warm_up=WARM_UP)
    else:  # a custom ``module:function`` gets the whole response
      hooks = {}
    self.pool = VerifierPool(
      spec,
      **hooks,
      num_workers=r.workers or None,
      time_limit_s=r.time_limit,
      memory_limit_mb=r.memory_limit_mb,
    )

  def __call__(self, responses, answers):
    result = self.pool.score(list(responses), [str(a) for a in answers])
    if result.first_error:
      log.warning(
        "reward: %d errors, %d timeouts; first error: %s",
        result.errors,
        result.timeouts,
        result.first_error,
      )
    return result

  def close(self):
    self.pool.close()


def _inputs(model: ModelSection, d: DataSection):
  """(tokenizer, stop ids, training questions, their mixture, held-out questions), each read from
  outside the run; a ConfigError naming the field of one that is unusable."""
  try:
    tokenizer = math_prompts.load_tokenizer(model.checkpoint)
    stops = math_prompts.stop_token_ids(model.checkpoint, tokenizer)
  except ValueError as e:  # a TokenizerError, or no EOS token anywhere
    raise ConfigError("model.checkpoint", str(e)) from None
  train, mixture, _ = datasets.load_mixture(
    d.train, fields(d), split=d.split, strict=d.strict, field="data.train"
  )
  if not d.heldout:  # no validation set: evaluate on (up to max_heldout of) the training questions
    return tokenizer, stops, train, mixture, train
  try:
    heldout, _ = datasets.load_questions(
      d.heldout, fields(d), split=d.split, strict=d.strict, limit=d.max_heldout
    )
  except (ValueError, FileNotFoundError) as e:  # an empty file, no usable row, a bad row
    raise ConfigError("data.heldout", str(e)) from None
  return tokenizer, stops, train, mixture, heldout


def check_inputs(s: TaskSections) -> None:
  """Read what ``load`` reads from outside the run (``task.check_inputs``; the model and data
  sections): the command calls it before the run's directory is written, at the cost of reading
  the datasets twice."""
  _inputs(s.model, s.data)


def load(s: TaskSections, tokenizer_dir: str) -> dict:
  """The fields of a ``TaskData`` for the math task (``jaxrl.tasks.task.load_task`` builds it);
  reads the model, data, task, reward, rollout and tool sections. The tokenizer is the
  checkpoint's (``tokenizer_dir`` is for the built-in tasks)."""
  d = s.data
  tokenizer, stops, train, mixture, heldout = _inputs(s.model, d)
  p = s.task.max_prompt_len
  train_enc = encode(d, p, tokenizer, train.questions, "data.train")
  mixture = keep_pools(mixture, train_enc.kept_Q, len(train.questions))
  held_enc = encode(d, p, tokenizer, heldout.questions, "data.heldout")
  held_kept = held_enc.kept_Q[: d.max_heldout] if d.max_heldout else held_enc.kept_Q
  train_labels = np.asarray(level_labels(train), dtype=object)[train_enc.kept_Q]
  held_labels = np.asarray(level_labels(heldout), dtype=object)[held_kept]
  names = tuple(sorted(set(train_labels) | set(held_labels)))
  index = {name: i for i, name in enumerate(names)}
  empty_ids = np.zeros((0, s.task.max_prompt_len), np.int32)
  empty_tgt = np.zeros((0, s.rollout.max_new_tokens), np.int32)
  log.info(
    "math task: %d training questions (%s), %d held-out, P=%d, stop ids %s",
    len(train_enc.kept_Q),
    ", ".join(f"{len(p)}×{w:g}" for p, w in zip(mixture.pools, mixture.weights)),
    len(held_kept),
    s.task.max_prompt_len,
    stops,
  )
  pad = tokenizer.pad_token_id
  return dict(
    tokenizer=tokenizer,
    vocab_size=len(tokenizer),
    pad_id=pad,
    eos_id=stops,
    level_names=names,
    train_prompt_ids=train_enc.ids_QxP,
    train_prompt_mask=train_enc.mask_QxP,
    train_answers=np.asarray(train.answers, dtype=object)[train_enc.kept_Q],
    train_questions=np.asarray(train.questions, dtype=object)[train_enc.kept_Q],
    train_levels=np.asarray([index[n] for n in train_labels], np.int32),
    heldout_prompt_ids=held_enc.ids_QxP[np.searchsorted(held_enc.kept_Q, held_kept)],
    heldout_prompt_mask=held_enc.mask_QxP[np.searchsorted(held_enc.kept_Q, held_kept)],
    heldout_answers=np.asarray(heldout.answers, dtype=object)[held_kept],
    heldout_levels=np.asarray([index[n] for n in held_labels], np.int32),
    sft_prompt_ids=empty_ids,
    sft_prompt_mask=empty_ids.astype(bool),
    sft_target_ids=empty_tgt,
    sft_target_mask=empty_tgt.astype(bool),
    scorer=MathScorer(s.reward),
    base_mixture=mixture,
    environment=build_environment(
      tokenizer, task=s.task, data=s.data, tool=s.tool, rollout=s.rollout
    ),
  )
