"""Unbiased pass@k (docs/algorithms.md §8) for evaluation: host-side Python / numpy, never jitted.

pass@k = 1 − C(n−c, k)/C(n, k) for n samples of which c are correct. The binomial ratio overflows
for realistic n, so it is computed as the product Π_{i=n−c+1..n} (1 − k/i), every factor in [0, 1].
"""

from __future__ import annotations

import numpy as np


def _check(n, c, k):
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")


def pass_at_k(n, c, k) -> float:
  """Unbiased probability that at least one of k draws (without replacement) is correct."""
  n, c, k = int(n), int(c), int(k)
  _check(n, c, k)
  if n - c < k:  # every k-subset contains a correct sample
    return 1.0
  miss = 1.0
  for i in range(n - c + 1, n + 1):
    miss *= 1.0 - k / i
  return 1.0 - miss


def pass_at_k_array(n_Q, c_Q, k) -> np.ndarray:
  """Vectorised `pass_at_k` over questions Q (n may be a scalar or per question)."""
  c_Q = np.asarray(c_Q, np.int64)
  n_Q = np.broadcast_to(np.asarray(n_Q, np.int64), c_Q.shape)
  k = int(k)
  if np.any(c_Q < 0) or np.any(c_Q > n_Q) or k < 1 or np.any(k > n_Q):
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (k={k})")
  # Factor j of question q is 1 − k/(n−c+1+j) for j < c, else 1: the ragged product, rectangular.
  j_C = np.arange(int(c_Q.max(initial=0)))
  i_QxC = (n_Q - c_Q + 1)[..., None] + j_C
  live_QxC = j_C < c_Q[..., None]
  factor_QxC = np.where(live_QxC, 1.0 - k / np.maximum(i_QxC, 1), 1.0)
  miss_Q = np.prod(factor_QxC, axis=-1)
  return np.where(n_Q - c_Q < k, 1.0, 1.0 - miss_Q)
