"""Float32 rounding bounds shared by the equivalence tests: how far two evaluations of the same
function may lie apart when XLA's CPU kernels (or torch's) sum in different orders.

Every bound is a count of unit roundoffs (``U``) times the scale of the values summed, from the
standard result that a sum of n float32 terms rounds within n·u·Σ|terms| in any order (Higham,
Accuracy and Stability, §3.1); the functions say which sums a value passes through.
"""

from __future__ import annotations

import numpy as np

from jaxrl.nn import model

U = float(np.finfo(np.float32).eps) / 2  # u = 2⁻²⁴, float32's unit roundoff


def chain_terms(cfg: model.ModelConfig, slots: int) -> int:
  """The float32 rounding a value of ``cfg``'s forward over ``slots`` key slots may carry, in units
  of u times the values' scale, whatever order XLA's CPU kernels sum in (they block and vectorise
  for the host's instruction set, so AVX2, AVX-512 and AMX machines add up in different orders).

  A sum of n float32 terms rounds within n·u·Σ|terms| in any order (Higham, Accuracy and
  Stability, §3.1), and to first order the sums a value passes through one after another add
  their n's. Per layer: the attention's norm (D terms), q/k/v (D), q/k norms (E, Qwen3), scores
  (E), softmax (S slots), the mix (S), the out projection (H·E), the MLP's norm (D), gate/up (D),
  down (I), each LoRA projection's low-rank path (r + 2, on 4 of them), and 16 for the
  elementwise steps (biases, RoPE, rsqrt, SiLU, residuals: an ulp or two each); then the final
  norm (D) and the head (D). Two forwards that sum in different orders lie within twice this."""
  d, e, r = cfg.hidden_size, cfg.head_dim, cfg.lora_rank
  layer = 4 * d + (e if cfg.qk_norm else 0) + e + 2 * slots + cfg.num_heads * e
  layer += cfg.intermediate_size + (4 * (r + 2) if r else 0) + 16
  return cfg.num_layers * layer + 2 * d


def grad_rtol(cfg: model.ModelConfig, slots: int, tokens: int) -> float:
  """How far (relative to a leaf's largest entry) two gradients of a loss over ``tokens`` tokens
  of ``slots`` slots may lie apart when their sums run in different orders: the forward to the
  log-probs (``chain_terms`` + the V-term log-sum-exp), the backward through the same sums
  transposed (as many), and a weight's gradient sums over the tokens; twice that for two sides."""
  return 2 * (2 * (chain_terms(cfg, slots) + cfg.vocab_size) + tokens) * U


def logp_atol(cfg: model.ModelConfig, slots: int, z_scale: float) -> float:
  """How far two evaluations of the log-probs of logits/τ of scale ``z_scale`` (max |z/τ|) may lie
  apart: each side's logits are within ``chain_terms`` (+1 for the division by τ) u of that scale,
  the log-softmax is one more sum of V terms (and an exp and a log, 4 more), and a log-prob is the
  difference of two such values; twice that for two sides."""
  return 2 * 2 * (chain_terms(cfg, slots) + 1 + cfg.vocab_size + 4) * U * z_scale


def entropy_atol(cfg: model.ModelConfig, slots: int, z_scale: float) -> float:
  """The same for entropies: logits off by δ move H by at most 2·H·δ ≤ 2·ln V·δ (dH/dz_k =
  p_k·(log p_k + H)), and its own V-term sum rounds within (V + 4)·u·H: ln V times a log-prob's
  bound (whose 2 counts the two values a log-prob is the difference of)."""
  return float(np.log(cfg.vocab_size)) * logp_atol(cfg, slots, z_scale)


def logits_atol(cfg: model.ModelConfig, ref_logits, slots: int) -> float:
  """How far two float32 forwards of ``cfg`` (ours and torch's, or two of either) over ``slots``
  slots may put the logits apart: both frameworks sum in their own CPU kernels' orders (which
  differ on AVX2, AVX-512 and AMX machines), each within ``chain_terms``·u of the logits' scale,
  the two within twice that."""
  return 2 * chain_terms(cfg, slots) * U * float(np.max(np.abs(ref_logits)))


def attention_atol(q, k, v):
  """How far two float32 evaluations of ``jaxrl.nn.attention._attend`` on these inputs may lie apart, whatever order
  their sums run in (a sum of n terms rounds within n·u·Σ|terms|: Higham, Accuracy and Stability,
  §3.1). A score is a dot of E terms times E^-½, the max subtracted: within ε = (E + 2)·u·M of
  exact, M the largest Σ_e |q_e·k_e|·E^-½. Scores off by ε move each probability by at most 2ε
  relative; exp (an ulp or two), the sum over the S slots and the division add (S + 4)·u; the mix
  Σ_s p_s·v_s is a sum of S terms, within S·u·max|v|. So each side is within
  (2ε + (2S + 4)·u)·max|v| of exact, and the two within twice that."""
  q64, k64, v64 = (np.abs(np.asarray(x, np.float64)) for x in (q, k, v))
  e, s = q64.shape[-1], k64.shape[-1]
  m = np.einsum("btkae,bkes->bkats", q64, k64).max() * e**-0.5
  return 2 * (2 * (e + 2) * U * m + (2 * s + 4) * U) * v64.max()


# A float32 per-token term of the loss (ρ = exp(ℓ − ℓ_old), ρ·A, the clip, a KL estimate, the
# divisions by the row norm and the denominator) rounds within this many u of its magnitude.
TERM_ULPS = 10


def sum_tol(n_terms, magnitude):
  """How far a float32 sum of ``n_terms`` such terms, of absolute sum ``magnitude``, may lie from
  the float64 value whatever order XLA's CPU reduction adds them in (its vectorisation differs
  on AVX2, AVX-512 and AMX machines): n·u·Σ|terms| for the sum (Higham, Accuracy and Stability,
  §3.1), TERM_ULPS·u·Σ|terms| for the terms themselves."""
  return (n_terms + TERM_ULPS) * U * magnitude
