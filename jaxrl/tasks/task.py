"""The task as arrays: tokenised prompts and answers of both splits, the SFT corpus, and the
host-side decode + score used by the loop and by evaluation.

A module per task fills it (``TASKS``): the built-in arithmetic task
(``jaxrl.tasks.arithmetic_task``: its own tokenizer, exact-match rewards in process; with the
calculator, its tools form), the built-in countdown task (``jaxrl.tasks.countdown_task``: reach a
target with given numbers, an expression checked in process) and the math task
(``jaxrl.tasks.math_task``: a checkpoint's tokenizer, datasets, math-verify in a pool). With
``task.environment`` set, it also holds the run's environment (``jaxrl.tasks.envs``).
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np

from jaxrl.fields import ConfigError
from jaxrl.tasks.data import arithmetic
from jaxrl.tasks.data.cursor import Mixture
from jaxrl.tasks.envs.trajectory import response_texts
from jaxrl.tasks.mixture import parse_mixture
from jaxrl.tasks.rewards.arithmetic import score_batch
from jaxrl.tasks.rewards.pool import VerifyResult
from jaxrl.tasks.rewards.terms import check_terms
from jaxrl.tasks.sections import TaskSection, TaskSections


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
  # object[Q] of str: each training question as written (what reward terms read as the prompt);
  # None = the prompts decoded
  train_questions: np.ndarray | None = None

  @property
  def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
    """Token id sequences that end a model turn besides EOS (the environment's); () without."""
    return () if self.environment is None else tuple(self.environment.stop_sequences)

  def decode(self, out) -> list[str]:
    """Response texts of ``Rollouts`` (``trajectory.response_texts``: cut at the model's EOS; a
    multi-turn response's turns and observations without the gaps between them)."""
    return response_texts(
      self.tokenizer, out, multi_turn=self.environment is not None, eos_id=self.eos_id
    )

  def prompt_texts(self, qids) -> list[str]:
    """The training questions ``qids`` as text, for reward terms."""
    if self.train_questions is not None:
      return [str(q) for q in self.train_questions[np.asarray(qids)]]
    ids, mask = self.train_prompt_ids[np.asarray(qids)], self.train_prompt_mask[np.asarray(qids)]
    return [self.tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(ids, mask)]

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


# task.name -> the module that builds it: ``load(sections, tokenizer_dir)`` gives the ``TaskData``
# fields (``TaskSections``: a task reads what it needs of the task, data, model, sft, rollout,
# reward and tool sections and the seed); a built-in task (its vocabulary built in code) also gives
# ``tokenizer_variant(task)`` and ``prompt_len(task)`` of the task section. Imported on use: the
# math task pulls math-verify and datasets.
TASKS = {
  "arithmetic": "jaxrl.tasks.arithmetic_task",
  "countdown": "jaxrl.tasks.countdown_task",
  "math": "jaxrl.tasks.math_task",
}
BUILTIN_TASKS = ("arithmetic", "countdown")


def task_module(task: TaskSection):
  name = task.name
  if name not in TASKS:
    raise ConfigError("task.name", f"{name!r} is not one of {tuple(TASKS)}")
  return importlib.import_module(TASKS[name])


def _builtin(task: TaskSection):
  if task.name not in BUILTIN_TASKS:
    raise ValueError(f"task {task.name!r} has no vocabulary built in code")
  return task_module(task)


def tokenizer_variant(task: TaskSection) -> str:
  """A built-in task's tokenizer variant (``jaxrl.tasks.data.tokenizer.VARIANTS``)."""
  return _builtin(task).tokenizer_variant(task)


def prompt_len(task: TaskSection) -> int:
  """P of a built-in task: task.max_prompt_len, or its longest prompt + BOS (prompts are padded
  to the task's longest so that no step computes on dead columns)."""
  return _builtin(task).prompt_len(task)


def load_task(s: TaskSections, tokenizer_dir: str) -> TaskData:
  """The task ``task.name`` names; a built-in one writes its tokenizer to ``tokenizer_dir``."""
  return TaskData(**task_module(s.task).load(s, tokenizer_dir))


def check_inputs(s: TaskSections) -> None:
  """Read the run's inputs from outside it (the math task: the checkpoint's tokenizer, the
  datasets; what reward.terms names) without building anything: a ConfigError naming the field
  when one is unusable. The command calls it before it writes the run's directory."""
  module = task_module(s.task)
  if hasattr(module, "check_inputs"):
    module.check_inputs(s)
  check_terms(s)
