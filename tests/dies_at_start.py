"""A reward module whose import kills the verifier workers that load it while a counter file (named
by ``$JAXRL_TEST_START_DEATHS``) holds a positive count, decrementing it: transient start failures.
The test process itself (``$JAXRL_TEST_PARENT``) imports it normally."""

import os

_counter = os.environ.get("JAXRL_TEST_START_DEATHS", "")
if _counter and str(os.getpid()) != os.environ.get("JAXRL_TEST_PARENT"):
  with open(_counter) as f:
    left = int(f.read() or 0)
  if left > 0:
    with open(_counter, "w") as f:
      f.write(str(left - 1))
    os._exit(7)


def exact(response: str, answer: str) -> float:
  return 1.0 if response.strip() == answer.strip() else 0.0
