"""The data cursor: which questions a step takes, as a pure function of the seed and the cursor.

Each pass over a pool of questions is a fresh permutation seeded by (seed, epoch, stream), so a
resumed run that restores the cursor draws exactly the batches the uninterrupted run would have
drawn. A ``Mixture`` holds several pools with weights (e.g. the annealing phase's harder levels):
each batch slot picks its pool by weight from a generator seeded by (seed, questions drawn so far),
then takes the next question of that pool's own pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Cursor:
  """Position in one pool's sequence of permutations."""

  epoch: int = 0
  position: int = 0  # questions of this epoch's permutation already taken


def epoch_order(seed: int, epoch: int, num_questions: int, stream: int = 0) -> np.ndarray:
  entropy = [seed, epoch, 0xDA7A] + ([stream] if stream else [])
  return np.random.default_rng(entropy).permutation(num_questions)


def next_batch(
  cursor: Cursor, seed: int, num_questions: int, batch: int, stream: int = 0
) -> tuple[np.ndarray, Cursor]:
  """``batch`` question ids and the advanced cursor; an epoch's tail carries into the next epoch."""
  ids, epoch, pos = [], cursor.epoch, cursor.position
  while len(ids) < batch:
    order = epoch_order(seed, epoch, num_questions, stream)
    take = order[pos : pos + batch - len(ids)]
    ids.extend(take.tolist())
    pos += len(take)
    if pos >= num_questions:
      epoch, pos = epoch + 1, 0
  return np.asarray(ids, np.int32), Cursor(epoch, pos)


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Pools of question ids (indices into the task's training arrays) and their sampling weights."""

  pools: tuple[np.ndarray, ...]
  weights: tuple[float, ...]
  stream: int = 0  # distinguishes the permutations of different mixtures (phases)

  def __post_init__(self):
    if len(self.pools) != len(self.weights) or not self.pools:
      raise ValueError("a mixture needs one weight per pool and at least one pool")
    if any(len(p) == 0 for p in self.pools) or any(w <= 0 for w in self.weights):
      raise ValueError("every pool of a mixture needs questions and a weight > 0")

  @property
  def size(self) -> int:
    return sum(len(p) for p in self.pools)

  @classmethod
  def whole(cls, num_questions: int) -> "Mixture":
    return cls((np.arange(num_questions, dtype=np.int32),), (1.0,))


@dataclasses.dataclass(frozen=True)
class MixtureCursor:
  """Where a run stands in a mixture; ``epoch`` counts passes of ``mixture.size`` questions."""

  pools: tuple[Cursor, ...]
  drawn: int = 0  # questions drawn from this mixture so far
  epoch0: int = 0  # epochs completed before this mixture began (earlier phases)

  @classmethod
  def start(cls, mixture: Mixture, epoch0: int = 0) -> "MixtureCursor":
    return cls(tuple(Cursor() for _ in mixture.pools), 0, epoch0)

  def epoch(self, mixture: Mixture) -> int:
    return self.epoch0 + self.drawn // mixture.size

  def to_json(self) -> dict:
    return {
      "pools": [dataclasses.asdict(c) for c in self.pools],
      "drawn": self.drawn,
      "epoch0": self.epoch0,
    }

  @classmethod
  def from_json(cls, data: dict) -> "MixtureCursor":
    return cls(tuple(Cursor(**c) for c in data["pools"]), data["drawn"], data["epoch0"])


def next_mixture_batch(
  cursor: MixtureCursor, seed: int, mixture: Mixture, batch: int
) -> tuple[np.ndarray, MixtureCursor]:
  """``batch`` question ids drawn from the mixture, and the advanced cursor.

  A one-pool mixture draws exactly what ``next_batch`` over that pool draws.
  """
  num_pools = len(mixture.pools)
  if num_pools == 1:
    source_B = np.zeros(batch, np.int64)
  else:
    p = np.asarray(mixture.weights, np.float64)
    rng = np.random.default_rng([seed, cursor.drawn, mixture.stream, 0x313C])
    source_B = rng.choice(num_pools, size=batch, p=p / p.sum())
  ids_B = np.empty(batch, np.int32)
  pools = list(cursor.pools)
  for s, pool in enumerate(mixture.pools):
    slots = np.flatnonzero(source_B == s)
    if len(slots):
      local, pools[s] = next_batch(
        pools[s], seed, len(pool), len(slots), stream=mixture.stream * 1024 + s
      )
      ids_B[slots] = pool[local]
  return ids_B, MixtureCursor(tuple(pools), cursor.drawn + batch, cursor.epoch0)
