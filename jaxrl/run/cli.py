"""What the commands (``jaxrl-train``, ``jaxrl-eval``, ``jaxrl-export``) share: ``--config`` by
name or path, a ``--help`` that lists the built-in configs and the command's own flags, and
one-line usage errors (exit 2).

``--config`` takes a config file (``configs/tiny.py[:ARG]``), a built-in config by name
(``tiny:e3``: the files of ``configs/``, shipped in the package as ``jaxrl/configs``), or a JSON
config (a run's ``config.json``, or what ``--print_config`` printed), which reproduces that config.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import sys

from absl import flags

from jaxrl.config import Config

USAGE_ERROR = 2
_JAXRL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JSON_LOADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "json_config.py")


def builtin_dir() -> str:
  """``jaxrl/configs`` in an installed package (the wheel puts ``configs/`` there), else the
  checkout's ``configs/`` beside ``jaxrl/``."""
  for d in (os.path.join(_JAXRL, "configs"), os.path.join(os.path.dirname(_JAXRL), "configs")):
    if os.path.isfile(os.path.join(d, "tiny.py")):
      return d
  raise FileNotFoundError(f"no built-in configs beside {_JAXRL}")


def builtin_configs() -> dict[str, str]:
  """Name → file of each built-in config."""
  d = builtin_dir()
  names = sorted(f[:-3] for f in os.listdir(d) if f.endswith(".py") and not f.startswith("_"))
  return {n: os.path.join(d, f"{n}.py") for n in names}


def resolve_config(spec: str) -> str:
  """A ``--config`` value as ``ml_collections.config_flags`` reads it (``FILE[:ARG]``). A path
  (with a ``/``, or ending in ``.py`` / ``.json``) is a file; anything else is a built-in config's
  name, whatever files the working directory holds: ``--config=tiny`` never runs ``./tiny``."""
  path, sep, arg = spec.partition(":")
  if path.endswith(".json"):
    return f"{_JSON_LOADER}:{os.path.abspath(path)}"
  if os.sep in path or path.endswith(".py"):
    return spec  # config_flags names a missing file
  builtins = builtin_configs()
  if path not in builtins:
    raise FileNotFoundError(
      f"--config={spec}: no built-in config {path!r} (built-in: {', '.join(builtins)}; a file "
      f"is named by a path: ./{path})"
    )
  return builtins[path] + sep + arg


def resolve_argv(argv: list[str]) -> list[str]:
  """``argv`` with its ``--config`` value (``--config=X`` or ``--config X``) resolved."""
  out, i = list(argv), 1
  while i < len(out):
    arg = out[i]
    if arg.startswith("--config="):
      out[i] = "--config=" + resolve_config(arg[len("--config=") :])
    elif arg == "--config" and i + 1 < len(out):
      out[i + 1] = resolve_config(out[i + 1])
      i += 1
    i += 1
  return out


def _load(path: str):
  spec = importlib.util.spec_from_file_location(f"_jaxrl_config_{os.path.basename(path)}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(spec: str):
  """The ConfigDict a ``--config`` value names (no ``--config.*`` overrides)."""
  path, _, arg = resolve_config(spec).partition(":")
  module = _load(path)
  return module.get_config(arg) if arg else module.get_config()


def _first_sentence(doc: str | None) -> str:
  text = " ".join((doc or "").split())
  end = text.find(". ")
  return text if end < 0 else text[: end + 1]


def describe_configs() -> str:
  """One line per built-in config (its docstring's first line) and its variants."""
  lines = []
  for name, path in builtin_configs().items():
    module = _load(path)
    lines.append(f"  {name:<10} {_first_sentence(module.__doc__)}")
    if variants := getattr(module, "VARIANTS", ()):
      lines.append(f"  {'':<10} variants ({name}:A,B): {', '.join(variants)}")
  return "\n".join(lines)


def describe_sections() -> str:
  """One line per config section (its docstring's first line), after the top-level fields."""
  fields = dataclasses.fields(Config)
  top = [f.name for f in fields if not dataclasses.is_dataclass(f.default)]
  lines = [f"  {'(top level)':<14} {', '.join(top)}"]
  for field in fields:
    if dataclasses.is_dataclass(field.default):
      lines.append(f"  {field.name:<14} {_first_sentence(type(field.default).__doc__)}")
  return "\n".join(lines)


def wants_help(argv: list[str]) -> bool:
  return any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:])


def print_help(usage: str, modules, with_configs: bool = True) -> None:
  """The command's usage text, the built-in configs and sections, and its flags."""
  parts = [usage.strip(), ""]
  if with_configs:
    parts += [
      "Built-in configs (--config=NAME[:VARIANT,...]; or a path: configs/tiny.py, a run's config.json):",
      describe_configs(),
      "",
      "Config sections (override any field with --config.SECTION.FIELD=VALUE; --print_config shows "
      "every field):",
      describe_sections(),
      "",
    ]
  parts.append("Flags:")
  for module in modules:
    parts.append(flags.FLAGS.module_help(module))
  print("\n".join(parts))


TERMINATED = 128 + 15  # the shell's code for a process ended by SIGTERM


def end_on_sigterm(command: str, what: str) -> None:
  """A reader command (``jaxrl-eval``, ``jaxrl-export``) ends on SIGTERM as on Ctrl-C: its
  ``finally`` blocks run (an export's half-written directory is removed), one line says what was
  left, exit 143."""

  def handler(signum, frame):
    print(f"\n{command}: stopped by SIGTERM; {what}", file=sys.stderr)
    raise SystemExit(TERMINATED)

  signal.signal(signal.SIGTERM, handler)


def fail(command: str, message) -> None:
  """One line naming the problem, exit 2 (in a multi-process run, every process ends)."""
  # Lazy: jaxrl-train imports this module at start and loads JAX only once its config is read.
  from jaxrl.parallel import distributed

  print(f"{command}: error: {message}", file=sys.stderr)
  distributed.announce_failure(f"{command}: error: {message}", USAGE_ERROR)
  sys.exit(USAGE_ERROR)


def flags_parser(command: str):
  """A ``flags_parser`` for ``app.run``: a bad flag, or a config file that does not load (absl
  prints its traceback and exits 1), is one line naming the problem, exit 2."""

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except (flags.Error, OSError, ValueError, TypeError) as e:
      # A config file's error arrives wrapped with its traceback: its last line names it.
      lines = [line.strip() for line in str(e).splitlines() if line.strip()]
      fail(command, lines[-1] if lines else type(e).__name__)

  return parse


def with_local_checkpoint(cfg, config_only: bool = False):
  """``cfg`` with a Hub ``model.checkpoint`` (``ORG/NAME[@REVISION]``) replaced by its local
  snapshot (process 0 downloads, the others wait); ``config_only``: its config files, for
  ``--plan``. Raises ``HubError`` (one line) offline when it is not cached."""
  from jaxrl.tasks.data import hub  # lazy: it loads JAX (as in ``fail``)

  if hub.model_id(cfg.model.checkpoint) is None:
    return cfg
  files = ("config.json", "generation_config.json") if config_only else hub.MODEL_FILES
  local = hub.model_snapshot(cfg.model.checkpoint, files)
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=local))
