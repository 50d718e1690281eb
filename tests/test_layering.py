"""The package layers (``jaxrl/__init__.py``): a module imports only from its own layer and the
layers below it, and no two modules import each other, directly or around a circle. Imports inside
functions count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxrl"

# Lowest first. The top-level entry points and §0 re-exports sit above everything.
LAYERS = (
  ("jaxrl.types", "jaxrl.fields", "jaxrl.private_dirs", "jaxrl.rng"),
  ("jaxrl.parallel",),
  ("jaxrl.nn",),
  ("jaxrl.rl",),
  ("jaxrl.methods",),
  ("jaxrl.tasks",),
  ("jaxrl.rollout",),
  ("jaxrl.workdir",),
  ("jaxrl.config", "jaxrl.run"),
  (
    "jaxrl.main",
    "jaxrl.paper_configs",
    "jaxrl.eval",
    "jaxrl.export",
    "jaxrl.allocation",
    "jaxrl.schedules",
    "jaxrl.losses",
    "jaxrl.metrics",
  ),
)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
  for i, prefixes in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return i
  if module == "jaxrl":
    return 0
  raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and jaxrl/__init__.py)")


def imports_of(path: pathlib.Path) -> set[str]:
  """Every jaxrl module ``path`` imports (``from jaxrl.x import y`` counts jaxrl.x.y when that is
  a module, else jaxrl.x)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("jaxrl")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxrl"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        found.add(sub if sub in MODULES else node.module)
  return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {m: imports_of(p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
  for module in MODULES:
    layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_from_a_higher_layer(module):
  mine = layer_of(module)
  higher = sorted(m for m in GRAPH[module] if layer_of(m) > mine)
  assert not higher, f"{module} (layer {mine}) imports from higher layers: {higher}"


def test_no_import_cycles():
  """Depth-first search over module imports; package __init__ files are skipped as targets
  (importing ``jaxrl.nn`` for ``jaxrl.nn.model`` runs the package's docstring-only __init__)."""
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(GRAPH.get(m, ())):
      if n not in MODULES or MODULES[n].name == "__init__.py":
        continue
      if state.get(n) == 1:
        raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n) :] + [n]))
      if n not in state:
        visit(n)
    stack.pop()
    state[m] = 2

  for m in sorted(MODULES):
    if m not in state:
      visit(m)


def test_a_cycle_and_an_upward_import_are_found(monkeypatch):
  """The checks themselves: a toy graph with a cycle and a rollout module importing run/."""
  monkeypatch.setitem(GRAPH, "jaxrl.rollout.toy", {"jaxrl.run.train"})
  with pytest.raises(AssertionError, match="higher layers"):
    test_no_import_from_a_higher_layer("jaxrl.rollout.toy")
  monkeypatch.setitem(MODULES, "jaxrl.rl.toy_a", PACKAGE / "rl" / "toy_a.py")
  monkeypatch.setitem(MODULES, "jaxrl.rl.toy_b", PACKAGE / "rl" / "toy_b.py")
  monkeypatch.setitem(GRAPH, "jaxrl.rl.toy_a", {"jaxrl.rl.toy_b"})
  monkeypatch.setitem(GRAPH, "jaxrl.rl.toy_b", {"jaxrl.rl.toy_a"})
  with pytest.raises(AssertionError, match="import cycle: jaxrl.rl.toy_a -> jaxrl.rl.toy_b"):
    test_no_import_cycles()


def test_no_test_module_imports_another():
  """Shared test code lives in helper modules (``run_helpers``, ``rounding``, ...): importing a test
  module runs its module-level setup and collects its tests twice."""
  tests = ROOT / "tests"
  found = []
  for path in sorted(tests.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
        found.append(f"{path.name}: from {node.module} import ...")
      elif isinstance(node, ast.Import):
        found += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("test_")]
  assert not found, found
