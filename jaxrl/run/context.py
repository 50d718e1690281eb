"""What every RL step reads and never changes: ``StepContext`` (the config, the task, the compiled
programs, the rollout source, every phase's ``PhaseRuntime``), built before step 0, and the
counter of the programs a step compiles."""

from __future__ import annotations

import concurrent.futures
import dataclasses

from jaxrl.config import Config, loss_config
from jaxrl.methods.controllers import Methods
from jaxrl.rl.programs import Programs
from jaxrl.rl.step import rl_update
from jaxrl.rollout import turn_programs
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.sampler import sample_program
from jaxrl.run import mfu
from jaxrl.run.compiles import CompileCounter
from jaxrl.run.components import phase_methods
from jaxrl.run.phases import Phase
from jaxrl.run.source import RolloutSource
from jaxrl.tasks.data.cursor import Mixture
from jaxrl.tasks.rewards.terms import RewardTerms
from jaxrl.tasks.task import TaskData


@dataclasses.dataclass(frozen=True)
class PhaseRuntime:
  """What a phase samples and compiles with: its controllers, its train step, its data mixture."""

  phase: Phase
  methods: Methods
  update: object  # the phase's jitted GRPO update (Programs.update)
  mixture: Mixture


# The programs whose compiles a step's row counts (``compiles_*``), held by reference: JAX names a
# trace after the function traced, so the count follows a rename (tests/test_compile_counts.py).
COUNTED_PROGRAMS = {"compiles_update": rl_update, "compiles_sampler": sample_program}
# A multi-turn run's sampler programs (``rollout/turn_programs.py``), counted besides (its rows only).
MULTITURN_PROGRAMS = {
  "compiles_prefill": turn_programs.prefill_program,
  "compiles_turn": turn_programs.turn_program,
  "compiles_observe": turn_programs.observe_program,
  "compiles_assemble": turn_programs.assemble_program,
}


def compile_counter(*, multiturn: bool = False, **more) -> CompileCounter:
  """A counter of the traces of ``COUNTED_PROGRAMS`` (and ``MULTITURN_PROGRAMS`` when
  ``multiturn``) and of ``more`` (metric → function)."""
  programs = {**COUNTED_PROGRAMS, **(MULTITURN_PROGRAMS if multiturn else {}), **more}
  return CompileCounter(**{metric: fn.__name__ for metric, fn in programs.items()})


@dataclasses.dataclass
class StepContext:
  """What the steps read and never change. Every phase's runtime (its controllers, its train
  step, its mixture), the rollout source and, when the device's peak is known, each phase's update
  FLOP count are built with the context, before step 0: no step builds or lowers a program."""

  cfg: Config
  task: TaskData
  programs: Programs
  collector: Collector
  phases: tuple[Phase, ...]
  vocab_size: int
  ref_params: object = None  # the KL reference (kl_coef > 0)
  compiles: CompileCounter = dataclasses.field(default_factory=CompileCounter)
  # The rollout thread (``rollout.max_staleness`` >= 1 with an engine that runs beside the
  # trainer's programs, a sidecar): batches generate there while the update runs.
  rollout_pool: concurrent.futures.ThreadPoolExecutor | None = None
  peak_flops: float | None = None  # per device (run/mfu.py): the step logs train_mfu when known
  reward_terms: RewardTerms | None = None  # reward.terms (docs/algorithms.md §13); None: verifier
  runtimes: tuple[PhaseRuntime, ...] = dataclasses.field(init=False)
  source: RolloutSource = dataclasses.field(init=False)
  _update_flops: tuple[float, ...] = dataclasses.field(init=False, default=())

  def __post_init__(self):
    self.runtimes = tuple(self._build_runtime(phase) for phase in self.phases)
    self.source = RolloutSource(self)
    if self.peak_flops is not None:  # XLA's count lowers each phase's update (scan unrolled)
      mesh = self.programs.mesh
      self._update_flops = tuple(
        mfu.update_flops(p.cfg, self.vocab_size, mesh) for p in self.phases
      )

  def _build_runtime(self, phase: Phase) -> PhaseRuntime:
    pc = phase.cfg
    mixture = self.task.mixture(phase.mixture, "anneal_phase.mixture", stream=phase.index)
    update = self.programs.update(loss_config(pc))
    return PhaseRuntime(phase, phase_methods(pc, self.vocab_size), update, mixture)

  def update_flops(self, index: int) -> float:
    """XLA's FLOPs of phase ``index``'s update (with ``peak_flops`` known)."""
    return self._update_flops[index]

  def runtime(self, index: int) -> PhaseRuntime:
    return self.runtimes[index]
