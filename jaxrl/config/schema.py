"""The run's config: ``Config``, which only assembles the sections, each defined with its own checks
in the module of what it configures (``model_sections``, ``task_sections``, ``rollout_sections``,
``update_sections``, ``methods_sections``, ``run_sections``; how a field is checked: ``fields``).

Config files (``configs/*.py``) stay Python and return a ConfigDict; ``jaxrl.config.validate``
turns it into these dataclasses at the boundary and validates it before anything is compiled. Every
problem raises ``ConfigError`` naming the dotted field; ``jaxrl.main`` prints that one line and
exits 2.
"""

from __future__ import annotations

import dataclasses

from jaxrl.config.methods_sections import (
  AllocationSection,
  AnnealPhaseSection,
  ClipSection,
  EEPOSection,
  ModulationSection,
  TemperatureSection,
)
from jaxrl.config.model_sections import ModelSection
from jaxrl.config.rollout_sections import RolloutSection, VllmSection
from jaxrl.config.run_sections import (
  CheckpointSection,
  DiagnosticsSection,
  EvalSection,
  LogSection,
  MeshSection,
  SFTSection,
  resolve_ks,
)
from jaxrl.config.task_sections import DataSection, RewardSection, TaskSection, ToolSection
from jaxrl.config.update_sections import LossSection, OptimSection


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
