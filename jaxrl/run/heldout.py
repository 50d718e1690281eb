"""Held-out evaluation as the papers report it (docs/algorithms.md §8): pass@1 = mean accuracy of
n samples per question at τ (1.0 by default), unbiased pass@k from the same n samples, and greedy
accuracy; per level and overall. With an environment (docs/algorithms.md §11) also the mean model
turns and tool calls of the n samples.

``evaluate_task`` is the held-out evaluation of a task's own split that both the trainer and
``jaxrl-eval`` run: the same engine calls, keys and chunks, so the two agree.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from jaxrl import rng
from jaxrl.rl.passk import pass_at_k_array
from jaxrl.rollout.engine import SampleRequest


@dataclasses.dataclass(frozen=True)
class EvalResult:
  levels: tuple[int, ...]
  num_questions: dict  # level -> count
  pass_at: dict  # k -> {level -> value}, and {"all" -> value}
  greedy: dict  # level -> accuracy, and "all"
  # Multi-turn only: "turns" and "tool_calls" -> {level -> mean per sample, and "all"} over the n
  # samples per question, and "solved_with_call" -> the share of samples that are correct and
  # called the tool at least once (beside pass@1: how much of what is solved the tool solved);
  # {} for single-turn rollouts.
  turns: dict = dataclasses.field(default_factory=dict)
  # Per question: the correct samples of the ``num_samples`` drawn, level -> counts in held-out
  # order (what a bootstrap over questions resamples: bench/study_stats.py); {} in files written
  # before it was kept.
  correct: dict = dataclasses.field(default_factory=dict)
  num_samples: int = 0

  def to_json(self) -> dict:
    out = {
      "levels": list(self.levels),
      "num_questions": {str(k): v for k, v in self.num_questions.items()},
      "pass_at": {str(k): {str(l): v for l, v in d.items()} for k, d in self.pass_at.items()},
      "greedy": {str(l): v for l, v in self.greedy.items()},
    }
    if self.turns:
      out["turns"] = {name: {str(l): v for l, v in d.items()} for name, d in self.turns.items()}
    if self.correct:
      out["questions"] = {
        "num_samples": self.num_samples,
        "correct": {str(l): list(v) for l, v in self.correct.items()},
      }
    return out

  @staticmethod
  def from_json(d: dict) -> "EvalResult":
    def lv(x):
      return x if x == "all" else int(x)

    questions = d.get("questions", {})
    return EvalResult(
      levels=tuple(d["levels"]),
      num_questions={int(k): v for k, v in d["num_questions"].items()},
      pass_at={int(k): {lv(l): v for l, v in m.items()} for k, m in d["pass_at"].items()},
      greedy={lv(l): v for l, v in d["greedy"].items()},
      turns={name: {lv(l): v for l, v in m.items()} for name, m in d.get("turns", {}).items()},
      correct={int(l): tuple(v) for l, v in questions.get("correct", {}).items()},
      num_samples=questions.get("num_samples", 0),
    )


def _per_level(values_Q: np.ndarray, levels_Q: np.ndarray, levels: Sequence[int]) -> dict:
  out = {lvl: float(values_Q[levels_Q == lvl].mean()) for lvl in levels}
  out["all"] = float(values_Q.mean())
  return out


class Sampled(NamedTuple):
  """What a ``sample_fn`` returns for one chunk of questions."""

  responses: list  # str per row
  group_ids_R: np.ndarray  # the row's question in the chunk
  # Multi-turn: i32[R] model turns and tool calls (``Rollouts.turns_R``, ``tool_calls_R``); None:
  # single-turn
  turns_R: np.ndarray | None = None
  tool_calls_R: np.ndarray | None = None


def engine_sampler(
  engine,
  params,
  version: int,
  decode: Callable,
  temperature: float,
  on_call: Callable | None = None,
):
  """The ``sample_fn`` of ``evaluate`` over a rollout engine sampling from ``params`` (weight
  version ``version``: ``engine.eval_version``): responses decoded to text, and a multi-turn
  engine's turn counts of the call. Every call names its params, as ``Collector.sample`` does."""

  def sample_fn(ids, mask, counts, key, greedy) -> Sampled:
    out = engine.generate(
      params, version, SampleRequest(ids, mask, counts, key, temperature, greedy=greedy)
    )
    if greedy and on_call is not None:  # one greedy call per chunk of questions
      on_call()
    turns_R, tool_calls_R = out.turns_R, out.tool_calls_R
    return Sampled(
      decode(out),
      np.asarray(out.group_ids_R),
      None if turns_R is None else np.asarray(turns_R),
      None if tool_calls_R is None else np.asarray(tool_calls_R),
    )

  return sample_fn


