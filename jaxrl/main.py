"""``python -m jaxrl.main --config=... --workdir=DIR``: the training CLI (``jaxrl.run.main``)."""

from jaxrl.run.main import run_cli

if __name__ == "__main__":
  run_cli()
