"""``python -m jaxrl.eval``: evaluate a checkpoint on benchmark files or a built-in task's held-out
split (the flags: ``jaxrl.run.eval_cli``; the work: ``jaxrl.run.checkpoint_eval``)."""

from jaxrl.run.eval_cli import run

if __name__ == "__main__":
  run()
