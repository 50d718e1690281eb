"""``--plan``'s analytic estimate: per device, the activations of the train step's largest
micro-batch and the rollout side's buffers (the JAX sampler's, the multi-turn sampler's, or vLLM's
π_old rescoring pass), from the model's and the phase's shapes alone. XLA's own numbers for the
same programs are ``plan_compile``'s; ``plan.build`` puts both in the plan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.config import Config
from jaxrl.fields import ConfigError
from jaxrl.nn import attention, model
from jaxrl.nn.attention import block_size
from jaxrl.rollout.sampler import segment_ends
from jaxrl.tasks import task


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Analytic per-device bytes: named items and the total they add up to."""

  rows: int  # rows per device
  tokens: int  # sequence length (T, or KV slots S)
  items: tuple[tuple[str, int], ...]
  total: int


def prompt_len(cfg: Config) -> int:
  """P as the task pads prompts: task.max_prompt_len, or a built-in task's longest + BOS."""
  if cfg.task.max_prompt_len:
    return cfg.task.max_prompt_len
  if cfg.task.name not in task.BUILTIN_TASKS:
    raise ConfigError("task.max_prompt_len", "the plan needs a fixed prompt length: set it")
  return task.prompt_len(cfg.task)


def _split(dim: int, mesh_shape: dict, axis: str) -> int:
  """A dimension's size on one device under ``logical_to_spec``'s rule (split only if divisible)."""
  n = mesh_shape[axis]
  return dim // n if dim % n == 0 else dim


def _holds_scores(rows: int, t: int, m: model.ModelConfig, mesh_shape: dict) -> bool:
  """Whether attention over T tokens from slot 0 (the update's forward, the rescoring) holds
  [rows, H, block, T] scores: not where cuDNN's fused attention takes the call, by the trainer's
  own test (``attention.fused_implementation``) on these shapes."""
  k = _split(m.num_kv_heads, mesh_shape, "tensor")
  a = _split(m.num_heads, mesh_shape, "tensor") // k
  dtype = jnp.dtype(m.dtype)
  q = jax.ShapeDtypeStruct((rows, t, k, a, m.head_dim), dtype)
  keys = jax.ShapeDtypeStruct((rows, k, m.head_dim, t), dtype)
  return attention.fused_implementation(q, keys, 0) is None


def _layer_internals(rows: int, t: int, m: model.ModelConfig, mesh_shape: dict) -> int:
  """One layer's activations per token: the two norms' outputs and residuals, q/k/v before and
  after RoPE, the attention output, gate, silu(gate), up and their product."""
  h, k = _split(m.num_heads, mesh_shape, "tensor"), _split(m.num_kv_heads, mesh_shape, "tensor")
  f = _split(m.intermediate_size, mesh_shape, "tensor")
  d, e = m.hidden_size, m.head_dim
  return rows * t * (5 * d + 3 * h * e + 3 * k * e + 4 * f) * jnp.dtype(m.dtype).itemsize


def activation_estimate(pc: Config, m: model.ModelConfig, mesh_shape: dict) -> Estimate:
  """Activations of the train step's largest micro-batch on one device, forward + backward.

  Assumes the micro-batch's rows are split over data x fsdp and heads / mlp over tensor. With remat
  "full" the backward keeps each layer's input and recomputes one layer at a time, so one layer's
  internals are live at once. Attention runs in blocks of at most ``attention_block`` queries
  (``block_size``), each rematerialised: one block's f32 scores [rows, H, block, T], probs and
  their two gradients.
  """
  rows = pc.num_rollouts // (pc.loss.mini_batches * pc.loss.micro_batches)
  rows //= mesh_shape["data"] * mesh_shape["fsdp"]
  t = prompt_len(pc) + pc.rollout.max_new_tokens
  b = jnp.dtype(m.dtype).itemsize
  d, e = m.hidden_size, m.head_dim
  h, k = _split(m.num_heads, mesh_shape, "tensor"), _split(m.num_kv_heads, mesh_shape, "tensor")
  f = _split(m.intermediate_size, mesh_shape, "tensor")
  internals = _layer_internals(rows, t, m, mesh_shape)
  q_block = block_size(t, m.attention_block)
  # f32 scores + probs, and their gradients
  attention = rows * h * q_block * t * 2 * (4 + b) if _holds_scores(rows, t, m, mesh_shape) else 0
  inputs = m.num_layers * rows * t * d * b
  dots = m.num_layers * rows * t * (h * e + 2 * k * e + 2 * d + 2 * f) * b  # projection outputs
  chunk = pc.loss.logprob_chunk * _split(m.vocab_size, mesh_shape, "tensor") * 4
  layers = {
    "none": m.num_layers * (internals + attention),
    "full": inputs + internals + attention,
    "dots": dots + internals + attention,
    "offload": inputs + internals + attention,
  }[m.remat]
  items = [
    ("layer inputs kept for the backward, all layers", inputs if m.remat != "none" else 0),
    ("projection outputs kept (remat dots)", dots if m.remat == "dots" else 0),
    ("one layer's internals", internals),
    (
      f"one attention block: f32 scores [rows, H, {q_block}, T] + probs, and their gradients",
      attention,
    ),
    (f"log-prob chunk: f32 logits [C={pc.loss.logprob_chunk}, V]", chunk),
  ]
  if m.remat == "offload":
    items.append(("(projection outputs parked in host memory, not counted)", dots))
  return Estimate(rows, t, tuple(i for i in items if i[1]), layers + chunk)


