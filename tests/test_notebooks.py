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
  NotebookClient(
    nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}
  ).execute()
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert not errors
