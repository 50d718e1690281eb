"""A checkpoint evaluated and its results written: what ``jaxrl-eval`` does once its flags and
config are checked (``run/eval_cli.py`` has the command and what it means to a user).

The checkpoint is read (an HF directory, a run's newest checkpoint that reads, or one of its
``checkpoints/N``), then evaluated: on each benchmark file (the math task) through
``heldout.evaluate`` with the engine's sampler, or on a built-in task's held-out split through
``heldout.evaluate_task``, the trainer's own evaluation. ``run/heldout.py`` computes the numbers
(avg@n, pass@k, greedy, turns); this module reads, builds and writes ``eval_results.{json,md}``.
A run's checkpoints are only read: nothing in its ``checkpoints/`` is created, changed or removed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile

import numpy as np

from jaxrl import rng
from jaxrl.nn import arch, model
from jaxrl.parallel import sharding
from jaxrl.rollout.build import build_engine
from jaxrl.rollout.engine import eval_version
from jaxrl.rollout.sections import rollout_limits
from jaxrl.run import weights
from jaxrl.run.components import engine_sections, task_engine, task_sections
from jaxrl.run.heldout import engine_sampler, evaluate, evaluate_task
from jaxrl.run.sections import resolve_ks
from jaxrl.tasks import math_task
from jaxrl.tasks.data import datasets, hub, math_prompts
from jaxrl.tasks.envs.registry import build_environment
from jaxrl.tasks.envs.trajectory import response_texts
from jaxrl.tasks.task import load_task
from jaxrl.workdir import checkpoint as checkpoints
from jaxrl.workdir import compile_cache

log = logging.getLogger(__name__)

HELDOUT = "heldout"  # a built-in task's results: its held-out split


def evaluate_path(
  cfg, checkpoint: str, *, benchmarks: str = "", out: str = "", num_samples: int = 0, ks: str = ""
) -> tuple[str, dict]:
  """``jaxrl-eval`` of the checkpoint at ``checkpoint`` (an HF directory, a run or one of its
  ``checkpoints/N``) with a checked ``cfg``: (where the results went, the summary).
  ``checkpoint`` may be a Hub id (its local snapshot); ``out`` "" is the default directory;
  ``num_samples`` 0 and ``ks`` "" are the config's. Raises ``ValueError`` (a ``ConfigError``, a
  missing checkpoint), ``FileNotFoundError`` or ``UnreadableCheckpoint``."""
  chosen = benchmarks_of(cfg, benchmarks)
  n = num_samples or cfg.eval.num_samples
  k_values = resolve_ks(ks, n) if ks else ()
  checkpoint = hub.model_snapshot(checkpoint)  # a Hub id: its local snapshot
  if not os.path.exists(checkpoint):
    raise ValueError(f"--checkpoint {checkpoint!r} does not exist")
  run = weights.run_checkpoint(checkpoint)
  # A training run's directory already holds its compiled programs (the sampler among them):
  # they are reused when the results go into that directory too; with --out elsewhere the run's
  # directory is only read, and programs are cached beside the results.
  in_run = run is not None and not out
  cache = os.path.dirname(run[0]) if in_run else out or os.path.join(checkpoint, "eval")
  compile_cache.enable(cfg.compile_cache, cache)
  if run is None:
    out = out or os.path.join(checkpoint, "eval")
    return out, evaluate_checkpoint(cfg, checkpoint, chosen, out, num_samples=n, ks=k_values)
  return evaluate_run(cfg, *run, chosen, out, num_samples=n, ks=k_values)


def evaluate_run(cfg, directory: str, step: int, benchmarks, out: str, num_samples: int, ks):
  """(where the results went, the summary) of a run's checkpoint ``step`` or, for ``step`` -1
  (the run given as its directory), of its newest checkpoint that reads, as a resume takes it:
  one whose params do not read is logged in one line and the one before evaluated. A step asked
  for by name that does not read is an ``UnreadableCheckpoint``. Each step is fixed before it is
  read: a run in progress may write newer ones meanwhile. ``out`` "": ``weights.eval_dir``."""
  steps = [weights.checkpoint_step(directory, step)]
  if step < 0:
    reader = checkpoints.Checkpointer.reader(directory)
    steps = sorted((s for s in reader.all_steps() if s <= steps[0]), reverse=True)
    reader.close()
  causes = []
  for s in steps:
    where = out or weights.eval_dir(directory, s)
    try:
      path = os.path.join(directory, str(s))
      return where, evaluate_checkpoint(
        cfg, path, benchmarks, where, num_samples=num_samples, ks=ks
      )
    except checkpoints.UnreadableCheckpoint as e:
      causes += e.causes
      if step < 0:
        checkpoints.log_unreadable(directory, s, e.causes[0][1])
  raise checkpoints.UnreadableCheckpoint(directory, causes)


def parse_benchmarks(spec: str, default: str) -> list[tuple[str, str]]:
  """``"a=x.jsonl,y.parquet"`` → [("a", "x.jsonl"), ("y", "y.parquet")]."""
  out = []
  for part in filter(None, (p.strip() for p in (spec or default).split(","))):
    name, sep, path = part.partition("=")
    if not sep:
      name, path = os.path.splitext(os.path.basename(part.rstrip("/")))[0], part
    out.append((name.strip(), path.strip()))
  if not out:
    raise ValueError("no benchmark: pass --benchmarks=NAME=PATH,... or set data.heldout")
  return out


def markdown(results: dict, ks, num_samples: int) -> str:
  """One row per benchmark (percentages); with turn counts (multi-turn) their means per sample."""
  turns = any("turns" in r for r in results.values())
  cols = [f"avg@{num_samples}"] + [f"pass@{k}" for k in ks] + ["greedy"]
  cols += ["turns", "tool calls"] if turns else []
  lines = ["| benchmark | questions | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
  for name, r in results.items():
    values = (
      [r[f"avg@{num_samples}"]] + [r["pass_at"][str(k)]["all"] for k in ks] + [r["greedy"]["all"]]
    )
    cells = [f"{100 * v:.1f}" for v in values]
    if turns:
      counts = r.get("turns", {})
      cells += [f"{counts[c]['all']:.2f}" if c in counts else "" for c in ("turns", "tool_calls")]
    lines.append(f"| {name} | {sum(r['num_questions'].values())} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def evaluate_checkpoint(
  cfg,
  checkpoint: str,
  benchmarks: list[tuple[str, str]],
  out_dir: str,
  num_samples: int = 0,
  ks: tuple[int, ...] = (),
) -> dict:
  """Evaluate ``checkpoint`` on each benchmark (a built-in task: on its held-out split, and
  ``benchmarks`` is empty); write and return the results."""

  num_samples = num_samples or cfg.eval.num_samples
  ks = ks or resolve_ks(cfg.eval.ks, num_samples)  # "pow2" follows this evaluation's n
  if (
    weights.run_checkpoint(checkpoint) is None
  ):  # an HF directory: its own architecture and tokenizer
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=checkpoint))
  if cfg.task.name != "math":
    results = {HELDOUT: _evaluate_heldout(cfg, checkpoint, out_dir, num_samples, ks)}
    table = markdown(results, ks, num_samples)
    _write_results(cfg, checkpoint, out_dir, results, table, num_samples, ks)
    return {"results": results, "table": table}
  engine, tokenizer, params, environment = _engine_and_params(cfg, checkpoint, out_dir)
  scorer = math_task.MathScorer(cfg.reward)
  results = {}
  try:
    for name, path in benchmarks:
      row = _evaluate_benchmark(
        cfg, engine, params, tokenizer, scorer, name, path, num_samples, ks, environment
      )
      results[name] = row
      log.info("%s: %s", name, {k: v for k, v in row.items() if k.startswith("avg@")})
  finally:
    engine.close()
    scorer.close()
    if environment is not None:
      environment.close()
  table = markdown(results, ks, num_samples)
  _write_results(cfg, checkpoint, out_dir, results, table, num_samples, ks)
  return {"results": results, "table": table}


def benchmarks_of(cfg, spec: str) -> list[tuple[str, str]]:
  """``--benchmarks`` (default ``data.heldout``) for the math task; none for a built-in task,
  which is evaluated on its own held-out split."""
  if cfg.task.name == "math":
    return parse_benchmarks(spec, cfg.data.heldout)
  if spec:
    raise ValueError(
      f"--benchmarks: the {cfg.task.name} task is evaluated on its own held-out split "
      "(task.num_heldout_per_level per level); benchmark files are for the math task"
    )
  return []


def _evaluate_heldout(cfg, checkpoint: str, out_dir: str, num_samples: int, ks) -> dict:
  """A built-in task's held-out split, as the trainer evaluates it at a step: its task and
  engine built as ``Trainer.open`` builds them (the environment's multi-turn rollouts too) and
  ``heldout.evaluate_task``. The task's tokenizer is built aside (the run's directory is only
  read)."""

  ks = sorted({1, *ks})
  with tempfile.TemporaryDirectory(prefix="jaxrl-eval-tokenizer-") as tokenizer_dir:
    task = load_task(task_sections(cfg), tokenizer_dir)
    try:
      engine, params = _task_engine_and_params(cfg, checkpoint, task, out_dir)
      try:
        # The one set of params this engine ever holds: any evaluation version names it.
        result = evaluate_task(
          engine, params, task, cfg, version=eval_version(0), num_samples=num_samples, ks=ks
        )
      finally:
        engine.close()
    finally:
      task.close()
  row = result.to_json()
  row[f"avg@{num_samples}"] = result.pass_at[1]["all"]  # pass@1 of n samples = mean accuracy
  row["level_names"] = list(task.level_names)
  log.info("%s: %s", HELDOUT, {k: v for k, v in row.items() if k.startswith("avg@")})
  return row


def _task_engine_and_params(cfg, checkpoint: str, task, out_dir: str):
  """The rollout engine for the task (with its environment, if any) and the checkpoint's params
  on the mesh."""

  model_cfg = arch.model_config(cfg.model, task.vocab_size)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  graphdef, abstract_params = model.abstract(model_cfg)
  shardings = sharding.tree_shardings(abstract_params, mesh)
  params = weights.load_params(cfg, checkpoint, (abstract_params, shardings), model_cfg)
  engine = task_engine(cfg, graphdef, model_cfg, task, out_dir)
  return engine, params


def _engine_and_params(cfg, checkpoint: str, out_dir: str):
  """The rollout engine for the checkpoint's architecture, its tokenizer, its params on the mesh,
  and the task's environment (None: single-turn), which the engine's multi-turn rollouts ask."""

  model_cfg = arch.model_config(cfg.model)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  graphdef, abstract_params = model.abstract(model_cfg)
  shardings = sharding.tree_shardings(abstract_params, mesh)
  tokenizer = math_prompts.load_tokenizer(cfg.model.checkpoint)
  stops = math_prompts.stop_token_ids(cfg.model.checkpoint, tokenizer)
  params = weights.load_params(cfg, checkpoint, (abstract_params, shardings))
  environment = build_environment(
    tokenizer,
    task=cfg.task,
    data=cfg.data,
    tool=cfg.tool,
    rollout=rollout_limits(cfg.rollout, cfg.anneal_phase),
  )
  engine = build_engine(
    graphdef,
    model_cfg,
    **engine_sections(cfg),
    tokenizer=tokenizer,
    eos_id=stops,
    pad_id=tokenizer.pad_token_id,
    prompt_len=cfg.task.max_prompt_len,
    workdir=out_dir,
    environment=environment,
  )
  return engine, tokenizer, params, environment


def _evaluate_benchmark(
  cfg, engine, params, tokenizer, scorer, name, path, num_samples, ks, environment=None
) -> dict:
  """One benchmark file sampled by ``engine`` from ``params``: avg@n, pass@k and greedy accuracy,
  with what was dropped or cut."""

  stops = math_prompts.stop_token_ids(cfg.model.checkpoint, tokenizer)  # as the engine's EOS

  def decode(out):
    return response_texts(tokenizer, out, multi_turn=environment is not None, eos_id=stops)

  questions, report = datasets.load_questions(
    path, math_task.fields(cfg.data), split=cfg.data.split, strict=cfg.data.strict
  )
  enc = math_task.encode(cfg.data, cfg.task.max_prompt_len, tokenizer, questions.questions, name)
  answers = np.asarray(questions.answers, dtype=object)[enc.kept_Q]
  result = evaluate(
    # The one set of params this engine ever holds: any evaluation version names it.
    engine_sampler(engine, params, eval_version(0), decode, cfg.eval.temperature),
    enc.ids_QxP,
    enc.mask_QxP,
    np.zeros(len(enc.kept_Q), np.int32),
    lambda responses, q: scorer(responses, answers[q]).rewards_R,
    num_samples=num_samples,
    ks=sorted({1, *ks}),
    questions_per_call=max(1, cfg.num_rollouts // num_samples),
    key=rng.key(cfg.seed, rng.EVAL),
  )
  row = result.to_json()
  row[f"avg@{num_samples}"] = result.pass_at[1]["all"]  # pass@1 of n samples = mean accuracy
  row.update(path=path, dropped=enc.dropped, truncated=enc.truncated, rows=str(report))
  return row


def _write_results(cfg, checkpoint, out_dir, results, table, num_samples, ks) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "eval_results.json"), "w") as f:
    json.dump(
      {
        "checkpoint": checkpoint,
        "num_samples": num_samples,
        "ks": list(ks),
        "temperature": cfg.eval.temperature,
        "benchmarks": results,
      },
      f,
      indent=1,
    )
  with open(os.path.join(out_dir, "eval_results.md"), "w") as f:
    f.write(
      f"# {checkpoint}\n\nn = {num_samples} samples per question at τ = "
      f"{cfg.eval.temperature} (avg@n = mean accuracy), unbiased pass@k, greedy.\n\n{table}\n"
    )