def rollout_estimate(pc: Config, m: model.ModelConfig, mesh_shape: dict) -> Estimate:
  """The JAX sampler's buffers on one device, or (vLLM) the π_old rescoring forward's one layer;
  both assume the R rows are split over data x fsdp."""
  rows = -(-pc.num_rollouts // (mesh_shape["data"] * mesh_shape["fsdp"]))
  p = prompt_len(pc)
  s = p + pc.rollout.max_new_tokens
  h, k = _split(m.num_heads, mesh_shape, "tensor"), _split(m.num_kv_heads, mesh_shape, "tensor")
  if pc.rollout.engine != "jax":  # rescoring: one micro-batch chunk at a time
    rows = -(-rows // pc.loss.micro_batches)
    q_block = block_size(s, m.attention_block)
    scores = rows * h * q_block * s * 4 if _holds_scores(rows, s, m, mesh_shape) else 0
    internals = _layer_internals(rows, s, m, mesh_shape)
    chunk = pc.loss.logprob_chunk * _split(m.vocab_size, mesh_shape, "tensor") * 4
    items = (
      ("one layer's internals", internals),
      (f"one attention block's f32 scores [R, H, {q_block}, T]", scores),
      (f"log-prob chunk: f32 logits [C={pc.loss.logprob_chunk}, V]", chunk),
    )
    return Estimate(rows, s, tuple(i for i in items if i[1]), internals + scores + chunk)
  cache = 2 * m.num_layers * rows * k * s * m.head_dim * jnp.dtype(m.dtype).itemsize
  # Each distinct prompt is prefilled once (then copied to its rows); a prefill sees its P slots.
  prompts = -(-pc.batch_questions // (mesh_shape["data"] * mesh_shape["fsdp"]))
  prefill_block = block_size(p, m.attention_block)
  prefill = prompts * h * prefill_block * p * 4
  # The last decode segment's cache is grown from the one before, k then v: while one of them is
  # copied, its previous segment's array exists too (XLA's compiled peak at qwen7b agrees).
  ends = segment_ends(pc.rollout.max_new_tokens)
  growing = cache // 2 * (p + ends[-2]) // s if len(ends) > 1 else 0
  logits = rows * _split(m.vocab_size, mesh_shape, "tensor") * 4
  shared = (
    ("KV cache: k [L, R, K, E, P+N] and v [L, R, K, P+N, E]", cache),
    (
      f"prefill: one attention block's f32 scores [B, H, {prefill_block}, P]",
      prefill,
    ),
    ("decode: f32 logits [R, V]", logits),
  )
  if pc.task.environment:
    items = shared + multiturn_items(pc, m, mesh_shape, rows)
  else:
    growth = "the previous decode segment's k (or v) while the last one's is grown from it"
    items = shared + ((growth, growing),)
  items = tuple(i for i in items if i[1])
  return Estimate(rows, s, items, sum(v for _, v in items))


def multiturn_items(
  pc: Config, m: model.ModelConfig, mesh_shape: dict, rows: int
) -> tuple[tuple[str, int], ...]:
  """What the multi-turn sampler (``rollout.multiturn``, docs/algorithms.md §11) holds besides the
  KV cache, the prefill and the decode logits, on one device of ``rows`` rows: its turn state,
  carried between the host-driven programs (``turn_programs.TurnBuffers``), the observation block the host
  fills, and the observation's forward over the turn's last token and O positions. Its cache has
  P + N slots from the prefill on (one cache for every turn): no decode segment grows from
  another (the compiled prefill pads its P slots into it without a second copy)."""
  p, n, o = prompt_len(pc), pc.rollout.max_new_tokens, pc.rollout.max_observation_tokens
  s = p + n
  h = _split(m.num_heads, mesh_shape, "tensor")
  observe_block = block_size(1 + o, m.attention_block)
  return (
    ("multi-turn: tokens i32, log-probs f32, entropies f32 [R, N]", rows * n * 12),
    ("multi-turn: response mask bool [R, N] (model and environment tokens)", rows * n),
    ("multi-turn: loss mask bool [R, N] (the model's tokens)", rows * n),
    ("multi-turn: valid cache slots bool [R, P+N]", rows * s),
    # next position, turns, tool calls (i32); in turn, asked, ended, finished, done (bool).
    ("multi-turn: per-turn row state: 3 i32 + 5 bool [R]", rows * (3 * 4 + 5)),
    (f"multi-turn: observation block: ids i32 + mask bool [R, O={o}]", rows * o * 5),
    (
      f"observation forward: one attention block's f32 scores [R, H, {observe_block}, P+N]",
      rows * h * observe_block * s * 4,
    ),
    (
      f"observation forward: one layer's internals over 1 + O = {1 + o} positions",
      _layer_internals(rows, 1 + o, m, mesh_shape),
    ),
  )
