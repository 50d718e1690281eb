"""Removes an attached run's weights directory when the trainer dies (stdlib only).

  python weights_janitor.py TRAINER_PID DIR

With ``vllm.urls`` (servers the user started) no sidecar guard runs beside the trainer, yet its
weight versions (a whole model each, on tmpfs by default) sit in DIR: a trainer killed by SIGKILL
would leave them behind. The janitor runs in its own session (a job-wide kill of the trainer's
process group leaves it standing), polls for the trainer's death the way the sidecar guard does
(re-parented away from TRAINER_PID), then removes DIR. It exits without touching anything when DIR
is gone (the trainer closed its engine) or when asked (SIGTERM).
"""

import os
import shutil
import sys
import time

_POLL_SECONDS = 0.25


def main(trainer: int, directory: str) -> None:
  while os.path.isdir(directory):
    if os.getppid() != trainer:  # re-parented: the trainer process is gone
      shutil.rmtree(directory, ignore_errors=True)
      return
    time.sleep(_POLL_SECONDS)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2])
