"""The data cursor: which questions a step takes, as a pure function of (seed, epoch, position).

Each pass over the training questions is a fresh permutation seeded by (seed, epoch), so a resumed
run that restores the cursor draws exactly the batches the uninterrupted run would have drawn.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Cursor:
  epoch: int = 0
  position: int = 0     # questions of this epoch's permutation already taken


def epoch_order(seed: int, epoch: int, num_questions: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch, 0xDA7A]).permutation(num_questions)


def next_batch(cursor: Cursor, seed: int, num_questions: int, batch: int) -> tuple[np.ndarray, Cursor]:
  """``batch`` question ids and the advanced cursor; an epoch's tail carries into the next epoch."""
  ids, epoch, pos = [], cursor.epoch, cursor.position
  while len(ids) < batch:
    order = epoch_order(seed, epoch, num_questions)
    take = order[pos:pos + batch - len(ids)]
    ids.extend(take.tolist())
    pos += len(take)
    if pos >= num_questions:
      epoch, pos = epoch + 1, 0
  return np.asarray(ids, np.int32), Cursor(epoch, pos)
