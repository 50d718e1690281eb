"""``python -m jaxrl.export``: a run's checkpoint in HF layout (``jaxrl.run.export_main``)."""

from jaxrl.run.export_main import run

if __name__ == "__main__":
  run()
