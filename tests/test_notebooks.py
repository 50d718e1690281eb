"""The notebooks execute top to bottom (their cells assert what they show)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["schedulers.ipynb"])
def test_notebook_executes(name):
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  os.environ.setdefault("PYTHONPATH", ROOT)
  # allow_errors: a failing cell is recorded as an error output (and the run goes on) instead of
  # raising out of execute(), so the check below sees every failing cell.
  NotebookClient(
    nb,
    timeout=300,
    kernel_name="python3",
    allow_errors=True,
    resources={"metadata": {"path": ROOT}},
  ).execute()
  code = [c for c in nb.cells if c.cell_type == "code"]
  errors = [
    f"cell {c.execution_count}: {o.get('ename')}: {o.get('evalue')}"
    for c in code
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert not errors, "\n".join(errors)
  assert code and all(c.execution_count is not None for c in code)  # every code cell ran
