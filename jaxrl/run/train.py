"""The trainer: setup, the SFT warm start, held-out evaluations, the RL loop around ``rl_step``,
checkpoints, metrics and stops. The only stateful code of a run; every file it writes lives in
``workdir``.

``Trainer.open`` builds a run's parts (``with Trainer.open(cfg, workdir) as trainer:``); a part that
fails to build stops those built before it (the verifier's worker processes, the rollout engine),
and ``config.json`` is written only once all are built. The ``Trainer`` dataclass itself only holds
them. Before RL: the SFT warm start and a held-out evaluation; after RL: the same evaluation and a
before/after table (and, from a checkpoint, the trained policy in HF layout).

A run in a workdir that holds checkpoints resumes from the latest, after checking that its config
is the one that checkpoint records (``run_config``: a changed field a resume may not change is a
``ConfigError`` naming it, before anything in the workdir is written). The SFT warm start and the
held-out evaluations are cached in the workdir with the config they were computed from; a cache of
another config is computed again.

What the RL phase opens around its steps (the checkpointer, the state it starts from, the metrics
writer, the stop flag) is ``run/rl_phase.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import jax
import jax.numpy as jnp

from jaxrl.config import Config, to_dict
from jaxrl.methods import registry
from jaxrl.nn import arch, model
from jaxrl.parallel import distributed, sharding
from jaxrl.rl.programs import Programs, reference_copy
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.engine import RolloutEngine, eval_version
from jaxrl.run import eval_cache, judge_server, mfu, recovery, rl_phase, run_config, sft, weights
from jaxrl.run.compiles import CompileCounter
from jaxrl.run.components import task_engine, task_sections
from jaxrl.run.context import StepContext, compile_counter
from jaxrl.run.heldout import EvalResult, comparison_table, evaluate_task, questions_per_call
from jaxrl.run.loop import rl_step
from jaxrl.run.loop_state import save_loop
from jaxrl.run.phases import run_phases
from jaxrl.run.progress import Progress
from jaxrl.run.stops import (
  NonFiniteGuard,
  StopFlag,
  check_saved,
  sigterm_as_interrupt,
  stop_after_checkpoint,
)
from jaxrl.tasks.rewards.terms import RewardTerms
from jaxrl.tasks.task import TaskData, load_task
from jaxrl.workdir import lock
from jaxrl.workdir.metric_writers import plot_run
from jaxrl.workdir.profiling import StepProfiler

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RLResult:
  """The RL loop's outcome: the final policy's params and the question statistics."""

  params: object
  stats: object


@dataclasses.dataclass(frozen=True)
class RunResult:
  """A whole run: held-out results before and after RL, their table, and the final RL state."""

  before: EvalResult
  after: EvalResult
  table: str
  rl: RLResult


def _collector(cfg: Config, engine: RolloutEngine, programs: Programs, task) -> Collector:
  """The run's rollout collector: its engine, the scoring programs, packed as the update packs."""
  pack_buckets = cfg.loss.pack_buckets if cfg.loss.packing else 0
  return Collector(
    engine, programs, cfg.loss.logprob_chunk, cfg.loss.micro_batches, task.environment, pack_buckets
  )


