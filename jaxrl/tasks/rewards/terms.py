"""The run's reward terms (``reward.terms``, docs/algorithms.md §13): each scores a batch of
answers, NaN where it gave None, and ``combine_terms`` makes them one reward.

The verifier's values are the task's ``VerifyResult`` (its failures set the answer aside). A
callable term (``fn:MODULE:NAME``) is TRL's reward function: it runs in the trainer's process on
the whole batch (a batch API call, a model of its own), called as ``fn(prompts=..., completions=...,
answer=...)``, awaited when it is a coroutine, and must return one finite number or None per
answer: anything else is an error naming it. The call runs on a thread of its own and has
``reward.fn_time_limit`` seconds: past it the batch's values of that term are None, counted in
``reward_term_<label>_failed``, and the call is abandoned (a thread cannot be stopped); while it
still runs, later batches fail that term at once rather than pile up calls. A model term
(``model:PATH``) re-tokenises prompt and response with the checkpoint's tokenizer and scores them
with ``jaxrl.nn.reward_model`` on the trainer's mesh; ``model:tiny-rm`` is the one
``jaxrl.tasks.rewards.train_rm`` trains for the run's arithmetic task. A judge term (``judge:URL``,
``judge:sidecar``) asks a generative model for a score (``jaxrl.tasks.rewards.judge``); answers
without a verdict are None, counted the same way.

With several processes (``jax.distributed``) every process decodes every rollout and calls
``RewardTerms.score`` on the whole batch; process 0's values are everyone's. The verifier runs on
every process (each under its own clock, so a time limit can pass on one and not another). A
model term runs on every process together: its forward pass is one program over the global mesh,
its scores gathered to each. A callable term and a judge term run on process 0 alone (an API call
or a judge request is sent once, and a callable that draws random numbers or reads a clock cannot
split the processes); the others hold NaN in their place. ``score`` then broadcasts process 0's
values of every term, whether the verifier scored each answer, and the terms' failure and
truncation counts (one ``distributed.from_main``), and each process combines them: the rewards,
the rows set aside and the term metrics are the same on every process, bit for bit. A callable
runs on process 0 only, so it must not start a JAX computation that spans processes.

A step's term metrics are counters that add over dynamic sampling's rounds (``_sum``, ``_n``,
``_rows``); ``term_means`` turns them into each term's mean and the share it applies to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import math
import numbers
import threading

import numpy as np

from jaxrl.fields import ConfigError
from jaxrl.nn import hf_safetensors, reward_model
from jaxrl.parallel import distributed, sharding
from jaxrl.tasks.data import hub
from jaxrl.tasks.rewards.combine import combine_terms
from jaxrl.tasks.rewards.judge import Endpoint, JudgeSettings, JudgeTerm, shown
from jaxrl.tasks.rewards.pool import RewardFnError, VerifyResult
from jaxrl.tasks.rewards.train_rm import NAME as TINY_RM
from jaxrl.tasks.rewards.train_rm import builtin_dir
from jaxrl.tasks.sections import RewardSection, TaskSection, TaskSections
from jaxrl.tasks.term_specs import SIDECAR, TermSpec, parse_terms
from jaxrl.tasks.worker_process import load_function

log = logging.getLogger(__name__)

PREFIX = "reward_term_"
_COUNTERS = ("_sum", "_n", "_rows")


class CallableTerm:
  """A TRL-style reward function ``(prompts, completions, **columns) -> list[float | None]``.
  ``active`` False (processes other than the first of a multi-process run, which take process
  0's values) calls nothing: its values are NaN."""

  def __init__(self, spec: str, time_limit: float | None = None, active: bool = True):
    self.spec, self.time_limit, self.active = spec, time_limit, active
    self.fn = load_function(spec, "reward term", RewardFnError)
    self.failed = 0  # answers of the last batch without values (the call overran)
    self.overrun: threading.Thread | None = None  # an abandoned call, maybe still running

  def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> np.ndarray:
    what, n = f"reward term {self.spec!r}", len(completions)
    if not self.active:
      self.failed = 0
      return np.full(n, np.nan, np.float32)
    if self.overrun is not None and self.overrun.is_alive():
      return self._fail(n, "its call of an earlier batch, past its limit, is still running")
    got, done = {}, threading.Event()

    def call():
      try:
        out = self.fn(prompts=prompts, completions=completions, answer=answers)
        got["out"] = asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out
      except BaseException as e:  # noqa: BLE001 — re-raised on the trainer's thread
        got["error"] = e
      finally:
        done.set()

    thread = threading.Thread(target=call, name=f"jaxrl-term-{self.spec}", daemon=True)
    thread.start()
    if not done.wait(self.time_limit):  # None: no limit
      self.overrun = thread
      return self._fail(n, f"no result within reward.fn_time_limit = {self.time_limit:g} s")
    self.failed = 0
    if "error" in got:
      raise got["error"]
    return as_values(got["out"], n, what)

  def _fail(self, n: int, why: str) -> np.ndarray:
    """The batch's values all None, counted and logged."""
    self.failed = n
    log.warning("reward term %r: %s; its %d values are None (counted)", self.spec, why, n)
    return np.full(n, np.nan, np.float32)


async def _awaited(awaitable):
  return await awaitable


def as_values(out, count: int, what: str) -> np.ndarray:
  """f32[count] of a term's returned list, NaN for None; ValueError naming ``what`` otherwise."""
  if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
    raise ValueError(f"{what} returned {type(out).__name__}, not a list of {count} rewards")
  if len(out) != count:
    raise ValueError(f"{what} returned {len(out)} rewards for {count} answers")
  values = np.empty(count, np.float32)
  for i, v in enumerate(out):
    if v is None:
      values[i] = math.nan
    elif isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v)):
      values[i] = float(v)
    else:
      raise ValueError(f"{what}: answer {i} got {v!r}, not a finite number or None")
  return values


