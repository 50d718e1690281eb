"""What the RL phase (``Trainer.rl``) opens around its steps: the checkpointer, the loop state to
start from (the newest readable checkpoint's, or step 0 from the warm start), the metrics writer
(process 0's; the others write none), the SIGINT / SIGTERM flag, the rollout thread of an
asynchronous run, and each step's lines in the log and the progress bar.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os

from jaxrl.parallel import distributed
from jaxrl.rl.programs import Programs
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sections import RolloutSection
from jaxrl.run.context import StepContext
from jaxrl.run.loop import initial_loop
from jaxrl.run.loop_state import LoopState, restore_loop
from jaxrl.run.sections import LogSection
from jaxrl.run.stops import StopFlag
from jaxrl.workdir.checkpoint import Checkpointer
from jaxrl.workdir.metric_writers import MetricsWriter
from jaxrl.workdir.sections import CheckpointSection

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_flag(engine: RolloutEngine):
  """SIGINT / SIGTERM handlers while the block runs. A stop restarts no sidecar: the signal may
  be the whole job's, which ends the server too."""
  stop = StopFlag(on_stop=engine.stop_restarts)
  try:
    yield stop
  finally:
    stop.restore()


def checkpointer(workdir: str, k: CheckpointSection, record: dict) -> Checkpointer:
  """The run's checkpoints, in ``WORKDIR/checkpoints``, each recording ``record``."""
  return Checkpointer(
    os.path.join(workdir, "checkpoints"),
    keep=k.keep,
    async_save=k.async_save,
    settle_timeout=k.settle_timeout,
    record=record,
  )


def start_state(
  ctx: StepContext, ckpt: Checkpointer, programs: Programs, mesh, sft_params
) -> tuple[int, LoopState]:
  """(first step, loop state): the latest checkpoint's, or step 0 from the warm start."""
  loop = initial_loop(ctx, programs.init_state(sft_params))
  log.info("methods: %s", ctx.runtime(0).methods.describe())
  start = 0
  if ckpt.all_steps():  # the newest that reads: a damaged one is logged and set aside
    like, shardings = loop, programs.state_shardings
    start, loop = ckpt.newest_readable(lambda s: restore_loop(ckpt, s, like, shardings, mesh))
    phase = ctx.phases[loop.phase].name
    log.info("resumed from step %d, %s phase (%s)", start, phase, ckpt.directory)
  return start, loop


def rollout_pool(
  rollout: RolloutSection, engine: RolloutEngine
) -> concurrent.futures.ThreadPoolExecutor | None:
  """The rollout thread of an asynchronous run whose engine can run beside the trainer."""
  if rollout.max_staleness < 1:
    return None
  if not engine.concurrent:
    log.info(
      "rollout.max_staleness=%d: batches are generated inline (the %s engine shares the "
      "trainer's devices or collectives), so generation does not overlap the update",
      rollout.max_staleness,
      rollout.engine,
    )
    return None
  return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")


def metrics_writer(workdir: str, c: LogSection, config: dict, start: int):
  """Process 0's ``MetricsWriter`` (``config``: the run's, as a dict), resumed at ``start``."""
  if not distributed.is_main():
    return NoWriter()
  return MetricsWriter(
    workdir,
    tensorboard=c.tensorboard,
    wandb_project=c.wandb_project if c.wandb else None,
    config=config,
    resume_step=start,
  )


def progress_line(row: dict) -> str:
  return f"reward {row['reward']:.3f} H {row['entropy_rollout']:.3f} τ {row['tau']:.2f}"


def step_line(row: dict) -> str:
  """log.txt's line per step."""
  return (
    f"{progress_line(row)}, loss {row['loss']:.4f}, {row['rollout_tok_s']:.0f} rollout tok/s, "
    f"{row['train_tok_s']:.0f} train tok/s, step {row['step_time']:.2f} s"
  )


class NoWriter:
  """Processes other than 0 write no metrics."""

  def write(self, step, row, samples=()):
    return row

  def close(self):
    pass