@dataclasses.dataclass
class Trainer:
  """What setup built, and the phases of a run over it; ``run`` drives SFT → eval → RL → eval.

  ``Trainer.open(cfg, workdir)`` builds it: the only step that writes the workdir or starts
  anything (the verifier's worker processes, a vLLM client's request threads; a launched server
  starts at the first weight push). ``close`` (or the end of a ``with`` block, or of ``run``)
  stops what it and ``step_context`` started, and may be called again.
  """

  cfg: Config
  workdir: str
  record: dict  # the resolved config every checkpoint records (``run_config.record``)
  task: TaskData
  model_cfg: model.ModelConfig
  mesh: jax.sharding.Mesh
  graphdef: object
  programs: Programs
  engine: RolloutEngine
  collector: Collector
  progress: Progress
  compiles: CompileCounter  # traces of the train step and the JAX sampler (evals included)
  reward_terms: RewardTerms | None = None  # reward.terms; None: the task's verifier alone
  _rollout_pools: list = dataclasses.field(default_factory=list, init=False, repr=False)
  _lock: str | None = dataclasses.field(default=None, init=False, repr=False)  # ``lock.hold``'s
  _stop: StopFlag | None = dataclasses.field(default=None, init=False, repr=False)  # ``run``'s

  @classmethod
  def open(cls, cfg: Config, workdir: str) -> Trainer:
    """Check ``cfg`` against the workdir's checkpoints, then build the task (its tokenizer cache,
    its verifier's workers), the mesh, the programs and the rollout engine, in that order. A step
    that fails closes what the steps before it started, and re-raises; ``config.json`` is written
    last, whole, once everything is built: a failed start leaves the last start's."""
    registry.check(allocation=cfg.allocation, temperature=cfg.temperature, clip=cfg.clip)
    os.makedirs(workdir, exist_ok=True)
    with contextlib.ExitStack() as started:
      # One trainer per run directory (``lock.WorkdirBusy`` otherwise), held until ``close``.
      held = lock.hold(workdir) if distributed.is_main() else None
      started.callback(lock.release, held)
      # The resolved config (Hub ids as commits), recorded in every checkpoint; a resume must
      # match its latest checkpoint's before anything in the workdir is written.
      record = run_config.record(cfg)
      run_config.check_resume(record, os.path.join(workdir, "checkpoints"))
      # Process 0 builds the tokenizer cache in the shared workdir; the others then read it.
      task = distributed.main_first(
        lambda: load_task(task_sections(cfg), os.path.join(workdir, "tokenizer"))
      )
      started.callback(task.close)
      for phase in run_phases(cfg):  # a bad mixture fails here, before anything compiles
        task.mixture(phase.mixture, "anneal_phase.mixture")
      model_cfg = arch.model_config(cfg.model, task.vocab_size)
      mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
      graphdef, abstract_params = model.abstract(model_cfg)
      programs = Programs.for_run(cfg.optim, graphdef, abstract_params, mesh)
      # a reward model loads onto the trainer's mesh; judge:sidecar starts the judge's server
      terms = judge_server.open_terms(cfg, mesh, workdir)
      if terms is not None:
        started.callback(terms.close)
      engine = task_engine(cfg, graphdef, model_cfg, task, workdir)
      started.callback(engine.close)
      collector = _collector(cfg, engine, programs, task)
      compiles = compile_counter(
        multiturn=task.environment is not None
      ).start()  # counted from here
      started.callback(compiles.stop)
      if distributed.is_main():
        eval_cache.write_json(os.path.join(workdir, "config.json"), to_dict(cfg))
      started.pop_all()
    trainer = cls(
      cfg,
      workdir,
      record,
      task,
      model_cfg,
      mesh,
      graphdef,
      programs,
      engine,
      collector,
      Progress(enabled=cfg.log.progress),
      compiles,
      terms,
    )
    trainer._lock = held
    return trainer

  def close(self) -> None:
    """Stop what ``open`` and ``step_context`` started: the rollout threads, the compile counter,
    the rollout engine (a sidecar server), the reward terms (a judge's threads and server), the
    verifier's workers; each even if one before it fails. Idempotent."""
    held, self._lock = self._lock, None
    with contextlib.ExitStack() as closing:
      closing.callback(lock.release, held)  # last: the run directory is free once all is stopped
      closing.callback(self.task.close)
      if self.reward_terms is not None:  # a judge's threads and server
        closing.callback(self.reward_terms.close)
      closing.callback(self.engine.close)
      closing.callback(self.compiles.stop)
      for pool in self._rollout_pools:  # a batch in flight is abandoned
        closing.callback(pool.shutdown, wait=False, cancel_futures=True)

  def __enter__(self) -> Trainer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @property
  def param_shardings(self):
    return self.programs.param_shardings

  # -- phases -------------------------------------------------------------------------------------

  def init_params(self):
    """The checkpoint's weights streamed onto their shardings, or a seeded random init."""
    return weights.initial_params(self.cfg, self.model_cfg, self.param_shardings)

  def warm_start(self, params):
    c, t = self.cfg, self.task
    if c.sft.steps == 0:
      return params
    with self.progress.task("SFT warm start", c.sft.steps) as advance:
      params, _ = sft.warm_start(
        self.graphdef,
        params,
        self.mesh,
        prompt_ids_QxP=t.sft_prompt_ids,
        prompt_mask_QxP=t.sft_prompt_mask,
        target_ids_QxT=t.sft_target_ids,
        target_mask_QxT=t.sft_target_mask,
        loss_mask_QxT=t.sft_loss_mask,
        steps=c.sft.steps,
        batch_size=c.sft.batch_size,
        learning_rate=c.sft.learning_rate,
        warmup_steps=c.sft.warmup_steps,
        weight_decay=c.sft.weight_decay,
        chunk=c.loss.logprob_chunk,
        workdir=self.workdir,
        target_loss=c.sft.target_loss,
        progress=advance,
        key=run_config.sft_key(self.record),
        stop=self._stop,
      )
    return params

  def evaluate(self, params, name: str, *, step: int) -> EvalResult:
    """Held-out evaluation of ``params`` after ``step`` RL updates, cached as ``eval_{name}.json``
    with what it depends on (``run_config.eval_key``: the evaluation's fields, those of the SFT
    warm start for "sft", else of the RL run, and the params' own fingerprint): a resumed run does
    not redo it, a run of another config, or of other params under the same name, does."""
    path = os.path.join(self.workdir, f"eval_{name}.json")
    key = run_config.eval_key(
      self.record, after_rl=name != "sft", params=eval_cache.params_fingerprint(params)
    )
    cached = eval_cache.cached_eval(path, key)
    if cached is not None:
      return cached
    c, t = self.cfg, self.task
    # A phase's first line (tests/test_kill_resume.py waits for it to kill during evaluation).
    log.info("evaluating %s (%d held-out questions)", name, len(t.heldout_levels))
    calls = -(-len(t.heldout_levels) // questions_per_call(c, c.eval.num_samples))

    with self.progress.task(f"eval ({name})", calls) as advance:
      done = [0]

      def on_call():
        done[0] += 1
        advance(done[0], calls)
        if self._stop is not None:  # a stop ends the evaluation; the next run does it again
          self._stop.check(f"evaluation {name} stopped: run the same command again", step)

      # jaxrl-eval runs the same evaluation of a checkpoint (run/heldout.py: evaluate_task).
      result = evaluate_task(self.engine, params, t, c, version=eval_version(step), on_call=on_call)
    if distributed.is_main():
      eval_cache.write_json(path, {**result.to_json(), eval_cache.EVAL_KEY: key}, indent=None)
    return result

  def rl(self, sft_params) -> RLResult:
    """GRPO steps from the warm start; resumes from the latest checkpoint in ``workdir``."""
    c = self.cfg
    ctx = self.step_context(sft_params)  # its rollout thread ends here, or with the trainer
    with contextlib.ExitStack() as opened:  # closed however the loop ends, in reverse order
      ckpt = opened.enter_context(
        contextlib.closing(rl_phase.checkpointer(self.workdir, c.checkpoint, self.record))
      )
      start, loop = rl_phase.start_state(ctx, ckpt, self.programs, self.mesh, sft_params)
      writer = opened.enter_context(
        contextlib.closing(rl_phase.metrics_writer(self.workdir, c.log, to_dict(c), start))
      )
      stop = self._stop or opened.enter_context(rl_phase.stop_flag(self.engine))
      if ctx.rollout_pool is not None:  # on an error, a batch in flight is abandoned
        opened.callback(ctx.rollout_pool.shutdown, wait=False, cancel_futures=True)
      nonfinite = NonFiniteGuard(c.optim.max_nonfinite_steps)
      profiler = opened.enter_context(
        contextlib.closing(StepProfiler(self.workdir, c.log.profile_from, c.log.profile_steps))
      )
      with self.progress.task("GRPO", c.steps, start) as advance:
        for i in range(start, c.steps):
          profiler.before_step(i + 1)
          try:
            loop, row = rl_step(ctx, loop, i)
          except Exception:
            recovery.after_failed_step(ckpt, start, i, loop, stop, self.mesh)
            raise
          profiler.after_step(i + 1)
          nonfinite.check(row, i + 1)
          if c.eval.every and (i + 1) % c.eval.every == 0 and i + 1 < c.steps:
            ctx.source.settle(loop)  # a failed batch is generated again when due
            try:
              row.update(self._validate(loop.train.params, i + 1))
            except Exception:
              recovery.save_trained(ckpt, i + 1, loop, self.mesh)  # the step trained: keep it
              raise
          writer.write(i + 1, row, row.pop("samples", ()))
          log.info("step %d/%d: %s", i + 1, c.steps, rl_phase.step_line(row))
          advance(i + 1, c.steps, rl_phase.progress_line(row))
          if (i + 1) % c.checkpoint.every == 0 or i + 1 == c.steps or stop.requested:
            # A stop does not wait for batches in flight: they are recorded, generated on resume.
            save_loop(ckpt, i + 1, loop, self.mesh, wait=not stop.requested)
          if stop.requested:
            stop_after_checkpoint(ckpt, i + 1, stop.signal_name)
    check_saved(ckpt, c.steps)
    return RLResult(loop.train.params, loop.stats)

  def step_context(self, sft_params) -> StepContext:
    """What the RL steps read: the task, the programs, the rollout collector, the KL reference."""
    c = self.cfg
    pool = rl_phase.rollout_pool(c.rollout, self.engine)
    if pool is not None:
      self._rollout_pools.append(pool)  # ``close`` ends it if its user does not
    return StepContext(
      cfg=c,
      task=self.task,
      programs=self.programs,
      collector=self.collector,
      phases=run_phases(c),
      vocab_size=self.model_cfg.vocab_size,
      ref_params=jax.tree.map(jnp.copy, sft_params) if reference_copy(c.loss, c.model) else None,
      compiles=self.compiles,
      rollout_pool=pool,
      peak_flops=mfu.peak_flops(c.log.peak_tflops, jax.devices()[0].device_kind),
      reward_terms=self.reward_terms,
    )

  def export_hf(self, params) -> str:
    """The trained policy as an HF checkpoint in ``WORKDIR/hf`` (model.dtype)."""
    out = os.path.join(self.workdir, "hf")
    return weights.write_hf(self.cfg, self.model_cfg, params, out, self.task.tokenizer)

  def _validate(self, params, step_number: int) -> dict:
    """The periodic held-out evaluation (``eval.every``), as ``val/…`` metrics of the step."""
    result = self.evaluate(params, f"step{step_number}", step=step_number)
    row = {f"val/pass@{k}": v["all"] for k, v in result.pass_at.items()}
    row["val/greedy"] = result.greedy["all"]
    log.info(
      "step %d held-out: %s", step_number, ", ".join(f"{k} {100 * v:.1f}" for k, v in row.items())
    )
    return row

  # -- whole run ----------------------------------------------------------------------------------

  def run(self) -> RunResult:
    """SFT → eval → RL → eval; the trainer closes (the rollout engine, a sidecar server, the
    verifier's workers stop) however this ends."""
    try:
      # SIGINT / SIGTERM anywhere in the run end it at the phase's next stopping point, with what
      # it did saved (the SFT warm start's progress, RL's step checkpoint): ``stops.Stopped``.
      with rl_phase.stop_flag(self.engine) as self._stop:
        params = self.warm_start(self.init_params())
        before = self.evaluate(params, "sft", step=0)
        result = self.rl(params)
        after = self.evaluate(result.params, f"step{self.cfg.steps}", step=self.cfg.steps)
        if self.cfg.model.checkpoint:
          self._stop.check("the export stopped: run the same command again", self.cfg.steps)
          self.export_hf(result.params)
    finally:
      self._stop = None
      self.close()
    table = comparison_table(before, after, self.cfg.eval_ks, self.task.level_names)
    if distributed.is_main():
      self._write_results(table)
    return RunResult(before, after, table, result)

  def _write_results(self, table: str) -> None:
    with open(os.path.join(self.workdir, "results.md"), "w") as f:
      f.write(
        f"# Held-out evaluation (seed {self.cfg.seed}, {self.cfg.steps} RL steps)\n\n{table}\n"
      )
    if self.cfg.log.plot and os.path.exists(os.path.join(self.workdir, "metrics.jsonl")):
      plot_run(os.path.join(self.workdir, "metrics.jsonl"), os.path.join(self.workdir, "run.png"))


def train(cfg: Config, workdir: str) -> RunResult:
  with sigterm_as_interrupt(), Trainer.open(cfg, workdir) as trainer:
    return trainer.run()
