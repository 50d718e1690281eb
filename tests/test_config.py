"""Config errors fail before any compilation, with one line naming the field and exit code 2."""

import itertools
import os
import subprocess
import sys

import pytest

from jaxrl.config import Config, ConfigError, default_configdict, from_configdict
from jaxrl.rollout.sections import shortest_response, turn_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(*flags, workdir):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run(
    [sys.executable, "-m", "jaxrl.main", f"--workdir={workdir}", *flags],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


@pytest.mark.parametrize(
  "flags, field",
  [
    (["--config=configs/tiny.py", "--config.nope=1"], "nope"),
    (["--config=configs/tiny.py", "--config.steps=abc"], "steps"),
    (["--config=configs/tiny.py", "--config.loss.aggregation=mean"], "loss.aggregation"),
    (["--config=configs/tiny.py", "--config.mesh.fsdp=3"], "batch_questions"),
    (["--config=configs/tiny.py", "--config.model.checkpoint=/no/such/dir"], "model.checkpoint"),
    (["--config=configs/tiny.py", "--config.model.num_kv_heads=3"], "model.num_kv_heads"),
    (["--config=configs/tiny.py", "--config.eval.ks=1,64"], "eval.ks"),
    (["--config=configs/tiny.py:nosuchvariant"], "nosuchvariant"),
    (["--config=configs/missing.py"], "missing.py"),
    (["--config=tyni"], "no built-in config"),
    (["--config=tiny:test", "--config.optim.learning_rate=0"], "optim.learning_rate"),
    (["--config=tiny:test", "--config.checkpoint.settle_timeout=inf"], "checkpoint.settle_timeout"),
    (["--config=tiny:test", "--config.model.hidden_size=0"], "model.hidden_size"),
    (["--config=tiny:test", "--config.optim.grad_clip=-1"], "optim.grad_clip"),
    (["--config=tiny:test", "--config.sft.steps=-3"], "sft.steps"),
    (["--config=tiny:test", "--config.loss.logprob_chunk=0"], "loss.logprob_chunk"),
    (["--config=tiny:test", "--config.model.rms_norm_eps=-1"], "model.rms_norm_eps"),
    (["--config=tiny:test", "--config.task.num_train_per_level=0"], "task.num_train_per_level"),
    # 56,000 GiB by the plan's arithmetic: refused before numpy tries to allocate it
    (
      ["--config=tiny:test", "--config.rollout.max_new_tokens=100000000"],
      "rollout.max_new_tokens: the run needs about",
    ),
  ],
)
def test_bad_config_exits_2_naming_the_field(tmp_path, flags, field):
  out = run_main(*flags, workdir=str(tmp_path / "w"))
  assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
  lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
  assert field in lines[-1], lines[-1]
  assert "Traceback" not in out.stderr
  # Nothing was compiled, trained or written: no run directory.
  assert not os.path.exists(tmp_path / "w")


def test_from_configdict_rejects_bad_values():
  cd = default_configdict()
  cd.rollout.top_p = 0.0
  with pytest.raises(ConfigError, match="rollout.top_p"):
    from_configdict(cd)
  cd = default_configdict()
  cd.loss.micro_batches = 3
  with pytest.raises(ConfigError, match="loss.micro_batches"):
    from_configdict(cd)
  cd = default_configdict()
  cd.log.profile_steps = 0
  with pytest.raises(ConfigError, match="log.profile_steps"):
    from_configdict(cd)


def test_default_config_is_valid_and_typed():
  cfg = from_configdict(default_configdict())
  assert cfg == Config()  # the ConfigDict round-trips to the defaults, field by field
  assert cfg.num_rollouts == cfg.batch_questions * cfg.rollout.group_size
  # An int given for a float field becomes that float (repr tells 1.0 from 1).
  cd = default_configdict()
  cd.optim.learning_rate = 1
  assert repr(from_configdict(cd).optim.learning_rate) == "1.0"


def test_wandb_requested_but_not_installed_is_a_config_error(monkeypatch):
  import importlib.util

  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
  )
  cd = default_configdict()
  cd.log.wandb = True
  with pytest.raises(ConfigError, match="log.wandb.*pip install wandb"):
    from_configdict(cd)