def rows_per_forward(rows: int, mesh) -> int:
  """``reward.model_rows`` rounded up to a multiple of the mesh's data-parallel split: each shard
  scores whole rows."""
  if mesh is None:
    return rows
  split = mesh.size // sharding.batch_sharding(mesh).shard_shape((mesh.size,))[0]
  return -(-rows // split) * split


def model_dir(source: str, files=hub.MODEL_FILES) -> str:
  """A model term's checkpoint directory: a local path as is, a Hub id ``ORG/NAME[@REVISION]``
  its cached snapshot of ``files`` (process 0 downloads first; offline and not cached: a
  ``HubError``)."""
  return hub.model_snapshot(source, files)


def term_model_dir(
  source: str,
  files=hub.MODEL_FILES,
  *,
  task: TaskSection,
  seed: int,
  workdir: str | None = None,
) -> str:
  """A ``model:`` term's checkpoint directory: ``model:tiny-rm`` the reward model trained for the
  run's arithmetic task (``task``, the run's ``seed``; ``train_rm.builtin_dir``: in the cache,
  trained there on first use), any other source its ``model_dir``."""
  if source == TINY_RM:
    return builtin_dir(task, seed, workdir=workdir)
  return model_dir(source, files)


class ModelTerm:
  """A sequence-classification reward model on the trainer's mesh, fed by its own tokenizer."""

  def __init__(self, source: str, mesh, dtype: str, max_tokens: int, rows: int):
    import transformers  # only a run with a reward model needs it

    path = model_dir(source)
    self.model = reward_model.load_reward_model(path, dtype, mesh)
    self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    self.mesh, self.max_tokens = mesh, max_tokens
    self.rows = rows_per_forward(rows, mesh)
    self.truncated = 0  # inputs cut to max_tokens by the last call

  def token_ids(self, prompt: str, completion: str) -> list[int]:
    """The model's input: through its chat template (user, assistant) when it has one."""
    tok = self.tokenizer
    if getattr(tok, "chat_template", None):
      chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
      text = tok.apply_chat_template(chat, tokenize=False)
      return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(prompt + completion)["input_ids"])

  def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> np.ndarray:
    ids = [self.token_ids(p, c) for p, c in zip(prompts, completions)]
    self.truncated = sum(len(x) > self.max_tokens for x in ids)
    ids = [x[-self.max_tokens :] for x in ids]  # the score is read at the end: keep the end
    scores = [self._scores(ids[lo : lo + self.rows]) for lo in range(0, len(ids), self.rows)]
    return np.concatenate(scores).astype(np.float32) if scores else np.zeros(0, np.float32)

  def _scores(self, ids: list[list[int]]) -> np.ndarray:
    """Scores of up to ``rows`` inputs: padded to ``rows`` rows (copies of the first) and to a
    power-of-two length (a few compiled shapes, not one per step)."""
    longest = max(max(len(x) for x in ids), 1)
    t = min(max(16, 1 << (longest - 1).bit_length()), self.max_tokens)
    pad = self.model.pad_id if self.model.pad_id is not None else 0
    rows = [*ids, *[ids[0]] * (self.rows - len(ids))]
    tokens_RxT = np.full((self.rows, t), pad, np.int32)
    mask_RxT = np.zeros((self.rows, t), bool)
    for r, x in enumerate(rows):
      tokens_RxT[r, : len(x)], mask_RxT[r, : len(x)] = x, True
    if self.mesh is None:
      return np.asarray(self.model.scores(tokens_RxT, mask_RxT))[: len(ids)]
    tokens_RxT, mask_RxT = sharding.shard_batch((tokens_RxT, mask_RxT), self.mesh)
    # rows may span processes: every process gathers them (a collective, as every process scores)
    return np.asarray(distributed.to_host(self.model.scores(tokens_RxT, mask_RxT)))[: len(ids)]


