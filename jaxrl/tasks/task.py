"""The task as arrays: tokenised prompts and answers of both splits, the SFT corpus, and the
host-side decode + score used by the loop and by evaluation.

Three tasks fill it: the built-in arithmetic task (its own tokenizer, exact-match rewards in
process), the built-in countdown task (``jaxrl.tasks.countdown_task``: reach a target with given
numbers, an expression checked in process) and the math task (``jaxrl.tasks.math_task``: a
checkpoint's tokenizer, datasets, math-verify in a pool).
With ``task.environment`` set, it also holds the run's environment (``jaxrl.tasks.envs``); the
arithmetic task with the calculator is its tools form (``jaxrl.tasks.tools_task``: the tools
vocabulary, an SFT corpus of calls whose environment tokens are not learned, the final answer
scored).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl import rng
from jaxrl.config import Config, ConfigError, parse_mixture
from jaxrl.tasks import countdown_task, tools_task
from jaxrl.tasks.data import arithmetic, tool_calls
from jaxrl.tasks.data import tokenizer as vocab
from jaxrl.tasks.data.cursor import Mixture
from jaxrl.tasks.data.prompts import decode_responses, encode_completions, encode_prompts
from jaxrl.tasks.envs import calculator
from jaxrl.tasks.envs.registry import build_environment
from jaxrl.tasks.envs.trajectory import compact
from jaxrl.tasks.rewards.arithmetic import FinalAnswerScorer, score_batch
from jaxrl.tasks.rewards.pool import VerifyResult


@dataclasses.dataclass
class TaskData:
  tokenizer: object
  vocab_size: int
  pad_id: int
  eos_id: int
  level_names: tuple[str, ...]
  train_prompt_ids: np.ndarray  # i32[Q, P], left-padded
  train_prompt_mask: np.ndarray  # bool[Q, P]
  train_answers: np.ndarray  # object[Q] of str
  train_levels: np.ndarray  # i32[Q]
  heldout_prompt_ids: np.ndarray
  heldout_prompt_mask: np.ndarray
  heldout_answers: np.ndarray
  heldout_levels: np.ndarray
  sft_prompt_ids: np.ndarray  # i32[M, P]
  sft_prompt_mask: np.ndarray
  sft_target_ids: np.ndarray  # i32[M, N]: answer + EOS, right-padded
  sft_target_mask: np.ndarray  # bool[M, N]: the completion's tokens (read by the model)
  # (responses, answers) -> VerifyResult; None = the arithmetic task's exact match, in process
  scorer: object = None
  base_mixture: Mixture | None = None  # the training mixture ("" spec); None = all questions
  # bool[M, N]: the completion's tokens that are learned (the model's, not an environment's);
  # None = every target token
  sft_loss_mask: np.ndarray | None = None
  environment: object = None  # the run's Environment (tasks.envs); None = single-turn

  @property
  def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
    """Token id sequences that end a model turn besides EOS (the environment's); () without."""
    return () if self.environment is None else tuple(self.environment.stop_sequences)

  def decode(self, out) -> list[str]:
    """Response texts of a ``SampleOutput`` (cut at EOS); a multi-turn response's turns and
    observations without the gaps between them (the verifier reads its final answer)."""
    tokens_RxN = np.asarray(out.tokens_RxN)
    if self.environment is not None:
      tokens_RxN = compact(tokens_RxN, out.mask_RxN)
    return decode_responses(self.tokenizer, tokens_RxN, np.asarray(out.lengths_R))

  def verify(self, responses, answers) -> VerifyResult:
    """Rewards with the verifier's failure counts (timeouts, errors, ...) for the metrics."""
    if self.scorer is None:
      return VerifyResult(score_batch(responses, list(answers)), 0, 0, 0, 0)
    return self.scorer(responses, answers)

  def score(self, responses, answers) -> np.ndarray:
    return self.verify(responses, answers).rewards_R

  def close(self) -> None:
    if self.scorer is not None:
      self.scorer.close()
    if self.environment is not None:
      self.environment.close()

  def level_index(self, name: str) -> int | None:
    """Index of a level given by its name ("2+1") or its config spec ("2x1+")."""
    if name in self.level_names:
      return self.level_names.index(name)
    try:
      (spec,) = arithmetic.parse_levels(name)
    except ValueError:
      return None
    return self.level_names.index(spec.name) if spec.name in self.level_names else None

  def mixture(self, spec: str, field: str, stream: int = 0) -> Mixture:
    """Training questions as a weighted mixture of levels (``"4x4+:1,5x5+:2"``); "" = all of them."""
    parts = parse_mixture(spec, field)
    if not parts:
      whole = self.base_mixture or Mixture.whole(len(self.train_answers))
      return dataclasses.replace(whole, stream=stream)
    pools = []
    for name, _ in parts:
      level = self.level_index(name)
      if level is None:
        raise ConfigError(field, f"unknown level {name!r} (levels: {', '.join(self.level_names)})")
      pools.append(np.flatnonzero(self.train_levels == level).astype(np.int32))
    return Mixture(tuple(pools), tuple(w for _, w in parts), stream)


def task_config(cfg: Config) -> arithmetic.TaskConfig:
  levels = arithmetic.parse_levels(cfg.task.levels)
  try:
    sft_weights = arithmetic.sft_weights(levels, cfg.task.sft_levels)
  except ValueError as e:
    raise ConfigError("task.sft_levels", str(e)) from None
  return arithmetic.TaskConfig(
    levels=levels,
    sft_level_weights=sft_weights,
    num_train_per_level=cfg.task.num_train_per_level,
    num_heldout_per_level=cfg.task.num_heldout_per_level,
    seed=cfg.seed,
    reverse_answer=cfg.task.reverse_answer,
    digit_width=cfg.task.digit_width,
  )


def tokenizer_variant(cfg: Config) -> str:
  """The built-in tasks' tokenizer variant (``jaxrl.tasks.data.tokenizer.VARIANTS``)."""
  if cfg.task.name == countdown_task.NAME:
    return countdown_task.TOKENIZER
  return "tools" if cfg.task.environment == calculator.NAME else ""


def prompt_len(cfg: Config) -> int:
  """P of a built-in task: task.max_prompt_len, or its longest prompt + BOS (prompts are padded
  to the task's longest so that no step computes on dead columns)."""
  if cfg.task.name == countdown_task.NAME:
    return countdown_task.prompt_len(cfg)
  tcfg = task_config(cfg)
  return cfg.task.max_prompt_len or arithmetic.max_lengths(tcfg.levels, tcfg.digit_width)[0] + 1


def _split(tok, problems, p: int) -> tuple:
  """One split's TaskData fields: prompt ids and mask, answers, levels."""
  ids, mask = encode_prompts(tok, [q.prompt for q in problems], p)
  return (
    ids,
    mask,
    np.asarray([q.answer for q in problems], dtype=object),
    np.asarray([q.level for q in problems], np.int32),
  )


def _sft_fields(tok, pairs: list[tuple[str, str]], p: int, n: int) -> dict:
  """The SFT fields of (prompt, completion) pairs: every completion token is learned."""
  sft_ids, sft_mask = encode_prompts(tok, [a for a, _ in pairs], p)
  tgt_ids, tgt_mask = encode_completions(tok, [b for _, b in pairs], n)
  return dict(
    sft_prompt_ids=sft_ids,
    sft_prompt_mask=sft_mask,
    sft_target_ids=tgt_ids,
    sft_target_mask=tgt_mask,
  )


def load_task(cfg: Config, tokenizer_dir: str) -> TaskData:
  if cfg.task.name == "math":
    from jaxrl.tasks import math_task

    fields = math_task.load(cfg)
    return TaskData(**fields, environment=build_environment(cfg, fields["tokenizer"]))
  tok = vocab.build_tokenizer(tokenizer_dir, tokenizer_variant(cfg))
  p, n = prompt_len(cfg), cfg.rollout.max_new_tokens
  # Fresh examples for every SFT step (drawing is cheap): the warm start never repeats an example.
  num_sft, sft_seed = max(cfg.sft.steps, 1) * cfg.sft.batch_size, rng.numpy_seed(cfg.seed, rng.SFT)
  if cfg.task.name == countdown_task.NAME:
    countdown_task.check(cfg)
    train, heldout = countdown_task.problems(cfg)
    return TaskData(
      tok,
      len(tok),
      tok.pad_token_id,
      tok.eos_token_id,
      tuple(s.name for s in countdown_task.task_config(cfg).levels),
      *_split(tok, train, p),
      *_split(tok, heldout, p),
      **_sft_fields(tok, countdown_task.sft_pairs(cfg, num_sft, sft_seed), p, n),
      scorer=countdown_task.scorer(),
    )
  tools = cfg.task.environment == calculator.NAME
  if tools:
    tools_task.check(cfg)
  tcfg = task_config(cfg)
  environment = build_environment(cfg, tok)
  train, heldout = arithmetic.build_task(tcfg)
  if tools:
    examples = tool_calls.sft_examples(tcfg, num_sft, sft_seed)
    sft = tools_task.sft_arrays(tok, environment, examples, p, n)
    scorer = FinalAnswerScorer(calculator.RESULT_CLOSE)
  else:
    sft = _sft_fields(tok, arithmetic.sft_corpus(tcfg, num_sft, seed=sft_seed), p, n)
    scorer = None
  return TaskData(
    tok,
    len(tok),
    tok.pad_token_id,
    tok.eos_token_id,
    tuple(s.name for s in tcfg.levels),
    *_split(tok, train, p),
    *_split(tok, heldout, p),
    **sft,
    scorer=scorer,
    environment=environment,
  )
