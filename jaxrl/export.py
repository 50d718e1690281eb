"""``python -m jaxrl.export``: a run's checkpoint in HF layout (``jaxrl.run.export_cli``)."""

from jaxrl.run.export_cli import run

if __name__ == "__main__":
  run()
