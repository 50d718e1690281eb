"""The ``--plan`` report: a ``plan.Plan`` as markdown (weights and their shardings, the train
state per device, per phase the activation estimate, XLA's compiled numbers and the rollout side).
"""

from __future__ import annotations

import math

from jaxrl.config import Config
from jaxrl.run.plan import GiB, PhasePlan, Plan, grad_copies
from jaxrl.run.plan_estimate import Estimate, prompt_len

_WARN_BYTES = 256 * 1024**2  # below this a compiled program's excess over the estimate is noise


def size(n: int) -> str:
  """Bytes in binary units (an "80 GB" A100 / H100 has 80 GiB)."""
  for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} B"


def _table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _dims(shape) -> str:
  return "[" + ", ".join(str(d) for d in shape) + "]"


def _state_section(plan: Plan, cfg: Config) -> list[str]:
  m = plan.model_cfg
  rows = [
    ["parameters", size(plan.params), f"{m.param_dtype}; exact: Σ shard shapes × itemsize"],
  ]
  if plan.adapters:
    rows += [
      [
        "of which LoRA adapters",
        size(plan.adapters),
        f"rank {m.lora_rank} on {', '.join(m.lora_targets)}; float32; the base is frozen",
      ],
      ["gradients", size(plan.trained), "the adapters' only; inside the step (XLA's temp below)"],
    ]
  else:
    rows.append(
      [
        "gradients",
        size(plan.params),
        "the params' shapes, dtype and shardings; inside the step only (XLA's temp below)",
      ]
    )
  if plan.ref_params:
    ref_note = "a frozen copy of the params"
  elif plan.adapters and cfg.loss.kl_coef > 0:
    ref_note = "the base with the adapters switched off: no copy"
  else:
    ref_note = "loss.kl_coef = 0: none"
  rows += [
    [
      "optimizer state",
      size(plan.opt_state),
      f"AdamW mu + nu in {cfg.optim.state_dtype}" + (" (adapters only)" if plan.adapters else ""),
    ],
    ["KL reference params", size(plan.ref_params) if plan.ref_params else "0", ref_note],
  ]
  if plan.reward_model:
    rows += [
      ["reward model params", size(plan.reward_model), f"{m.dtype}; sharded like the policy"],
      [
        "**resident: params + optimizer + reference + reward model**",
        f"**{size(plan.resident)}**",
        "between steps",
      ],
    ]
  else:
    rows.append(
      ["**resident: params + optimizer + reference**", f"**{size(plan.state)}**", "between steps"]
    )
  return ["## Train state per device", "", _table(["memory per device", "bytes", "note"], rows), ""]


GPU_80GB = 80 * GiB  # an A100 / H100 80GB: what the verdict assumes when the backend is a CPU


def _verdict(plan: Plan, peak: int) -> str:
  if plan.device_memory is None:
    fits = (
      f"fits (headroom {size(GPU_80GB - peak)})"
      if peak <= GPU_80GB
      else f"does NOT fit (over by {size(peak - GPU_80GB)})"
    )
    return (
      f"Device memory is not reported by this backend ({plan.devices}). Against an 80 GiB "
      f"accelerator (A100 / H100 80GB) the compiled peak {size(peak)} {fits}."
    )
  fits = "fits" if peak <= plan.device_memory else "does NOT fit"
  return (
    f"Peak {size(peak)} of {size(plan.device_memory)} per device: {fits} "
    f"(headroom {size(plan.device_memory - peak)})."
  )


def _phase_section(plan: Plan, ph: PhasePlan) -> list[str]:
  pc, m, act = ph.cfg, plan.model_cfg, ph.activations
  chunks = pc.loss.mini_batches * pc.loss.micro_batches
  n = pc.rollout.max_new_tokens
  out = [
    f"## Phase `{ph.name}`: R = {pc.num_rollouts} rows, P = {prompt_len(pc)}, N = {n} "
    f"(T = {act.tokens}); {chunks} micro-batch(es) of {pc.num_rollouts // chunks} rows = "
    f"{act.rows} per device",
    "",
    f"Activations of the largest micro-batch per device, an **analytic estimate** (remat "
    f"`{m.remat}`, compute {m.dtype}). The log-prob is fused and chunked "
    f"({pc.loss.logprob_chunk} tokens per chunk): no [B, T, V] logits buffer exists.",
    "",
  ]
  grads = grad_copies(pc) * plan.trained
  rows = [[name, size(v)] for name, v in act.items]
  rows += [
    ["**activations**", f"**{size(act.total)}**"],
    [f"gradients ({grad_copies(pc)} tree(s))", size(grads)],
    [
      "**estimated peak = resident state + gradients + activations**",
      f"**{size(plan.train_peak(ph))}**",
    ],
  ]
  out += [_table(["train step", "per device"], rows), ""]
  if ph.compiled:
    out += _compiled_section(plan, ph, expected_train=grads + act.total)
  return out + _rollout_section(pc, ph.rollout)


_COMPILED_COLUMNS = [
  "program",
  "arguments",
  "outputs",
  "aliased (donated)",
  "temp",
  "generated code",
  "peak = arg + out − alias + temp",
  "compile s",
]


