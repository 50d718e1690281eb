"""``TaskSections``: what a task reads of the run's config. A task's loader (``load``), its
``check_inputs``, its environment and its reward terms take these sections, never the whole
``Config``; ``jaxrl.run.sections.task_sections`` picks them from it."""

from __future__ import annotations

import dataclasses

from jaxrl.config import (
  AnnealPhaseSection,
  DataSection,
  ModelSection,
  RewardSection,
  RolloutSection,
  SFTSection,
  TaskSection,
  ToolSection,
)


@dataclasses.dataclass(frozen=True)
class TaskSections:
  """The sections a task reads: the built-in tasks the task, sft, rollout (and, with tools, data
  and tool) sections and the seed; the math task the model, data, reward and rollout sections;
  reward terms the reward section, the model's dtype and, for ``model:tiny-rm``, the task and
  seed; countdown every phase's response length (``anneal_phase``)."""

  seed: int
  model: ModelSection
  task: TaskSection
  data: DataSection
  reward: RewardSection
  tool: ToolSection
  sft: SFTSection
  rollout: RolloutSection
  anneal_phase: AnnealPhaseSection
