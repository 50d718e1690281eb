"""Custom reward functions for the tests, loaded by workers as `reward_fns:NAME` (the verifier's
`reward.fn`) or by the trainer as `fn:reward_fns:NAME` (a reward term).

`chaos` misbehaves on command, to drive every failure path of the pool with one function: the
response names what to do, anything else is graded by exact match.
"""

import math
import os
import signal
import sys
import threading
import time

NOT_CALLABLE = 3
_calls = 0


def exact(response: str, answer: str) -> float:
  """1.0 iff the stripped strings are equal."""
  return 1.0 if response.strip() == answer.strip() else 0.0


def chaos(response: str, answer: str):
  """Behaves as the response says: hang (in Python or, like C code, deaf to signals), crash, ..."""
  if response == "hang_python":
    while True:
      pass
  if response == "announce_then_hang":
    # Creates the file $JAXRL_TEST_RUNNING, then hangs: a test can act once this answer runs
    # instead of guessing the moment with a timer.
    open(os.environ["JAXRL_TEST_RUNNING"], "w").close()
    while True:
      pass
  if response == "hang_c":
    # C code does not run Python signal handlers; blocking SIGALRM has the same effect here.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)
  if response == "crash":
    os.kill(os.getpid(), signal.SIGSEGV)
  if response == "exit":
    os._exit(3)
  if response == "raise":
    raise ValueError("bad response")
  if response == "memory":
    return float(len(bytearray(8 << 30)))  # 8 GiB: over the worker's address-space limit
  if response == "string":
    return "1.0"
  if response == "nan":
    return math.nan
  return exact(response, answer)


def imported_modules(response: str, answer: str) -> float:
  """1.0 iff the module named by ``response`` is imported in this process."""
  return float(response in sys.modules)


def call_count(response: str, answer: str) -> float:
  """How many times this process has called it, this call included (a pool's warm-up counts)."""
  global _calls
  _calls += 1
  return float(_calls)


def raise_on_odd_length(response: str, answer: str) -> float:
  """Exact match, but raises on a response of odd length: a verifier that fails on some outputs."""
  if len(response.strip()) % 2:
    raise ValueError(f"cannot score {response!r}")
  return exact(response, answer)


def length(response: str, answer: str) -> float:
  """How many characters the function was given: what a pool's ``prepare`` let through."""
  return float(len(response))


# TRL-style batch reward functions (reward.terms' fn:reward_fns:NAME), run in the trainer's process.


def trl_length(prompts, completions, **columns):
  """len(completion) / 10, None for an empty completion (does not apply)."""
  return [len(c) / 10 if c else None for c in completions]


async def trl_async_match(prompts, completions, answer, **columns):
  """1.0 where the completion is the answer, else 0.0: a coroutine function."""
  return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]


def trl_prompt_length(prompts, completions, **columns):
  """len(prompt): what the term was given as the prompt."""
  return [float(len(p)) for p in prompts]


def trl_too_few(prompts, completions, **columns):
  return [0.0] * (len(completions) - 1)


def trl_nan(prompts, completions, **columns):
  return [math.nan] * len(completions)


# Held until a test sets it: trl_blocked's call overruns any time limit until then.
RELEASE = threading.Event()


def trl_blocked(prompts, completions, **columns):
  """1.0 per answer, once ``RELEASE`` is set."""
  RELEASE.wait()
  return [1.0] * len(completions)


def trl_process_id(prompts, completions, **columns):
  """10 x the calling process's index + its pid / 1000 (mod 1) + the answer's index, None for the
  last answer: values that differ between the processes of a run unless one process scores and
  the others take its values."""
  import jax

  base = 10 * jax.process_index() + (os.getpid() % 1000) / 1000
  return [None if i == len(completions) - 1 else base + i for i in range(len(completions))]


# Scoring beside generation (tests/test_scoring_overlap.py): the test's engine sets
# NEXT_BATCH_ASKED when it is asked for step 1's batch and NEXT_BATCH_DONE once it has generated it;
# the first call of the two terms below (step 0's batch) sets SCORING_STARTED and appends to SEEN
# what it found.
NEXT_BATCH_ASKED, NEXT_BATCH_DONE = threading.Event(), threading.Event()
SCORING_STARTED = threading.Event()
SEEN = []
MEET_SECONDS = 120  # a bound for a hang, never a measurement


def trl_waits_for_next_batch(prompts, completions, **columns):
  """1.0 per answer; the first call waits (bounded) for the engine to be asked for the next batch
  and notes whether it was."""
  if not SCORING_STARTED.is_set():
    SCORING_STARTED.set()
    SEEN.append(NEXT_BATCH_ASKED.wait(MEET_SECONDS))
  return [1.0] * len(completions)


def trl_notes_next_batch(prompts, completions, **columns):
  """1.0 per answer; the first call notes, without waiting, whether the engine had been asked for
  the next batch and whether it had generated it."""
  if not SCORING_STARTED.is_set():
    SCORING_STARTED.set()
    SEEN.append((NEXT_BATCH_ASKED.is_set(), NEXT_BATCH_DONE.is_set()))
  return [1.0] * len(completions)
