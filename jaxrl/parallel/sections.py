"""The device mesh's config section (``mesh``): the axes ``jaxrl.parallel.sharding`` lays params and
batches over."""

from __future__ import annotations

import dataclasses

from jaxrl.fields import AT_LEAST_1, check_ranges


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """The device mesh: data × fsdp × tensor (their product = the devices of the run)."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  def check(self) -> None:
    check_ranges("mesh", self, dict.fromkeys(("data", "fsdp", "tensor"), AT_LEAST_1))
