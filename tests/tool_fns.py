"""Tools for tests/test_environments.py, loaded by tool workers as `tool_fns:NAME`.

`chaos` misbehaves on command (the call names what to do); any other call is echoed.
"""

import os
import signal
import time


def chaos(call: str):
  """Behaves as the call says: hang (in Python or, like C code, deaf to signals), crash, ..."""
  if call == "hang":
    while True:
      pass
  if call == "deaf":
    # C code does not run Python signal handlers; blocking SIGALRM has the same effect here.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)
  if call == "crash":
    os.kill(os.getpid(), signal.SIGSEGV)
  if call == "raise":
    raise RuntimeError("the tool broke")
  if call == "memory":
    return str(len(bytearray(8 << 30)))  # 8 GiB: over the worker's address-space limit
  if call == "huge":
    return "7" * 1_000_000  # a 1 MB answer
  if call == "number":
    return 42
  return f"echo {call}"