def _compiled_section(plan: Plan, ph: PhasePlan, expected_train: int) -> list[str]:
  """XLA's memory analysis of the phase's compiled programs, the fit verdict, and a warning for
  each program whose temp is far above the analytic estimate."""
  out = [
    "XLA's `memory_analysis()` of the compiled programs, per device, on "
    f"{plan.devices} (the CPU backend keeps some bf16 intermediates in f32 and fuses "
    "less than a GPU's, so a GPU needs at most about this):",
    "",
  ]
  rows = [
    [c.name, size(c.argument), size(c.output), size(c.alias), size(c.temp), size(c.code),
     f"**{size(c.peak)}**", f"{c.seconds:.1f}"]
    for c in ph.compiled
  ]  # fmt: skip
  out += [_table(_COMPILED_COLUMNS, rows), ""]
  out += [_verdict(plan, max(c.peak for c in ph.compiled)), ""]
  for c in ph.compiled:
    if c.name.startswith("reward model"):  # no analytic estimate to hold it against
      continue
    # The forgetting step has a backward too: at most the train step's (half the rows per chunk).
    e = expected_train if c.name.startswith(("train step", "EEPO")) else ph.rollout.total
    if c.temp > 2 * e and c.temp - e > _WARN_BYTES:
      out += [
        f"**Warning**: {c.name}: XLA's temp ({size(c.temp)}) is {c.temp / e:.1f}x the "
        f"estimate ({size(e)}), which assumes each device holds only its share of the rows "
        "(and one layer at a time): the compiled program keeps more (look for "
        "all-gathered or replicated activations in `compiled.as_text()`).",
        "",
      ]
  return out


def _rollout_section(pc: Config, est: Estimate) -> list[str]:
  rows = [[name, size(v)] for name, v in est.items]
  if pc.rollout.engine == "jax":
    return [
      f"Rollouts (`rollout.engine = jax`): the sampler expands to R = {pc.num_rollouts} "
      f"rows with a KV cache of P + N = {est.tokens} slots. Estimated for the rows split "
      f"over data x fsdp ({est.rows} per device); the engine passes host prompts, so the "
      "split is XLA's choice and the compiled sampler above is the real number."
      + _multiturn_note(pc),
      "",
      _table(["sampler", "per device"], rows + [["**total**", f"**{size(est.total)}**"]]),
      "",
    ]
  return [
    f"Rollouts (`rollout.engine = {pc.rollout.engine}`): the vLLM sidecar holds its own "
    "copy of the weights and its own KV cache in its own process (vLLM claims "
    "`--gpu-memory-utilization`, default 0.9, of each GPU it sees): give it GPUs the trainer "
    "does not use, or set the fraction in `vllm.extra_args`. vLLM returns no entropies, so "
    f"the trainer rescores the R = {pc.num_rollouts} rollouts under the sampling params "
    f"(`Programs.logp`: rows split over data x fsdp, in loss.micro_batches = "
    f"{pc.loss.micro_batches} sequential chunks; {est.rows} rows per device per chunk):",
    "",
    _table(["pi_old rescoring", "per device"], rows),
    "",
  ]


def _multiturn_note(pc: Config) -> str:
  if not pc.task.environment:
    return ""
  r = pc.rollout
  return (
    f" With `task.environment = {pc.task.environment}` the multi-turn sampler runs instead: one "
    f"cache of P + N slots for up to {r.max_turns} turns, its turn state kept between the "
    f"host-driven programs, and each observation (O = {r.max_observation_tokens}) prefilled by "
    "one forward (the `multi-turn` and `observation forward` rows)."
  )


def render(plan: Plan) -> str:
  """The plan as markdown."""
  m = plan.model_cfg
  cfg = plan.phases[0].cfg
  n_params = sum(math.prod(w.shape) * w.leaves for w in plan.weights)
  count = f"{n_params / 1e9:.3f} B" if n_params >= 1e8 else f"{n_params / 1e6:.3f} M"
  mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
  out = [
    "# jaxrl plan",
    "",
    f"- architecture from {plan.source}: {count} params, L={m.num_layers}, "
    f"D={m.hidden_size}, F={m.intermediate_size}, H={m.num_heads}, K={m.num_kv_heads}, "
    f"E={m.head_dim}, V={m.vocab_size}, tied embeddings: {m.tie_embeddings}",
    f"- execution: compute {m.dtype}, params {m.param_dtype}, AdamW state "
    f"{cfg.optim.state_dtype}, scan_layers={m.scan_layers}, remat={m.remat}, "
    f"attention in blocks of {m.attention_block} queries",
    f"- mesh: {mesh} = {math.prod(plan.mesh_shape.values())} device(s); this process has "
    f"{plan.devices}",
    "",
  ]
  if plan.skipped:
    out += [f"**Not compiled**: {plan.skipped}", ""]
  weights = [
    [
      w.kind,
      w.leaves,
      _dims(w.shape),
      w.dtype,
      f"`{w.spec}`",
      _dims(w.shard_shape),
      size(w.bytes_per_device),
    ]
    for w in plan.weights
  ]
  out += [
    "## Weights: sharding and one device's shard",
    "",
    _table(
      [
        "weight",
        "arrays",
        "global shape",
        "dtype",
        "PartitionSpec",
        "shard per device",
        "per device",
      ],
      weights,
    ),
    "",
  ]
  out += _state_section(plan, cfg)
  for ph in plan.phases:
    out += _phase_section(plan, ph)
  return "\n".join(out).rstrip() + "\n"