# (overrides, the field the error names): each value is out of its field's range.
BAD_VALUES = [
  ({"optim.learning_rate": 0.0}, "optim.learning_rate"),
  ({"optim.learning_rate": -1e-4}, "optim.learning_rate"),
  ({"optim.learning_rate": float("inf")}, "optim.learning_rate"),
  ({"optim.b1": 1.0}, "optim.b1"),
  ({"optim.b1": -0.1}, "optim.b1"),
  ({"optim.b2": 1.0}, "optim.b2"),
  ({"optim.b2": float("nan")}, "optim.b2"),
  ({"optim.weight_decay": -0.01}, "optim.weight_decay"),
  ({"sft.weight_decay": -0.01}, "sft.weight_decay"),
  ({"sft.learning_rate": 0.0}, "sft.learning_rate"),
  ({"loss.kl_coef": -0.1}, "loss.kl_coef"),  # the loss adds kl_coef * KL: a penalty
  ({"loss.entropy_coef": -0.01}, "loss.entropy_coef"),  # it subtracts entropy_coef * H: a bonus
  ({"eval.temperature": 0.0}, "eval.temperature"),
  ({"eval.temperature": -1.0}, "eval.temperature"),
  ({"vllm.max_num_seqs": 0}, "vllm.max_num_seqs"),
  ({"reward.memory_limit_mb": 0}, "reward.memory_limit_mb"),
  ({"reward.memory_limit_mb": 128}, "reward.memory_limit_mb"),
  ({"seed": -1}, "seed"),
  ({"vllm.startup_timeout": float("inf")}, "vllm.startup_timeout"),
  ({"vllm.request_timeout": float("inf")}, "vllm.request_timeout"),
  ({"vllm.request_timeout": float("nan")}, "vllm.request_timeout"),
  ({"checkpoint.settle_timeout": float("inf")}, "checkpoint.settle_timeout"),
  ({"reward.time_limit": float("inf")}, "reward.time_limit"),
  ({"steps": 3, "rollout.max_staleness": 4}, "rollout.max_staleness"),
  ({"modulation.gamma": float("nan")}, "modulation.gamma"),  # NaN: never a setting
  ({"data.split": "../train"}, "data.split"),
  # Found by trying: each failed later (a division by zero, NaN steps, a bare ValueError) or
  # changed the run without a word (clipping off, SFT skipped).
  ({"optim.grad_clip": -1.0}, "optim.grad_clip"),
  ({"sft.steps": -3}, "sft.steps"),
  ({"loss.logprob_chunk": 0}, "loss.logprob_chunk"),
  ({"model.hidden_size": 0}, "model.hidden_size"),
  ({"model.rms_norm_eps": -1.0}, "model.rms_norm_eps"),
  ({"model.rms_norm_eps": float("nan")}, "model.rms_norm_eps"),
  ({"task.num_train_per_level": 0}, "task.num_train_per_level"),
  ({"eval.num_samples": 0}, "eval.num_samples"),
  ({"mesh.data": 0}, "mesh.data"),
  ({"eepo.eps_r": 0.0}, "eepo.eps_r"),
  ({"clip.delta": -0.01}, "clip.delta"),
  # The sweep of every section's numbers: each of these ran without a word and changed the run
  # (a negative width read as a layout, bounds that narrow, a priority or threshold outside the
  # quantity it is compared with, an advantage factor that flips sign, clipping turned off).
  ({"task.digit_width": -1}, "task.digit_width"),
  ({"allocation.e3.step": -1}, "allocation.e3.step"),
  ({"allocation.e3.g_min_floor": 0}, "allocation.e3.g_min_floor"),
  ({"allocation.dynamo.min_history": -1}, "allocation.dynamo.min_history"),
  ({"allocation.dynamo.floor": -0.5}, "allocation.dynamo.floor"),
  ({"allocation.dynamo.mastered": 1.5}, "allocation.dynamo.mastered"),
  ({"allocation.dynamo.mastered": 0.0}, "allocation.dynamo.mastered"),
  ({"temperature.eta": 1.5}, "temperature.eta"),
  ({"temperature.eta": -0.1}, "temperature.eta"),
  ({"modulation.alpha": 1.5}, "modulation.alpha"),
  ({"modulation.gamma": -1.0}, "modulation.gamma"),
  ({"modulation.tau": 1.5}, "modulation.tau"),
  ({"clip.rho": 1.5}, "clip.rho"),
  ({"loss.eps_low": 1.0}, "loss.eps_low"),
]


def _with(overrides: dict, cd=None):
  cd = default_configdict() if cd is None else cd
  for dotted, value in overrides.items():
    *sections, name = dotted.split(".")
    node = cd
    for section in sections:
      node = node[section]
    node[name] = value
  return cd


