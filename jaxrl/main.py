"""``python -m jaxrl.main --config=... --workdir=DIR``: the training CLI (``jaxrl.run.train_cli``)."""

from jaxrl.run.train_cli import run_cli

if __name__ == "__main__":
  run_cli()
