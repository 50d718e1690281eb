"""Runs under the sidecar's own Python (stdlib only): starts the vLLM server as its child and makes
sure the server's whole process group goes away with it.

  python sidecar_guard.py TRAINER_PID SERVER_ARGV...

The guard leads its own process group (the launcher starts it in a new session) and asks the kernel
for SIGTERM when the trainer dies, however it dies (PR_SET_PDEATHSIG, Linux). On SIGTERM — from the
trainer's ``stop`` or from the kernel — it terminates the server, waits, then SIGKILLs the group:
vLLM's engine-core and worker processes would otherwise outlive a killed API server. When the
server exits by itself (a crash), the guard kills what is left of the group and exits with its code.
"""
import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
_GRACE_SECONDS = 10


def main() -> int:
  trainer_pid, argv = int(sys.argv[1]), sys.argv[2:]
  try:
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
  except OSError:
    pass
  if os.getppid() != trainer_pid:  # the trainer died before prctl took effect
    return 1
  server = subprocess.Popen(argv)

  def shutdown(signum, frame):
    server.terminate()
    try:
      server.wait(timeout=_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
      pass
    os.killpg(0, signal.SIGKILL)  # the group: engine core, workers, and this guard

  signal.signal(signal.SIGTERM, shutdown)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's Ctrl-C is the trainer's to handle
  code = server.wait()
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  try:
    os.killpg(0, signal.SIGKILL)
  finally:
    return code


if __name__ == "__main__":
  sys.exit(main())