@dataclasses.dataclass(frozen=True)
class TermsResult:
  rewards_R: np.ndarray  # f32[R]: the combined reward (0 where not kept)
  kept_R: np.ndarray  # bool[R]: some term applies and the verifier, if a term, scored it
  metrics: dict  # per term: the counters ``term_means`` reads


class RewardTerms:
  """The run's terms, in ``reward.terms`` order, and the rule that combines them."""

  def __init__(self, specs: tuple[TermSpec, ...], scorers: dict, rule: str):
    self.specs, self.scorers, self.rule = specs, scorers, rule

  @property
  def uses_verifier(self) -> bool:
    return any(s.kind == "verifier" for s in self.specs)

  def score(
    self,
    prompts: list[str],
    completions: list[str],
    answers: list[str],
    verified: VerifyResult | None,
    group_ids_R,
    num_groups: int,
  ) -> TermsResult:
    """The terms' values on the batch, combined; ``verified``: the verifier's, when a term. With
    several processes: process 0's values, the same on every process (the module says how)."""
    values, scored_R = [], np.ones(len(completions), bool)
    counts_K = np.zeros(len(self.specs), np.float32)  # per term: failed (fn, judge), truncated
    for k, spec in enumerate(self.specs):
      if spec.kind == "verifier":
        scored_R = np.asarray(verified.scored, bool)
        v_R = np.where(scored_R, np.asarray(verified.rewards_R, np.float32), np.nan)
      else:
        v_R = self.scorers[k](prompts, completions, answers)
        counts_K[k] = self.scorers[k].truncated if spec.kind == "model" else self.scorers[k].failed
      values.append(np.asarray(v_R, np.float32))
    values_KxR = np.stack(values).reshape(len(self.specs), len(completions))
    values_KxR, scored_R, counts_K = distributed.from_main(
      (values_KxR, scored_R.astype(np.int32), counts_K)
    )
    metrics = {}
    for spec, v_R, count in zip(self.specs, values_KxR, counts_K):
      applies_R = ~np.isnan(v_R)
      metrics.update(
        {
          f"{PREFIX}{spec.label}_sum": float(np.where(applies_R, v_R, 0.0).sum()),
          f"{PREFIX}{spec.label}_n": float(applies_R.sum()),
          f"{PREFIX}{spec.label}_rows": float(len(v_R)),
        }
      )
      if spec.kind == "model":
        metrics["reward_model_truncated"] = float(count)
      if spec.kind in ("fn", "judge"):  # answers the term could not score: None, counted
        metrics[f"{PREFIX}{spec.label}_failed"] = float(count)
    weights = [s.weight for s in self.specs]
    rewards_R, applies_R = combine_terms(
      values_KxR, weights, np.asarray(group_ids_R), num_groups, self.rule
    )
    kept_R = scored_R.astype(bool) & applies_R
    return TermsResult(np.where(kept_R, rewards_R, 0.0).astype(np.float32), kept_R, metrics)

  def close(self) -> None:
    """Stop what the terms started (a judge's threads, its server); each even if one fails."""
    with contextlib.ExitStack() as closing:
      for scorer in self.scorers.values():
        if hasattr(scorer, "close"):
          closing.callback(scorer.close)


def term_means(counters: dict) -> dict:
  """The counters with each term's ``_sum``, ``_n`` and ``_rows`` replaced by its mean over the
  answers it applies to (``reward_term_<label>``, NaN when none) and that share
  (``reward_term_<label>_applies``)."""
  out = {k: v for k, v in counters.items() if not (k.startswith(PREFIX) and k.endswith(_COUNTERS))}
  for key in counters:
    if key.startswith(PREFIX) and key.endswith("_sum"):
      name = key.removesuffix("_sum")
      n, rows = counters[name + "_n"], counters[name + "_rows"]
      out[name] = counters[key] / n if n else math.nan
      out[name + "_applies"] = n / rows if rows else math.nan
  return out


