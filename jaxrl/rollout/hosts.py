"""Rollouts from one sidecar per host: each process samples its slice of the questions from its
own server, and every process ends up with all the rollouts.

The slices are contiguous runs of questions cut where the cumulative rollout count crosses
multiples of R / P, so every server samples about the same number of rows whatever the allocation
(E3 and DynaMO give some questions many rollouts and others none). Rows stay grouped in question
order, so the gathered output is laid out exactly as one server's would be; a question's requests
carry the same seed on whichever host samples it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl.rollout.engine import SampleRequest
from jaxrl.types import Rollouts


def host_slices(counts_B: np.ndarray, processes: int) -> np.ndarray:
  """Question boundaries ``[P + 1]``: process p samples questions ``bounds[p]:bounds[p + 1]``.

  Question i goes to the process whose share of the R rows holds the middle of its rollouts, so
  each process gets ~R / P rows (± half the largest G_i)."""
  counts_B = np.asarray(counts_B, np.int64)
  total = int(counts_B.sum())
  middle_B = np.cumsum(counts_B) - counts_B / 2
  owner_B = np.minimum((middle_B * processes) // max(total, 1), processes - 1).astype(np.int64)
  # owner_B is non-decreasing: each process's questions are one contiguous run.
  return np.searchsorted(owner_B, np.arange(processes + 1), side="left")


def gather_rows(local: Rollouts, rows_P: np.ndarray) -> Rollouts:
  """Every process's rows concatenated in process order, on every process (a collective).

  ``rows_P[p]`` is process p's row count; rows are padded to the largest for the all-gather."""
  most = max(int(rows_P.max()), 1)

  def pad(x):
    x = np.asarray(x)
    return np.concatenate([x, np.zeros((most - len(x), *x.shape[1:]), x.dtype)])

  stacked = multihost_utils.process_allgather(jax.tree.map(pad, local), tiled=False)
  return jax.tree.map(lambda x: np.concatenate([x[p, :n] for p, n in enumerate(rows_P)]), stacked)


class PerHostEngine:
  """A rollout engine per process (its own vLLM sidecar) serving that process's questions.

  Multi-turn: each process steps the environment for its own rows (``respond.rows``: a fresh
  respond over that slice), so the environment's trajectory reward and the turn counts come back
  in the rollouts and are gathered with the rows."""

  def __init__(self, local):
    self.local = local
    self.provides_entropy = local.provides_entropy
    # Gathering every host's rows is a collective: it must not run beside the trainer's.
    self.concurrent = False

  @property
  def max_new_tokens(self) -> int:
    return self.local.max_new_tokens

  def close(self) -> None:
    self.local.close()

  def stop_restarts(self) -> None:
    self.local.stop_restarts()

  def generate(self, params, version: int, request: SampleRequest) -> Rollouts:
    """This process's slice of ``request`` from its own engine (every process pushes its own copy
    of ``params`` to its server), every process's rows gathered."""
    counts_B = np.asarray(request.counts_B, np.int64)
    bounds = host_slices(counts_B, jax.process_count())
    lo, hi = bounds[jax.process_index()], bounds[jax.process_index() + 1]
    first_row_B = np.concatenate([[0], np.cumsum(counts_B)])
    respond = request.respond
    local = self.local.generate(
      params,
      version,
      dataclasses.replace(
        request,
        prompt_ids_BxP=np.asarray(request.prompt_ids_BxP)[lo:hi],
        prompt_mask_BxP=np.asarray(request.prompt_mask_BxP)[lo:hi],
        counts_B=counts_B[lo:hi],
        respond=None if respond is None else respond.rows(first_row_B[lo], first_row_B[hi]),
        first_question=int(lo),
        first_row=int(first_row_B[lo]),
      ),
    )
    rows_P = first_row_B[bounds[1:]] - first_row_B[bounds[:-1]]
    out = gather_rows(local, rows_P)
    group_ids_R = np.repeat(np.arange(len(counts_B), dtype=np.int32), counts_B)
    return dataclasses.replace(out, group_ids_R=group_ids_R)
