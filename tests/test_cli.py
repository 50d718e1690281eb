"""The commands as users meet them: ``--config`` by name, ``--help`` of each command, the
``--print_config`` round trip, and ``jaxrl-export`` of any checkpoint of a run."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from run_helpers import ROOT, tiny_config
from safetensors import safe_open

from jaxrl.config import from_configdict
from jaxrl.nn import hf_load
from jaxrl.run import cli, weights
from jaxrl.run.train import Trainer
from jaxrl.workdir.checkpoint import Checkpointer


def _command(module, *flags, cwd=ROOT):
  return subprocess.run(
    [sys.executable, "-m", module, *flags],
    cwd=cwd,
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_help_lists_configs_sections_and_each_commands_flags():
  train = _command("jaxrl.main", "--help")
  assert train.returncode == 0, train.stderr
  for text in ("tiny ", "qwen7b ", "qwen1_5b ", "grpo, e3, dynamo, eepo, es, all, quick"):
    assert text in train.stdout, text
  for section in ("rollout ", "allocation ", "temperature ", "anneal_phase "):
    assert section in train.stdout, section
  for flag in ("--config:", "--workdir:", "--[no]print_config:", "--[no]plan:"):
    assert flag in train.stdout, flag
  for module, flags in (
    ("jaxrl.eval", ("--checkpoint:", "--benchmarks:", "--num_samples:", "--ks:", "--out:")),
    ("jaxrl.export", ("--checkpoint:", "--out:", "--dtype:")),
  ):
    out = _command(module, "--help")
    assert out.returncode == 0, out.stderr
    assert all(flag in out.stdout for flag in flags), out.stdout


def test_a_config_by_name_is_the_file_of_that_name():
  assert from_configdict(cli.load_config("tiny:e3,test")) == tiny_config("e3,test")
  assert cli.resolve_config("qwen7b:grpo") == os.path.join(ROOT, "configs", "qwen7b.py:grpo")
  assert cli.resolve_config("configs/tiny.py:e3") == "configs/tiny.py:e3"  # paths pass through
  with pytest.raises(FileNotFoundError, match="built-in: qwen1_5b, qwen7b, tiny"):
    cli.resolve_config("tyni")


def test_print_config_round_trips(tmp_path):
  flags = ("--config.steps=7", "--config.rollout.max_staleness=1", "--print_config")
  first = _command("jaxrl.main", "--config=tiny:e3,anneal", *flags)
  assert first.returncode == 0, first.stderr
  printed = json.loads(first.stdout)
  assert printed["steps"] == 7 and printed["rollout"]["max_staleness"] == 1
  assert printed["anneal_phase"]["enabled"] and printed["allocation"]["method"] == "e3"
  path = tmp_path / "resolved.json"
  path.write_text(first.stdout)
  second = _command("jaxrl.main", f"--config={path}", "--print_config")
  assert second.returncode == 0, second.stderr
  assert second.stdout == first.stdout
  expected = tiny_config("e3,anneal", steps=7, **{"rollout.max_staleness": 1})
  assert from_configdict(cli.load_config(str(path))) == expected


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_json_config_with_a_non_finite_number_is_refused(tmp_path, constant):
  from jaxrl.config import ConfigError

  path = tmp_path / "config.json"
  path.write_text('{"steps": 3, "optim": {"learning_rate": %s, "b1": 0.9}}' % constant)
  with pytest.raises(ConfigError, match=f"optim.learning_rate: .*{constant}") as e:
    cli.load_config(str(path))
  assert e.value.field == "optim.learning_rate"
  out = _command("jaxrl.main", f"--config={path}", f"--workdir={tmp_path}/run")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  line = out.stderr.strip().splitlines()[-1]
  assert "optim.learning_rate" in line and constant in line, line
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(
  "module,flag", [("jaxrl.main", "--workdir=RUN"), ("jaxrl.eval", "--checkpoint=RUN")]
)
def test_a_truncated_json_config_is_one_line_naming_the_file(tmp_path, module, flag):
  """jaxrl-train reads its config lazily, jaxrl-eval as its flags are parsed: either way one line
  (absl's flag parser would print the config's traceback and exit 1)."""
  path = tmp_path / "config.json"
  path.write_text('{"steps": 3, "rollout": {"max_new')
  out = _command(
    module, f"--config={path}", f"--workdir={tmp_path}/run", f"--checkpoint={tmp_path}"
  )
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  (line,) = out.stderr.strip().splitlines()
  assert f"{path}: not a JSON config: " in line and "line 1, column" in line, line
  assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_a_name_is_a_built_in_config_whatever_files_are_in_the_working_directory(tmp_path):
  """--config=tiny is the built-in tiny config even where ./tiny (or ./tiny.py) exists: a file is
  named by a path."""
  planted = "raise SystemExit('planted config ran')\ndef get_config(arg=''):\n  pass\n"
  for name in ("tiny", "tiny.py"):
    (tmp_path / name).write_text(planted)
  out = _command("jaxrl.main", "--config=tiny:test", "--print_config", cwd=tmp_path)
  assert out.returncode == 0 and "planted" not in out.stdout + out.stderr, out.stderr[-2000:]
  assert json.loads(out.stdout)["steps"] == tiny_config("test").steps
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    assert cli.resolve_config("tiny:e3") == os.path.join(ROOT, "configs", "tiny.py:e3")
    assert cli.resolve_config("./tiny") == "./tiny"  # a path is a path
  finally:
    os.chdir(cwd)


def _restored(run, step, abstract):
  ckpt = Checkpointer(os.path.join(run, "checkpoints"), keep=1, async_save=False)
  try:
    return ckpt.restore_params(step, abstract)
  finally:
    ckpt.close()


@pytest.mark.slow
def test_eval_of_the_arithmetic_task_takes_no_benchmark_files(tmp_path):
  """The arithmetic task is evaluated on its own held-out split: ``--benchmarks`` is refused with
  one line, exit 2, before a checkpoint is read."""
  out = _command(
    "jaxrl.eval", "--config=tiny:tools", f"--checkpoint={tmp_path}", "--benchmarks=x.jsonl"
  )
  assert out.returncode == 2, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert "--benchmarks: the arithmetic task is evaluated on its own held-out split" in last
  assert "Traceback" not in out.stderr and not os.listdir(tmp_path)


def test_export_writes_any_checkpoint_in_hf_layout(tmp_path, file_size_limit):
  import transformers

  run = str(tmp_path / "run")
  trainer = Trainer.open(tiny_config(steps=6), run)  # checkpoints at steps 3 and 6
  trainer.run()
  middle, latest = str(tmp_path / "step3"), str(tmp_path / "latest")
  weights.export(os.path.join(run, "checkpoints", "3"), middle)
  weights.export(run, latest)
  shardings = trainer.param_shardings
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    trainer.init_params(),
    shardings,
  )
  for out, step in ((middle, 3), (latest, 6)):
    ours = hf_load.load_hf_checkpoint(out, shardings=shardings)[2]
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(_restored(run, step, abstract))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == tokenizer.eos_token_id == trainer.task.eos_id
    assert transformers.AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
  # The command: a bfloat16 export, and a wrong path is one line with exit 2.
  half = _command(
    "jaxrl.export",
    f"--checkpoint={run}/checkpoints/3",
    f"--out={tmp_path}/bf16",
    "--dtype=bfloat16",
  )
  assert half.returncode == 0, half.stderr
  with safe_open(os.path.join(tmp_path, "bf16", "model.safetensors"), "np") as f:
    assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
  missing = _command("jaxrl.export", f"--checkpoint={tmp_path}/nope", f"--out={tmp_path}/x")
  assert (
    missing.returncode == 2 and "not a run directory" in missing.stderr.strip().splitlines()[-1]
  )
  # An export into the run (it would overwrite the run's config.json) is refused, one line.
  config = (tmp_path / "run" / "config.json").read_bytes()
  for out, where in ((run, "is the run directory"), (f"{run}/export", "is inside the run")):
    into = _command("jaxrl.export", f"--checkpoint={run}", f"--out={out}")
    assert into.returncode == 2 and where in into.stderr.strip().splitlines()[-1], into.stderr
  assert (tmp_path / "run" / "config.json").read_bytes() == config
  assert not os.path.exists(f"{run}/export")
  # A write that fails midway (EFBIG past 4 KiB: the command inherits the limit) leaves the
  # previous export whole: one line, exit 1. No compile cache: its entries would fail to write too.
  before = {f: (tmp_path / "latest" / f).read_bytes() for f in os.listdir(latest)}
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  file_size_limit(4096)
  failed = subprocess.run(
    [sys.executable, "-m", "jaxrl.export", f"--checkpoint={run}/checkpoints/3", f"--out={latest}"],
    cwd=ROOT, env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  file_size_limit(None)
  assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
  line = failed.stderr.strip().splitlines()[-1]
  assert line.startswith("jaxrl-export: error: ") and "File too large" in line, line
  assert "the previous export there is as it was" in line, line
  assert {f: (tmp_path / "latest" / f).read_bytes() for f in os.listdir(latest)} == before
  assert sorted(os.listdir(tmp_path)) == sorted(["run", "step3", "latest", "bf16"])  # no leftovers


def test_export_replaces_only_an_earlier_export(tmp_path):
  """--out is replaced whole once the export is written: a file, or a directory holding something
  other than an HF checkpoint (no config.json), is refused naming it, exit 2, and left as it was."""
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  notes = tmp_path / "notes.txt"
  notes.write_text("mine")
  project = tmp_path / "project"
  project.mkdir()
  (project / "main.py").write_text("print(1)")
  for out, says in ((notes, "is a file"), (project, "holds no HF checkpoint")):
    with pytest.raises(ValueError, match=f"--out={out}: {says}"):
      weights.export(str(tmp_path / "run"), str(out))
  assert notes.read_text() == "mine" and os.listdir(project) == ["main.py"]


# The command modules define their absl flags at import, and two of them define --config: imported
# into one process (pytest collects every test file in each worker) they collide with a
# DuplicateFlagError. What tests use lives in the library modules (run_log, weights, cli).
COMMAND_MODULES = {"jaxrl.main", "jaxrl.eval", "jaxrl.export"} | {
  f"jaxrl.run.{name}" for name in ("train_cli", "eval_cli", "export_cli")
}


def test_no_test_imports_a_command_module():
  import ast

  here = os.path.dirname(__file__)
  offenders = []
  for name in sorted(os.listdir(here)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(here, name)) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
      else:
        continue
      offenders += [f"{name}: {m}" for m in modules if m in COMMAND_MODULES]
  assert not offenders


def test_a_config_json_with_fields_this_jaxrl_removed_still_loads(tmp_path):
  """A run's config.json written by an earlier jaxrl (with vllm.host and vllm.port, which a
  launched server on a Unix socket no longer has) loads, the removed fields dropped."""
  from jaxrl.config import default_configdict, from_configdict, to_dict
  from jaxrl.run import json_config

  old = to_dict(from_configdict(default_configdict()))
  old["vllm"].update(host="127.0.0.1", port=0)
  path = tmp_path / "config.json"
  path.write_text(json.dumps(old))
  cfg = from_configdict(json_config.get_config(str(path)))
  assert cfg.vllm.urls == "" and not hasattr(cfg.vllm, "host")


def test_a_reader_ends_on_sigterm_with_one_line_and_its_cleanup_run(tmp_path):
  """jaxrl-eval / jaxrl-export install this: SIGTERM ends them as Ctrl-C does, their ``finally``
  blocks run (an export's half-written directory is removed), one line, exit 143."""
  script = (
    "import os, signal, sys\n"
    "from jaxrl.run import cli\n"
    "cli.end_on_sigterm('jaxrl-export', 'nothing written')\n"
    "try:\n"
    "  os.kill(os.getpid(), signal.SIGTERM)\n"
    "  signal.pause()\n"
    "finally:\n"
    f"  open({str(tmp_path / 'cleaned')!r}, 'w').close()\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
    text=True, timeout=60,
  )  # fmt: skip
  assert out.returncode == 143 and os.path.exists(tmp_path / "cleaned"), out.stderr
  assert out.stderr.strip() == "jaxrl-export: stopped by SIGTERM; nothing written"
