"""Config errors fail before any compilation, with one line naming the field and exit code 2."""

import os
import subprocess
import sys

import pytest

from jaxrl.config import Config, ConfigError, default_configdict, from_configdict

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
  ],
)
def test_bad_config_exits_2_naming_the_field(tmp_path, flags, field):
  out = run_main(*flags, workdir=str(tmp_path / "w"))
  assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
  lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
  assert field in lines[-1], lines[-1]
  assert "Traceback" not in out.stderr
  # Nothing was compiled or trained: no metrics, no checkpoints.
  assert not os.path.exists(tmp_path / "w" / "metrics.jsonl")


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
