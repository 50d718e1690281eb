"""``python -m jaxrl.eval``: evaluate a checkpoint on benchmark files (``jaxrl.run.eval_main``)."""

from jaxrl.run.eval_main import run

if __name__ == "__main__":
  run()
