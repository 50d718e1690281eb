"""``python -m jaxrl.eval``: evaluate a checkpoint on benchmark files (``jaxrl.run.eval_cli``)."""

from jaxrl.run.eval_cli import run

if __name__ == "__main__":
  run()
