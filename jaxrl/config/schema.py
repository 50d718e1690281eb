"""The run's config: ``Config``, which only assembles the sections. Each section is defined, with its
own checks, beside the component it configures: ``jaxrl.nn.sections`` (model), ``jaxrl.rl.sections``
(optim, loss, modulation), ``jaxrl.methods.sections`` (allocation, temperature, clip, eepo,
anneal_phase), ``jaxrl.tasks.sections`` (task, data, reward, tool, sft), ``jaxrl.rollout.sections``
(rollout, vllm), ``jaxrl.parallel.sections`` (mesh), ``jaxrl.workdir.sections`` (checkpoint) and
``jaxrl.run.sections`` (eval, log, diagnostics); how a field is checked: ``jaxrl.fields``.

Config files (``configs/*.py``) stay Python and return a ConfigDict; ``jaxrl.config.validate``
turns it into these dataclasses at the boundary and validates it before anything is compiled. Every
problem raises ``ConfigError`` naming the dotted field; ``jaxrl.main`` prints that one line and
exits 2. Nothing here imports JAX: the section modules hold plain dataclasses.
"""

from __future__ import annotations

import dataclasses

from jaxrl.methods.sections import (
  AllocationSection,
  AnnealPhaseSection,
  ClipSection,
  EEPOSection,
  TemperatureSection,
)
from jaxrl.nn.sections import ModelSection
from jaxrl.parallel.sections import MeshSection
from jaxrl.rl.sections import LossSection, ModulationSection, OptimSection
from jaxrl.rollout.sections import RolloutSection, VllmSection
from jaxrl.run.sections import DiagnosticsSection, EvalSection, LogSection, resolve_ks
from jaxrl.tasks.sections import DataSection, RewardSection, SFTSection, TaskSection, ToolSection
from jaxrl.workdir.sections import CheckpointSection


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = 0
  steps: int = 200  # RL steps
  batch_questions: int = 16  # B: questions per RL step
  # Compiled programs kept across runs (jaxrl.workdir.compile_cache): "" = WORKDIR/compile_cache (or JAX's
  # own $JAX_COMPILATION_CACHE_DIR when set), "off", or a directory shared by several runs.
  compile_cache: str = ""
  model: ModelSection = ModelSection()
  task: TaskSection = TaskSection()
  data: DataSection = DataSection()
  reward: RewardSection = RewardSection()
  tool: ToolSection = ToolSection()
  sft: SFTSection = SFTSection()
  rollout: RolloutSection = RolloutSection()
  vllm: VllmSection = VllmSection()
  optim: OptimSection = OptimSection()
  loss: LossSection = LossSection()
  mesh: MeshSection = MeshSection()
  eval: EvalSection = EvalSection()
  log: LogSection = LogSection()
  checkpoint: CheckpointSection = CheckpointSection()
  allocation: AllocationSection = AllocationSection()
  temperature: TemperatureSection = TemperatureSection()
  clip: ClipSection = ClipSection()
  eepo: EEPOSection = EEPOSection()
  modulation: ModulationSection = ModulationSection()
  anneal_phase: AnnealPhaseSection = AnnealPhaseSection()
  diagnostics: DiagnosticsSection = DiagnosticsSection()

  @property
  def num_rollouts(self) -> int:
    """R: rollouts per step (static)."""
    return self.batch_questions * self.rollout.group_size

  @property
  def eval_ks(self) -> tuple[int, ...]:
    return resolve_ks(self.eval.ks, self.eval.num_samples)
