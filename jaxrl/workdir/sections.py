"""The checkpoints' config section (``checkpoint``): how often ``jaxrl.workdir.checkpoint`` writes the
loop state, how many it keeps, and how long a write may take."""

from __future__ import annotations

import dataclasses

from jaxrl.fields import need, need_seconds


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  """Orbax checkpoints of the whole loop state: how often, how many kept, async writes."""

  every: int = 25
  keep: int = 2
  async_save: bool = True
  # Longest wait for a write to finish (s). A write still running then (a hung disk or log sink)
  # counts as failed: the previous checkpoint stays the latest, and the run can still exit.
  settle_timeout: float = 600.0

  def check(self) -> None:
    need(self.every >= 1, "checkpoint.every", "must be >= 1")
    need_seconds(self.settle_timeout, "checkpoint.settle_timeout")
    need(self.keep >= 1, "checkpoint.keep", "must be >= 1")