@pytest.mark.parametrize("overrides, field", BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_out_of_range_values_are_refused_naming_the_field(overrides, field):
  with pytest.raises(ConfigError) as e:
    from_configdict(_with(overrides))
  assert e.value.field == field, e.value


@pytest.mark.parametrize(
  "overrides",
  [
    {"optim.b1": 0.0, "optim.b2": 0.0, "optim.weight_decay": 0.0},
    {"loss.kl_coef": 0.0, "loss.entropy_coef": 0.0},
    {"loss.kl_coef": 0.05, "loss.entropy_coef": 0.001},
    {"steps": 3, "rollout.max_staleness": 3},
    {"steps": 0, "rollout.max_staleness": 0},
    {"vllm.urls": "http://10.0.0.2:8000"},  # attached, not launched
    {"reward.memory_limit_mb": 512},
    {"clip.h_target": float("inf"), "eepo.alpha": float("inf")},  # only timeouts must be finite
    # the ends of the ranges the sweep added
    {"allocation.e3.step": 0, "allocation.dynamo.min_history": 0, "allocation.dynamo.floor": 0.0},
    {"allocation.dynamo.mastered": 1.0, "temperature.eta": 0.0, "modulation.tau": 0.0},
    {"temperature.eta": 1.0, "modulation.alpha": 1.0, "modulation.gamma": 0.0, "clip.rho": 1.0},
    {"modulation.tau": 1.0, "loss.eps_low": 0.99, "task.digit_width": 0},
  ],
)
def test_edge_values_are_accepted(overrides):
  from_configdict(_with(overrides))


def _variant_args(module) -> list[str]:
  """Every ARG a built-in config takes: each variant alone, and the combinations its get_config
  documents (tiny: a preset, a size, anneal, tools; the math configs: a method, lora, test)."""
  variants = list(module.VARIANTS)
  if hasattr(module, "PRESETS"):  # configs/tiny.py
    groups = [(None, *module.PRESETS), (None, *module.SIZES), (None, *module.PHASES)]
    groups.append((None, *module.TASKS))
  else:  # configs/qwen*.py over jaxrl.paper_configs
    from jaxrl import paper_configs

    groups = [(None, *paper_configs.METHODS), *[(None, o) for o in paper_configs.OPTIONS]]
  combos = {",".join(p for p in c if p) for c in itertools.product(*groups)}
  return sorted(combos | set(variants))


def test_every_builtin_config_and_variant_passes_the_checks():
  from jaxrl.methods import registry
  from jaxrl.run import cli
  from jaxrl.tasks.envs import registry as environments

  checked = 0
  for name, path in cli.builtin_configs().items():
    for arg in _variant_args(cli._load(path)):
      cfg = from_configdict(cli.load_config(f"{name}:{arg}"))
      registry.check(allocation=cfg.allocation, temperature=cfg.temperature, clip=cfg.clip)
      environments.check(cfg.task)
      checked += 1
  assert checked > 60, checked


@pytest.mark.parametrize("arg", ["tools", "tools,chat", "tools,anneal", "chat,e3"])
def test_a_builtin_tools_configs_last_turn_always_happens(arg):
  """``rollout.max_turns`` of a built-in tools config is reachable by any rollout: where every turn
  before the last takes its whole T tokens, each call is still answered (``multiturn.answers_fit``,
  the sampler's own rule, in the shortest phase's response)."""
  from jaxrl.rollout.multiturn import TurnConfig, answers_fit
  from jaxrl.run import cli

  cfg = from_configdict(cli.load_config(f"tiny:{arg}"))
  r, n, t = (
    cfg.rollout,
    shortest_response(cfg.rollout, cfg.anneal_phase),
    turn_tokens(cfg.rollout, cfg.anneal_phase),
  )
  turns = TurnConfig((0,), t, r.max_observation_tokens, r.max_turns)
  for k in range(r.max_turns - 1):  # turn k ends, at the latest, after k + 1 turns and k answers
    assert answers_fit(k, (k + 1) * t + k * turns.max_observation_tokens, turns, n), (k, t, n)


@pytest.mark.parametrize(
  "overrides, numbers",
  [
    # O + 2 = 34 > 33: even a one-token call could not be answered with one token of reply.
    (
      {"rollout.max_new_tokens": 33, "rollout.max_turn_tokens": 24},
      "O + 2 = 34 > max_new_tokens=33",
    ),
    # The annealing phase's shorter response binds.
    (
      {"anneal_phase.enabled": True, "anneal_phase.max_new_tokens": 33},
      "O + 2 = 34 > max_new_tokens=33 (the shortest phase's)",
    ),
  ],
)
def test_a_call_its_observation_and_a_reply_must_fit(overrides, numbers):
  """docs/algorithms.md §11: a call is answered where its observation block and one token of the
  reply fit (multiturn.answers_fit), so O + 2 <= max_new_tokens or no call is ever answered."""
  with pytest.raises(ConfigError, match="rollout.max_observation_tokens") as e:
    from_configdict(_tools_config(overrides))
  assert e.value.field == "rollout.max_observation_tokens"
  assert numbers in str(e.value), str(e.value)
  assert "no tool call could be answered" in str(e.value)


def test_a_call_that_just_fits_is_accepted():
  cfg = from_configdict(
    _tools_config({"rollout.max_new_tokens": 34, "rollout.max_turn_tokens": 24})
  )
  assert cfg.rollout.max_new_tokens == 34


def _tools_config(overrides: dict):
  from jaxrl.run import cli

  return _with(overrides, cli.load_config("tiny:tools"))