def _term_error(spec: TermSpec, e: Exception) -> ConfigError:
  source = shown(spec.source) if spec.kind == "judge" else spec.source
  return ConfigError("reward.terms", f"term {spec.kind}:{source}: {e}")


def _check_judge(reward: RewardSection, spec: TermSpec) -> None:
  """The judge's template and key (and for the sidecar its checkpoint), without a request."""
  JudgeSettings.from_config(reward)
  if spec.source == SIDECAR:
    if not reward.judge_model:
      raise ConfigError("reward.judge_model", "judge:sidecar serves this checkpoint: set it")
    try:
      hf_safetensors.check_tensor_files(model_dir(reward.judge_model))
    except (OSError, ValueError) as e:
      raise ConfigError("reward.judge_model", str(e)) from None


def _judge_term(reward: RewardSection, spec: TermSpec, endpoint: Endpoint | None) -> JudgeTerm:
  """The judge at ``spec``'s URL, or at ``endpoint`` (the server the run started for
  ``judge:sidecar``); on processes other than the first, one that sends nothing."""
  settings = JudgeSettings.from_config(reward)
  if not distributed.is_main():
    return JudgeTerm(Endpoint(spec.source), settings, active=False)
  if spec.source != SIDECAR:
    return JudgeTerm(Endpoint(spec.source, reward.judge_model), settings)
  if endpoint is None:
    raise ValueError("judge:sidecar has no server: the trainer starts it (jaxrl.run.judge_server)")
  return JudgeTerm(endpoint, settings)


def check_terms(s: TaskSections) -> None:
  """Read what the terms name without building them (a callable imports, a reward model's
  config.json and tensor headers): a ConfigError naming reward.terms when one is unusable. The
  terms read the reward section, the model's compute dtype and, for tiny-rm, the task and seed."""
  for spec in parse_terms(s.reward.terms):
    try:
      if spec.kind == "fn":
        load_function(spec.source, "reward term", RewardFnError)
      elif spec.kind == "model":
        path = term_model_dir(spec.source, task=s.task, seed=s.seed)
        reward_model.reward_model_config(path, s.model.dtype)
        hf_safetensors.check_tensor_files(path)
      elif spec.kind == "judge":
        _check_judge(s.reward, spec)
    except ConfigError:
      raise
    except (OSError, ValueError) as e:
      raise _term_error(spec, e) from None


def _scorer(s: TaskSections, spec: TermSpec, mesh, judge: Endpoint | None, workdir: str | None):
  """The scorer of a term other than the verifier; a ConfigError naming reward.terms if unusable."""
  r = s.reward
  try:
    if spec.kind == "fn":
      return CallableTerm(spec.source, r.fn_time_limit, active=distributed.is_main())
    if spec.kind == "model":
      path = term_model_dir(spec.source, task=s.task, seed=s.seed, workdir=workdir)
      return ModelTerm(path, mesh, s.model.dtype, r.model_max_tokens, r.model_rows)
    return _judge_term(r, spec, judge)
  except ConfigError:
    raise
  except (OSError, ValueError) as e:
    raise _term_error(spec, e) from None


def build_terms(
  s: TaskSections, mesh=None, judge: Endpoint | None = None, workdir: str | None = None
) -> RewardTerms | None:
  """The terms of ``reward.terms`` (a reward model loaded onto ``mesh`` in the policy's compute
  dtype; a judge at its URL, or at ``judge``, the server the run started for ``judge:sidecar``;
  ``model:tiny-rm`` trained into the run's ``workdir``);
  None when unset: the verifier alone, as the loop computes it without terms. A term that fails
  to build stops those built before it."""
  specs = parse_terms(s.reward.terms)
  if not specs:
    return None
  labels = [s.label for s in specs]
  if len(set(labels)) != len(labels):
    raise ValueError(f"reward.terms: two terms share a metrics label ({labels})")
  terms = RewardTerms(specs, {}, s.reward.combine)
  try:
    for k, spec in enumerate(specs):
      if spec.kind != "verifier":
        terms.scorers[k] = _scorer(s, spec, mesh, judge, workdir)
  except BaseException:
    terms.close()
    raise
  return terms