def questions_per_call(cfg, num_samples: int) -> int:
  """Questions per engine call: as many whole groups of ``num_samples`` as a step's R rows hold
  (the engine's compiled shapes)."""
  return max(1, cfg.num_rollouts // num_samples)


def evaluate_task(
  engine,
  params,
  task,
  cfg,
  *,
  version: int,
  num_samples: int = 0,
  ks: Sequence[int] = (),
  on_call: Callable | None = None,
) -> EvalResult:
  """``params`` on ``task``'s held-out split (a ``TaskData``), sampled by ``engine`` (built with
  the task's environment, if any: multi-turn rollouts) at ``eval.temperature`` with the run's
  evaluation key: ``num_samples`` (0: ``eval.num_samples``) per question, pass@k for ``ks``
  (default ``eval.ks``)."""
  num_samples = num_samples or cfg.eval.num_samples
  return evaluate(
    engine_sampler(engine, params, version, task.decode, cfg.eval.temperature, on_call),
    task.heldout_prompt_ids,
    task.heldout_prompt_mask,
    task.heldout_levels,
    lambda responses, q: task.score(responses, task.heldout_answers[q]),
    num_samples=num_samples,
    ks=ks or cfg.eval_ks,
    questions_per_call=questions_per_call(cfg, num_samples),
    key=rng.key(cfg.seed, rng.EVAL),
  )


def evaluate(
  sample_fn: Callable,
  prompt_ids_QxP: np.ndarray,
  prompt_mask_QxP: np.ndarray,
  levels_Q: np.ndarray,
  score_fn: Callable,
  *,
  num_samples: int,
  ks: Sequence[int],
  questions_per_call: int,
  key,
) -> EvalResult:
  """Sample ``num_samples`` answers per question (and one greedy answer) and score them.

  ``sample_fn(ids_BxP, mask_BxP, counts_B, key, greedy) -> Sampled`` runs the engine on a
  fixed-size chunk of questions; ``score_fn(responses, question_indices) -> rewards``. The last
  chunk is padded by repeating its first question so every call has the same shapes; the padding's
  samples count nowhere. Turn counts (multi-turn) are the n samples' means per question.
  """
  num_q = len(levels_Q)
  correct_Q = np.zeros(num_q, np.int64)
  greedy_Q = np.zeros(num_q, np.float64)
  turns_3xQ = np.zeros((len(_TURN_METRICS), num_q), np.float64)
  multi_turn = False
  for start in range(0, num_q, questions_per_call):
    idx = np.arange(start, min(start + questions_per_call, num_q))
    padded = np.concatenate([idx, np.full(questions_per_call - len(idx), idx[0])])
    ids, mask = prompt_ids_QxP[padded], prompt_mask_QxP[padded]
    key, k_sample, k_greedy = jax.random.split(key, 3)
    counts = np.full(questions_per_call, num_samples, np.int32)
    out = Sampled(*sample_fn(ids, mask, counts, k_sample, False))
    rewards = score_fn(out.responses, padded[np.asarray(out.group_ids_R)])
    correct, turns = _chunk_tallies(out, rewards, questions_per_call, num_samples)
    correct_Q[idx] = correct[: len(idx)]
    if turns is not None:
      multi_turn = True
      turns_3xQ[:, idx] = turns[:, : len(idx)]
    out = Sampled(*sample_fn(ids, mask, np.ones(questions_per_call, np.int32), k_greedy, True))
    rewards = score_fn(out.responses, padded[np.asarray(out.group_ids_R)])
    greedy_Q[idx] = rewards[: len(idx)] > 0
  turns_3xQ = turns_3xQ if multi_turn else None
  return _result(levels_Q, correct_Q, greedy_Q, turns_3xQ, num_samples=num_samples, ks=ks)


# A multi-turn evaluation's per-question means over its samples (``EvalResult.turns``).
_TURN_METRICS = ("turns", "tool_calls", "solved_with_call")


def _chunk_tallies(out: Sampled, rewards_R, questions: int, num_samples: int):
  """One chunk's correct samples per question; multi-turn also each question's mean turns, tool
  calls and samples solved with a call (``_TURN_METRICS``, [3, questions]; None single-turn)."""
  group_ids_R = np.asarray(out.group_ids_R)

  def per_question(weights_R):
    return np.bincount(group_ids_R, weights=weights_R, minlength=questions)

  correct = per_question(rewards_R > 0).astype(np.int64)
  if out.turns_R is None:
    return correct, None
  with_call_R = (rewards_R > 0) & (np.asarray(out.tool_calls_R) > 0)
  per_row = (out.turns_R, out.tool_calls_R, with_call_R)
  return correct, np.stack([per_question(x) / num_samples for x in per_row])


def _result(levels_Q, correct_Q, greedy_Q, turns_3xQ, *, num_samples: int, ks) -> EvalResult:
  """The per-level ``EvalResult`` of the per-question tallies (``turns_3xQ`` None: single-turn)."""
  levels = tuple(sorted(set(int(l) for l in levels_Q)))
  attempts_Q = np.full(len(levels_Q), num_samples)
  pass_at = {k: _per_level(pass_at_k_array(attempts_Q, correct_Q, k), levels_Q, levels) for k in ks}
  turns = {}
  if turns_3xQ is not None:
    turns = {name: _per_level(v_Q, levels_Q, levels) for name, v_Q in zip(_TURN_METRICS, turns_3xQ)}
  return EvalResult(
    levels=levels,
    num_questions={lvl: int((levels_Q == lvl).sum()) for lvl in levels},
    pass_at=pass_at,
    greedy=_per_level(greedy_Q, levels_Q, levels),
    turns=turns,
    correct={lvl: tuple(int(c) for c in correct_Q[levels_Q == lvl]) for lvl in levels},
    num_samples=num_samples,
  )


def comparison_table(
  before: EvalResult, after: EvalResult, ks: Sequence[int], level_names: Sequence[str] | None = None
) -> str:
  """Markdown table of held-out pass@k and greedy accuracy per level, before → after."""
  head = ["level", "n"]
  cols = []
  for k in ks:
    cols += [f"pass@{k} SFT", f"pass@{k} RL", "Δ"]
  cols += ["greedy SFT", "greedy RL", "Δ"]
  lines = ["| " + " | ".join(head + cols) + " |", "|" + "---|" * (len(head) + len(cols))]
  for lvl in list(before.levels) + ["all"]:
    n = sum(before.num_questions.values()) if lvl == "all" else before.num_questions[lvl]
    row = [level_names[lvl] if level_names is not None and lvl != "all" else str(lvl), str(n)]
    for k in ks:
      b, a = before.pass_at[k][lvl], after.pass_at[k][lvl]
      row += [f"{100 * b:.1f}", f"{100 * a:.1f}", f"{100 * (a - b):+.1f}"]
    b, a = before.greedy[lvl], after.greedy[lvl]
    row += [f"{100 * b:.1f}", f"{100 * a:.1f}", f"{100 * (a - b):+.1f}"]
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)
