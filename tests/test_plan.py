"""``--plan``: exact per-device state bytes from shapes alone, numbers that shrink with fsdp, the
architecture source, XLA's memory analysis of a small compiled step, and the 7B plan on 8 fake CPU
devices (subprocess)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from run_helpers import ROOT, tiny_config

from jaxrl.config import forget_config, from_configdict, loss_config
from jaxrl.nn import hf_config, model
from jaxrl.run import cli, plan, plan_compile, plan_estimate, plan_report
from jaxrl.tasks.data import tokenizer

GiB = 1024**3


def shard_formula_bytes(m: model.ModelConfig, fsdp: int) -> int:
  """Per-device param bytes by hand: every matrix splits its D ("embed") axis over fsdp; biases
  and norms are replicated (tensor = 1)."""
  d, f, layers = m.hidden_size, m.intermediate_size, m.num_layers
  he, ke = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  matrices = m.vocab_size * d * (1 if m.tie_embeddings else 2) + layers * (
    2 * d * he + 2 * d * ke + 3 * d * f
  )
  vectors = layers * ((he + 2 * ke) * m.qkv_bias + 2 * d) + d
  assert matrices % fsdp == 0
  return (matrices // fsdp + vectors) * np.dtype(m.param_dtype).itemsize


def small(fsdp: int, **overrides):
  return tiny_config(
    "test", **{"mesh.fsdp": fsdp, "sft.batch_size": 16, "model.tie_embeddings": False, **overrides}
  )


def qwen7b_config(arg: str = ""):
  return from_configdict(cli.load_config(f"{os.path.join(ROOT, 'configs', 'qwen7b.py')}:{arg}"))


def test_param_bytes_are_the_exact_sum_of_shards():
  for fsdp in (1, 4):
    for dtype in ("float32", "bfloat16"):
      p = plan.build(small(fsdp, **{"model.param_dtype": dtype}), compile_steps=False)
      assert p.params == shard_formula_bytes(p.model_cfg, fsdp), (fsdp, dtype)
  one = plan.build(small(1), compile_steps=False)
  _, abstract = model.abstract(one.model_cfg)
  assert one.params == model.num_params(abstract) * 4
  # AdamW mu + nu in float32 (two int32 step counters besides), also for bfloat16 params.
  bf16 = plan.build(small(4, **{"model.param_dtype": "bfloat16"}), compile_steps=False)
  assert 0 < bf16.opt_state - 4 * bf16.params <= 16
  assert bf16.ref_params == 0
  kl = plan.build(small(4, **{"loss.kl_coef": 0.1}), compile_steps=False)
  assert kl.ref_params == kl.params


def test_lora_plan_counts_adapters_their_moments_and_no_reference_copy():
  p = plan.build(small(1, **{"model.lora.rank": 4, "loss.kl_coef": 0.1}), compile_steps=False)
  m, r = p.model_cfg, 4
  d, f = m.hidden_size, m.intermediate_size
  he, ke = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  per_layer = r * (2 * (d + he) + 2 * (d + ke) + 3 * (d + f))
  assert p.adapters == m.num_layers * per_layer * 4  # float32 A and B of every projection
  base = plan.build(small(1), compile_steps=False)
  assert p.params == base.params + p.adapters
  assert 0 < p.opt_state - 2 * p.adapters <= 16  # AdamW moments of the adapters only
  assert p.ref_params == 0  # the reference is the base with the adapters off
  text = plan_report.render(p)
  assert "| of which LoRA adapters |" in text and "the base with the adapters switched off" in text


def test_per_device_numbers_shrink_with_fsdp():
  plans = [plan.build(small(n), compile_steps=False) for n in (1, 2, 4)]
  for a, b in zip(plans, plans[1:]):
    assert b.params < a.params and b.opt_state < a.opt_state
    assert b.phases[0].activations.total < a.phases[0].activations.total
    assert b.phases[0].rollout.total < a.phases[0].rollout.total
  q = {w.kind: w for w in plans[2].weights}["q_proj"]
  assert q.leaves == 2 and q.shape == (32, 32)  # loop layout: one array per layer
  assert q.spec == "P('tensor', 'fsdp')" and q.shard_shape == (32, 8)
  norms = {w.kind: w for w in plans[2].weights}["layer norms"]
  assert norms.spec == "P(None)" and norms.shard_shape == (32,)
  assert "Not compiled" in plan_report.render(plans[2])  # 4 devices wanted, 1 here


def test_checkpoint_config_json_wins_over_the_section(tmp_path):
  arch = model.ModelConfig(
    vocab_size=40,
    hidden_size=48,
    intermediate_size=80,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    rope_theta=1e6,
    tie_embeddings=False,
  )
  (tmp_path / "config.json").write_text(json.dumps(hf_config.hf_config_from_model(arch)))
  p = plan.build(small(1, **{"model.checkpoint": str(tmp_path)}), compile_steps=False)
  assert str(tmp_path) in p.source and "config.json" in p.source
  assert (p.model_cfg.hidden_size, p.model_cfg.num_layers, p.model_cfg.vocab_size) == (48, 3, 40)
  missing = plan.build(
    small(1, **{"model.checkpoint": str(tmp_path / "absent")}), compile_steps=False
  )
  assert "not downloaded" in missing.source and missing.model_cfg.hidden_size == 32


def test_small_config_reports_xla_memory_of_the_compiled_step():
  p = plan.build(small(1, **{"loss.micro_batches": 2}), rollout_side=False)
  assert not p.skipped
  (train,) = p.phases[0].compiled
  # The train state is an argument and, donated, aliased by the new state; the batch is the rest.
  assert train.alias >= p.state and train.argument > p.state
  assert train.temp > p.params  # at least the gradient accumulator
  text = plan_report.render(p)
  assert "| train step (rl_update) |" in text and "memory_analysis()" in text


def test_eepo_config_compiles_the_forgetting_step():
  p = plan.build(small(1, **{"loss.micro_batches": 2, "eepo.enabled": True}))
  names = [c.name for c in p.phases[0].compiled]
  assert names[-1] == "EEPO forgetting step (eepo_forget)"
  forget = p.phases[0].compiled[-1]
  assert forget.argument >= p.params and forget.output >= p.params  # θ in, θ' out
  assert "| EEPO forgetting step (eepo_forget) |" in plan_report.render(p)


def test_qwen7b_without_enough_devices_gives_the_table_and_says_how(tmp_path, monkeypatch):
  assert len(jax.devices()) < 8, "run this test without fake devices"
  monkeypatch.setenv("JAXRL_MODELS", str(tmp_path))  # the checkpoint is not downloaded there
  cfg = qwen7b_config()
  p = plan.build(cfg)
  assert p.skipped and not p.phases[0].compiled
  assert p.params == shard_formula_bytes(p.model_cfg, 8)
  text = plan_report.render(p)
  assert "xla_force_host_platform_device_count=8" in text
  assert "DeepSeek-R1-Distill-Qwen-7B is not downloaded" in text
  assert "| parameters | 3.55 GiB |" in text and "| optimizer state | 7.09 GiB |" in text


def _plan_on_fake_devices(config: str, devices: int, tmp_path) -> str:
  """``--plan`` of ``config`` in a subprocess with ``devices`` fake CPU devices (the checkpoint
  not downloaded: the config's model section); its report."""
  env = dict(
    os.environ,
    PYTHONPATH=ROOT,
    JAXRL_MODELS=str(tmp_path),
    HF_HUB_OFFLINE="1",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_PLATFORMS="cpu",
  )
  out = subprocess.run(
    [sys.executable, "-m", "jaxrl.main", f"--config={config}", "--plan"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


@pytest.mark.slow  # 10 s on an idle 2-core machine (the 7B step compiles in ~6 s), 20 s under load
def test_qwen7b_plan_on_8_fake_devices(tmp_path):
  text = _plan_on_fake_devices("configs/qwen7b.py", 8, tmp_path)
  assert "mesh: data=1 x fsdp=8 x tensor=1 = 8 device(s); this process has 8 x cpu" in text
  assert "7.616 B params, L=28, D=3584" in text
  assert (
    "| q_proj | 1 | [28, 3584, 3584] | float32 | `P(None, 'tensor', 'fsdp')` | "
    "[28, 3584, 448] | 171.50 MiB |"
  ) in text
  assert "| embed | 1 | [152064, 3584] | float32 | `P('tensor', 'fsdp')` | [152064, 448] |" in text
  assert "| parameters | 3.55 GiB |" in text and "| KL reference params | 0 |" in text
  row = next(line for line in text.splitlines() if line.startswith("| train step (rl_update) |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[1] == "10.65 GiB" and cells[3] == "10.64 GiB"  # the donated state is aliased
  assert float(cells[4].split()[0]) > 0  # temp
  assert "| pi_old rescoring (logp_responses_chunked) |" in text
  assert "Not compiled" not in text
  # The step fits an 80 GB GPU with headroom (CPU numbers; a GPU needs at most about these):
  # blocked attention + rows kept split over the data axes took 175.8 → 44.1 GiB, and the
  # rescoring 69.0 → 8.9 GiB.
  peaks = {
    line.split("|")[1].strip(): float(line.split("**")[1].split()[0])
    for line in text.splitlines()
    if line.startswith(("| train step (", "| pi_old rescoring ("))
  }
  assert peaks["train step (rl_update)"] < 56, peaks
  assert peaks["pi_old rescoring (logp_responses_chunked)"] < 16, peaks


@pytest.mark.slow
def test_qwen7b_lora_plan_fits_one_80gb_device(tmp_path):
  """configs/qwen7b.py:lora on one device: a bfloat16 base, rank-64 adapters on every projection
  and their moments (1.8 GiB), one row per micro-batch. XLA CPU's compiled peak (which includes
  float32 copies of the bfloat16 weights a GPU does not make) fits 80 GiB."""
  text = _plan_on_fake_devices("configs/qwen7b.py:lora", 1, tmp_path)
  assert "mesh: data=1 x fsdp=1 x tensor=1 = 1 device(s)" in text
  assert "| of which LoRA adapters | 616.00 MiB |" in text
  assert "| optimizer state | 1.20 GiB |" in text and "| KL reference params | 0 |" in text
  row = next(line for line in text.splitlines() if line.startswith("| train step (rl_update) |"))
  peak = float(row.split("**")[1].split()[0])
  assert peak < 80, row
  assert "Against an 80 GiB accelerator (A100 / H100 80GB) the compiled peak" in text
  assert "does NOT fit" not in text


def test_plan_compiles_the_very_programs_the_trainer_runs(tmp_path, monkeypatch):
  """``--plan`` and ``Trainer`` build their jitted programs in one place (``rl.programs``): the
  same functions with the same static arguments, donations and output shardings."""
  import optax

  from jaxrl.rl import forget, programs, step
  from jaxrl.run.train import Trainer

  made = []
  init = programs.Programs.__init__

  def recording_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.append(self)

  monkeypatch.setattr(programs.Programs, "__init__", recording_init)
  cfg = small(1, **{"loss.micro_batches": 2, "eepo.enabled": True, "sft.steps": 0})
  plan.build(cfg)
  planned = made[-1]
  with Trainer.open(cfg, str(tmp_path)) as trainer:
    ctx = trainer.step_context(None)
    ctx.runtime(0)  # the phase's train step
    trainer.programs.forget(forget_config(cfg.eepo, cfg.loss))
  ran = trainer.programs
  assert ran is made[-1] and planned is not ran
  update_key = ("update", loss_config(cfg))
  forget_key = ("forget", forget_config(cfg.eepo, cfg.loss))
  assert {update_key, forget_key} <= set(planned.built()) & set(ran.built())
  for key in (update_key, forget_key):
    a, b = planned.built()[key], ran.built()[key]
    fa, fb = a.__wrapped__, b.__wrapped__  # the partials jit wraps: function + static arguments
    assert fa.func is fb.func and fa.func in (step.rl_update, forget.eepo_forget)
    # Everything but the optimizer (each side builds its own from the same ``cfg.optim``).
    static_a, static_b = (
      [x for x in f.args if not isinstance(x, optax.GradientTransformation)] for f in (fa, fb)
    )
    assert static_a == static_b and fa.keywords == fb.keywords
  assert jax.tree.all(
    jax.tree.map(lambda x, y: x == y, planned.state_shardings, ran.state_shardings)
  )


def test_tools_plan_counts_the_multi_turn_buffers():
  """With ``task.environment`` the rollout side is the multi-turn sampler's (docs/algorithms.md
  §11): the single-turn buffers it shares, plus its turn state, observation block and observation
  forward, in place of the decode segments' growth (its cache has P + N slots from the prefill)."""
  # One vocabulary for both (without the environment the task would plan the default's).
  cfg = tiny_config("tools", **{"model.vocab_size": tokenizer.vocab_size("tools")})
  single_cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, environment=""))
  multi = plan.build(cfg, compile_steps=False).phases[0].rollout
  single = plan.build(single_cfg, compile_steps=False).phases[0].rollout
  r, p, n, o = cfg.num_rollouts, plan_estimate.prompt_len(cfg), 80, 32
  assert (r, multi.rows, multi.tokens) == (128, 128, p + n) and single.tokens == p + n
  m_items, s_items = dict(multi.items), dict(single.items)
  only_multi = {k: v for k, v in m_items.items() if k not in s_items}
  only_single = {k: v for k, v in s_items.items() if k not in m_items}
  assert list(only_single) == [
    "the previous decode segment's k (or v) while the last one's is grown from it"
  ]
  assert only_multi["multi-turn: loss mask bool [R, N] (the model's tokens)"] == r * n
  assert only_multi["multi-turn: response mask bool [R, N] (model and environment tokens)"] == r * n
  assert only_multi["multi-turn: tokens i32, log-probs f32, entropies f32 [R, N]"] == r * n * 12
  assert only_multi["multi-turn: valid cache slots bool [R, P+N]"] == r * (p + n)
  assert only_multi["multi-turn: observation block: ids i32 + mask bool [R, O=32]"] == r * o * 5
  assert only_multi["multi-turn: per-turn row state: 3 i32 + 5 bool [R]"] == r * 17
  assert sum(k.startswith("observation forward:") for k in only_multi) == 2
  # The totals differ by exactly those items.
  assert multi.total == single.total - sum(only_single.values()) + sum(only_multi.values())
  assert multi.total > single.total
  text = plan_report.render(plan.build(cfg, compile_steps=False))
  assert "| multi-turn: loss mask bool [R, N] (the model's tokens) | 10.00 KiB |" in text
  assert "`task.environment = calculator` the multi-turn sampler runs instead" in text


def test_tools_plan_compiles_the_multi_turn_programs(monkeypatch):
  """The rollout side compiles the multi-turn programs, not the single-turn sampler (the train
  step, which the other tests compile, is stubbed: the test stays fast)."""
  stub = plan_compile.Compiled("train step (rl_update)", 0.0, 0, 0, 0, 0, 0)
  monkeypatch.setattr(plan, "compile_train_step", lambda *args: stub)
  compiled = plan.build(tiny_config("test,tools")).phases[0].compiled
  assert all(c.peak > 0 for c in compiled[1:])
  assert [c.name for c in compiled] == [
    "train step (rl_update)",
    "multi-turn prefill (prefill_program)",
    "multi-turn turn (turn_program)",
    "multi-turn observation (observe_program)",
  ]


def test_a_run_that_cannot_fit_is_refused_naming_the_length():
  """The plan's own numbers (state + the update's and the sampler's buffers) against the host's
  memory: the tiny test run fits; 10^8 new tokens (about 56,000 GiB) do not."""
  assert plan.memory_error(tiny_config("test")) is None
  error = plan.memory_error(tiny_config("test", **{"rollout.max_new_tokens": 10**8}))
  assert error is not None and error.field == "rollout.max_new_tokens"
  assert "GiB per device" in str(error) and "P+N=100000006" in str(error), error


def test_the_memory_check_lets_through_a_run_whose_compiled_programs_fit(monkeypatch):
  """A device exactly as large as XLA's compiled peak of the run's update: the check, which reads
  the plan's analytic estimate (above XLA's number here: the attention block's scores, probs and
  their gradients counted whole), must not refuse it."""
  cfg = tiny_config("test", **{"rollout.max_new_tokens": 506})
  p = plan.build(cfg, rollout_side=False)  # the update alone: its estimate is the larger
  (update,) = p.phases[0].compiled
  assert p.peak(p.phases[0]) == p.train_peak(p.phases[0]) > update.peak
  monkeypatch.setattr(plan, "_capacity", lambda device_memory: (update.peak, "device memory"))
  assert plan.memory_error(cfg) is None


def test_where_cudnn_fused_attention_runs_the_plan_counts_no_attention_scores(monkeypatch):
  """On an NVIDIA GPU, bfloat16, cuDNN's fused attention takes the training forward and the
  rescoring (attention.fused_implementation: the trainer's own decision), and it never holds the
  [rows, H, block, T] scores; float32 (or an odd T) keeps the blocked path and its scores."""
  from jaxrl.nn import attention

  monkeypatch.setattr(attention, "_on_cuda", lambda: True)
  for dtype, fused in (("bfloat16", True), ("float32", False)):
    cfg = tiny_config("test", **{"rollout.max_new_tokens": 506, "model.dtype": dtype})
    m, mesh_shape = plan.architecture(cfg)[0], {"data": 1, "fsdp": 1, "tensor": 1}
    assert plan_estimate.prompt_len(cfg) + 506 == 512  # even: the fused call takes it
    vllm = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))
    for est in (
      plan_estimate.activation_estimate(cfg, m, mesh_shape),
      plan_estimate.rollout_estimate(vllm, m, mesh_shape),
    ):
      names = [name for name, _ in est.items]
      assert any("attention block" in n for n in names) != fused, (dtype, names)


def test_reward_model_memory_is_planned(tmp_path):
  """A reward model's params and head (exact bytes, sharded like the policy) add to what every
  device holds; its forward over reward.model_rows x reward.model_max_tokens (8 x 32) is
  compiled."""
  import hf_fixtures  # torch and transformers: only this test needs them

  from jaxrl.nn import reward_model

  path = hf_fixtures.make_tiny_hf_reward_model("llama", tmp_path / "rm")
  cfg = small(
    1,
    **{
      "reward.terms": f"verifier, model:{path}*0.5",
      "reward.model_rows": 8,
      "reward.model_max_tokens": 32,
    },
  )
  p = plan.build(cfg)
  rm = reward_model.reward_model_config(path, cfg.model.dtype)
  assert p.reward_model == shard_formula_bytes(rm, 1) + rm.hidden_size * 4  # float32 score [1, D]
  assert p.resident == p.state + p.reward_model
  assert p.train_peak(p.phases[0]) > p.state + p.reward_model
  forward = p.phases[0].compiled[-1]
  assert forward.name == "reward model forward (reward_scores)"
  assert forward.argument >= p.reward_model + 8 * 32 * (4 + 1)  # and the i32 tokens, bool mask
  text = plan_report.render(p)
  assert "| reward model params |" in text
  assert "resident: params + optimizer + reference + reward model" in text
  without = plan.build(small(1), compile_steps=False)
  assert without.reward_model == 0 and without.resident == without.state
