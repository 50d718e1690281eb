"""The math verifier and the bounded worker pool.

Equivalence is math-verify's (pinned in requirements.txt), checked on a table of answer forms; the
pool is checked on what model outputs can do to a verifier: hang in Python, hang where signals do
not reach (C code), crash, blow memory, or be megabytes long. Every such answer must score 0, be
counted, and be stopped by the pool's bounds: the tests check what each bound leaves behind (the
timeout verdict, answers skipped at the batch deadline, a killed worker replaced, the characters
the reward function was given), never elapsed time, so they hold on a loaded machine. The pool's
own deadlines (and pytest's timeout) keep a broken bound from hanging the suite.
"""

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from run_helpers import wait_until

from jaxrl.tasks import workers
from jaxrl.tasks.rewards.math import MATH_REWARD, MAX_ANSWER_CHARS, WARM_UP, answer_window
from jaxrl.tasks.rewards.pool import RewardFnError, VerifierPool, load_reward_fn

CHAOS = "reward_fns:chaos"  # tests/reward_fns.py; tests/ is on sys.path under pytest
TESTS = os.path.dirname(os.path.abspath(__file__))

# (response, gold, equivalent?)
CASES = [
  # integers: boxed or plain, signs, thousands separators
  (r"The answer is $\boxed{42}$.", "42", True),
  (r"\boxed{-7}", "-7", True),
  (r"\boxed{-7}", "7", False),
  (r"so the total is 42", "42", True),
  (r"The final answer is 12.", "12", True),
  (r"First 12, then 13. Final answer: $13$", "13", True),
  (r"\boxed{1,000}", "1000", True),
  (r"\boxed{1000}", "1,000", True),
  (r"\boxed{41}", "42", False),
  (r"\boxed{2.0}", "2", True),
  (r"\boxed{+5}", "5", True),
  # fractions and decimals
  (r"\boxed{\frac{1}{2}}", "1/2", True),
  (r"\boxed{\dfrac{3}{4}}", "0.75", True),
  (r"\boxed{\tfrac{3}{4}}", r"\frac{3}{4}", True),
  (r"\boxed{0.5}", r"\frac{1}{2}", True),
  (r"\boxed{\frac12}", "0.5", True),
  (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", True),
  (r"\boxed{-\frac{1}{3}}", r"\frac{-1}{3}", True),
  (r"\boxed{\frac{1}{3}}", "0.333333", True),
  (r"\boxed{0.33}", r"\frac{1}{3}", False),
  (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}", False),
  (r"x = 3/4", "3/4", True),
  # percentages
  (r"\boxed{50\%}", "50", True),
  (r"\boxed{50\%}", "0.5", True),
  (r"\boxed{40\%}", "50", False),
  # roots, pi, powers, polynomials
  (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
  (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}2", True),
  (r"\boxed{\sqrt{2}}", r"\sqrt{3}", False),
  (r"\boxed{2\pi}", r"2\pi", True),
  (r"\boxed{\pi}", "3.14159265", True),
  (r"\boxed{\pi}", "3.14", False),
  (r"\boxed{10^{3}}", "1000", True),
  (r"\boxed{2^{10}}", "1024", True),
  (r"\boxed{x^2+2x+1}", "(x+1)^2", True),
  (r"\boxed{x^2+1}", "(x+1)^2", False),
  (r"\boxed{e}", "e", True),
  # sets and tuples
  (r"\boxed{\{1, 2, 3\}}", r"\{3,2,1\}", True),
  (r"\boxed{\{1, 2\}}", r"\{1,2,3\}", False),
  (r"\boxed{1, 2}", "2, 1", True),
  (r"\boxed{(1, 2)}", "(1, 2)", True),
  # intervals
  (r"\boxed{[0, 1)}", "[0,1)", True),
  (r"\boxed{(0, 1]}", "[0,1)", False),
  (r"\boxed{x \in (-\infty, 2)}", r"(-\infty, 2)", True),
  (r"\boxed{(-\infty, 2]}", r"(-\infty, 2)", False),
  (r"\boxed{[1, \infty)}", r"[1,\infty)", True),
  # the last box is graded; gold as a delimited reference; choices
  (r"Draft \boxed{5}, corrected: \boxed{6}", "6", True),
  (r"Draft \boxed{5}, corrected: \boxed{6}", "5", False),
  (r"\boxed{7}", r"The area is $\boxed{7}$.", True),
  (r"\boxed{7}", "$7$", True),
  (r"\boxed{\text{(B)}}", "B", True),
  (r"no number here", "3", False),
]

HANG = r"\boxed{9^{9^{9^{9}}}}"  # sympy evaluates the tower: runs until stopped
# (name, response, gold, stopped by the time limit: True / False / None = either, speed-dependent)
ADVERSARIAL = [
  ("digits_1MB", "1" * 1_000_000, "1", False),
  ("boxed_digits_1MB", "\\boxed{" + "7" * 1_000_000 + "}", "7", False),
  ("power_tower_plain", "The answer is 9^9^9^9", "5", True),
  ("power_tower_boxed", HANG, "5", True),
  ("exponent_tower", r"\boxed{10^{10^{10}}}", "1", True),
  ("factorial", r"\boxed{1000000!}", "1", True),
  ("nested_frac_2000", "\\boxed{" + "\\frac{1}{" * 2000 + "2" + "}" * 2001, "1", None),
  ("nested_frac_2000_inline", "$" + "\\frac{1}{" * 2000 + "2" + "}" * 2000 + "$", "1", None),
  ("nested_parens", "(" * 5000 + "1" + ")" * 5000, "1", None),
  ("broken_latex", r"\boxed{\frac{1}{\sqrt{}}\left( \begin{matrix} ]] \end{pmatrix} }", "1", None),
  ("unicode_junk", "\u202e\x00\ud7ff\U0001f600 ∑∫√ \\boxed{∞²} \ufffd" * 50, "1", None),
  ("empty", "", "1", False),
  ("unclosed_box", r"so the answer is \boxed{3", "3", None),
]

LIMIT_S = 1.0
GRACE_S = 0.5


def math_verifier(**kwargs) -> VerifierPool:
  """The pool as the math task builds it: math-verify on the answer window, warmed up."""
  return VerifierPool(MATH_REWARD, prepare=answer_window, warm_up=WARM_UP, **kwargs)


@pytest.fixture(scope="module")
def math_pool():
  # A looser limit for the table: its slowest case takes ~0.4 s alone, more on a busy CPU.
  with math_verifier(num_workers=2, time_limit_s=4.0) as pool:
    yield pool


@pytest.fixture(scope="module")
def tight_pool():
  # A limit ~100x what a bounded answer's parse needs (milliseconds), so only hangs reach it, even
  # on a loaded CPU; small, so that each hang costs little.
  with math_verifier(num_workers=2, time_limit_s=LIMIT_S, kill_grace_s=GRACE_S) as pool:
    pool.score(["1"], ["1"])  # workers ready: the batch deadline is not spent on start-up
    yield pool


def test_table_of_equivalences(math_pool):
  assert len(CASES) >= 40
  res = math_pool.score([r for r, _, _ in CASES], [g for _, g, _ in CASES])
  assert (res.timeouts, res.errors, res.skipped) == (0, 0, 0), res
  wrong = [(r, g, want) for (r, g, want), got in zip(CASES, res.rewards_R) if got != float(want)]
  assert not wrong, wrong
  assert res.rewards_R.dtype == np.float32 and res.rewards_R.shape == (len(CASES),)


@pytest.mark.parametrize("name,response,gold,stopped", ADVERSARIAL, ids=[a[0] for a in ADVERSARIAL])
def test_adversarial_output_scores_zero_within_limit(tight_pool, name, response, gold, stopped):
  res = tight_pool.score([response], [gold])
  assert res.rewards_R.tolist() == [0.0]
  assert res.errors == 0 and res.skipped == 0, res
  # A hang is answered with the timeout verdict (by the worker's soft timer or the parent's kill,
  # whichever comes first): counted, and out of the update.
  assert res.scored.tolist() == [not res.timeouts], res
  if stopped is not None:
    assert res.timeouts == int(stopped), res
  assert res.truncated == answer_window(response)[1]


def test_the_reward_function_is_given_the_answer_window_only():
  """The size guard, counted instead of timed: whatever a response's size, the function is given
  at most MAX_ANSWER_CHARS characters of it (``reward_fns:length`` returns how many it got), so a
  1 MB answer costs what a 1000-character one does."""
  responses = [r for _, r, _, _ in ADVERSARIAL]
  with VerifierPool(
    "reward_fns:length", prepare=answer_window, num_workers=1, time_limit_s=30.0
  ) as pool:
    res = pool.score(responses, [""] * len(responses))
  assert res.scored.all() and res.timeouts == res.errors == 0, res
  given = dict(zip((a[0] for a in ADVERSARIAL), res.rewards_R.tolist()))
  assert max(given.values()) <= MAX_ANSWER_CHARS, given
  for name in ("digits_1MB", "boxed_digits_1MB"):  # cut to the window, and counted as cut
    assert given[name] == MAX_ANSWER_CHARS, given
  assert res.truncated == sum(answer_window(r)[1] for r in responses) >= 2


def test_many_hanging_answers_cost_one_batch_deadline():
  """A hang holds its worker for at least the limit (the soft timer counts wall time), so within
  a batch deadline of d seconds 2 workers finish at most 2·ceil(d / limit) hangs: the rest must be
  skipped. That count, not a clock, shows the deadline cut the batch; a slower machine only skips
  more. The good answers go first and parse in milliseconds, far inside the limit."""
  limit, grace, n_hang = LIMIT_S, GRACE_S, 30
  with math_verifier(
    num_workers=2, time_limit_s=limit, kill_grace_s=grace, batch_time_limit_s=limit + grace
  ) as pool:
    pool.score(["1"], ["1"])
    responses = [r"\boxed{\frac{1}{2}}", r"\boxed{3}"] + [HANG] * n_hang
    res = pool.score(responses, ["0.5", "3"] + ["5"] * n_hang)
    assert res.rewards_R.tolist() == [1.0, 1.0] + [0.0] * n_hang
    assert res.scored.tolist() == [True, True] + [False] * n_hang  # out of the update
    assert res.timeouts + res.skipped == n_hang and res.timeouts >= 2 and res.errors == 0, res
    assert res.skipped >= n_hang - 2 * 2, res  # at most 2 hangs per worker in 1.5 limits
    # The pool is whole again: a normal batch scores normally.
    res = pool.score([r"\boxed{2}"] * 4, ["2"] * 4)
    assert res.rewards_R.tolist() == [1.0] * 4 and res.timeouts == res.skipped == 0

    # The default deadline: 1 + 0.5 + 0.25 * ceil(12 / 2) = 3 s, so at most 3 hangs per worker
    # (without it, 6 limits per worker).
    pool.batch_time_limit_s = None
    res = pool.score([HANG] * 12, ["5"] * 12)
    assert res.rewards_R.tolist() == [0.0] * 12
    assert res.timeouts + res.skipped == 12 and res.skipped >= 12 - 2 * 3, res


def test_signal_deaf_hang_is_killed_and_worker_replaced():
  # A hang in C code ignores the worker's soft timer: only the parent's kill stops it. No batch
  # deadline in the way (the Python hang starts after the deaf ones are killed), and a wide grace
  # so that a kill never overtakes the Python hang's soft timeout on a busy CPU.
  with VerifierPool(
    CHAOS, num_workers=2, time_limit_s=LIMIT_S, kill_grace_s=1.0, batch_time_limit_s=30.0
  ) as pool:
    pool.score(["a"], ["a"])
    res = pool.score(
      ["a", "hang_c", "b", "hang_c", "hang_python", "c"], ["a", "x", "b", "x", "x", "c"]
    )
    assert res.rewards_R.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert res.scored.tolist() == [True, False, True, False, False, True]
    assert (res.timeouts, res.errors, res.skipped) == (3, 0, 0), res
    assert pool.restarts == 2  # the two deaf hangs were killed; the Python hang's worker lived on
    res = pool.score(["d", "e"], ["d", "x"])
    assert res.rewards_R.tolist() == [1.0, 0.0] and res.timeouts == res.errors == 0


def test_crashes_and_bad_returns_are_errors():
  with VerifierPool(CHAOS, num_workers=2, time_limit_s=2.0, memory_limit_mb=1024) as pool:
    res = pool.score(["crash", "a", "exit", "b"], ["x", "a", "x", "b"])
    assert res.rewards_R.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert res.scored.tolist() == [False, True, False, True]
    assert (res.timeouts, res.errors) == (0, 2) and "worker died" in res.first_error, res
    assert pool.restarts == 2
    res = pool.score(["raise", "string", "nan", "memory", "ok"], ["x", "x", "x", "x", "ok"])
    assert res.rewards_R.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert res.scored.tolist() == [False] * 4 + [True]
    assert (res.timeouts, res.errors) == (0, 4), res
    assert res.first_error == "ValueError: bad response"
    assert res.metrics() == {
      "verify_timeouts": 0.0,
      "verify_errors": 4.0,
      "verify_skipped": 0.0,
      "verify_truncated": 0.0,
    }


def test_interrupted_batch_leaves_no_stale_result(tmp_path, monkeypatch):
  """Ctrl-C while a worker is busy: it is replaced, so its late "timeout" cannot reach the next
  batch. The moment is waited for, not guessed with a timer: the answer has started (it creates a
  file) and the pool has marked its worker busy; then a thread interrupts the main thread (a
  signal sent to the thread itself, so that its wait on the workers wakes)."""
  running = tmp_path / "running"
  monkeypatch.setenv("JAXRL_TEST_RUNNING", str(running))  # the workers inherit it
  main = threading.main_thread().ident

  def interrupt(signum, frame):
    raise KeyboardInterrupt

  with VerifierPool(CHAOS, num_workers=1, time_limit_s=30.0, kill_grace_s=GRACE_S) as pool:
    pool.score(["a"], ["a"])

    def when_busy():
      wait_until(running.exists, 60, "the answer running")
      wait_until(lambda: pool._workers[0].task is not None, 60, "the worker marked busy")
      signal.pthread_kill(main, signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, interrupt)
    try:
      threading.Thread(target=when_busy, daemon=True).start()
      with pytest.raises(KeyboardInterrupt):
        pool.score(["announce_then_hang"], ["x"])
    finally:
      signal.signal(signal.SIGUSR2, previous)
    assert pool.restarts == 1  # the busy worker went; its late "timeout" cannot reach batch 2
    res = pool.score(["b", "c"], ["b", "c"])
    assert res.rewards_R.tolist() == [1.0, 1.0] and res.timeouts == res.errors == 0, res


def test_an_interrupt_just_after_an_answer_is_sent_leaves_no_stale_result():
  """The window the test above waits past, hit on purpose: Ctrl-C right after the answer went to
  the worker (the send itself raises it), before the pool's bookkeeping."""
  with VerifierPool(CHAOS, num_workers=1, time_limit_s=1.0, kill_grace_s=GRACE_S) as pool:
    pool.score(["a"], ["a"])
    conn = pool._workers[0].conn
    send = conn.send

    def send_then_interrupt(message):
      send(message)
      raise KeyboardInterrupt

    conn.send = send_then_interrupt
    with pytest.raises(KeyboardInterrupt):
      pool.score(["hang_python"], ["x"])
    conn.send = send
    assert pool.restarts == 1
    res = pool.score(["b", "c"], ["b", "c"])
    assert res.rewards_R.tolist() == [1.0, 1.0] and res.timeouts == res.errors == 0, res


def test_bad_gold_is_an_error_not_a_crash(math_pool):
  res = math_pool.score([r"\boxed{1}", r"\boxed{1}", r"\boxed{1}"], ["", "$$", "1"])
  assert res.rewards_R.tolist() == [0.0, 0.0, 1.0]
  assert res.errors == 2 and res.timeouts == 0
  assert "the gold answer is empty" in res.first_error


def test_pool_is_reused_and_closes():
  pool = math_verifier(num_workers=2, time_limit_s=2.0)
  with pool:
    pool.score([r"\boxed{1}"], ["1"])
    procs = [w.proc for w in pool._workers]
    for _ in range(3):
      res = pool.score([r"\boxed{1}", r"\boxed{2}", "3"], ["1", "2", "4"])
      assert res.rewards_R.tolist() == [1.0, 1.0, 0.0]
    assert [w.proc for w in pool._workers] == procs and pool.restarts == 0
    assert pool.score([], []).rewards_R.shape == (0,)
  assert all(p.poll() is not None for p in procs)
  pool.close()  # idempotent
  with pytest.raises(RuntimeError, match="after close"):
    pool.score(["1"], ["1"])


def test_workers_are_clean_interpreters_that_die_with_the_parent():
  # The parent here has whatever pytest imported; a worker has only the reward function's imports.
  import jax  # noqa: F401 — present in the parent, must not be in the worker

  with VerifierPool("reward_fns:imported_modules", num_workers=1, time_limit_s=4.0) as pool:
    res = pool.score(["jax", "jaxrl.tasks.rewards.pool", "pytest"], ["", "", ""])
    assert res.rewards_R.tolist() == [0.0, 1.0, 0.0]
    assert os.getsid(pool._workers[0].proc.pid) != os.getsid(0)  # out of reach of Ctrl-C
  # A parent killed with SIGKILL (no atexit, no close) takes its workers along.
  code = (
    "import sys; sys.path[:0] = %r; from jaxrl.tasks.rewards.pool import VerifierPool; "
    "p = VerifierPool(%r, num_workers=2); p.score(['1'], ['1']); "
    "print(*[w.proc.pid for w in p._workers], flush=True); "
    "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
  ) % ([os.path.dirname(TESTS)], MATH_REWARD)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  pids = [int(p) for p in out.stdout.split()]
  assert len(pids) == 2, out.stderr
  wait_until(lambda: not any(_alive(p) for p in pids), 60, "every worker gone")


def _alive(pid: int) -> bool:
  """True while ``pid`` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_bad_arguments_raise(math_pool):
  with pytest.raises(ValueError, match="2 responses but 1 answers"):
    math_pool.score(["1", "2"], ["1"])
  with pytest.raises(TypeError, match="item 1: .* got NoneType"):
    math_pool.score(["1", None], ["1", "2"])
  with pytest.raises(ValueError, match="num_workers must be positive"):
    math_verifier(num_workers=0)
  with pytest.raises(ValueError, match="memory_limit_mb must be positive or None"):
    math_verifier(memory_limit_mb=0)
  with pytest.raises(ValueError, match=r"warm_up must be a \(response, answer\) pair"):
    VerifierPool("reward_fns:exact", warm_up=("x",))


def test_prepare_and_warm_up_hooks():
  # The pool is task-agnostic: what it sends to the function and how a worker warms up are the
  # caller's. Without hooks, the function gets the whole response and no warm-up call.
  def first_3(response: str) -> tuple[str, bool]:
    return response[:3], len(response) > 3

  with VerifierPool("reward_fns:exact", num_workers=1, prepare=first_3) as pool:
    res = pool.score(["abcdef", "ab", "abc"], ["abc", "ab", "abcdef"])
    assert res.rewards_R.tolist() == [1.0, 1.0, 0.0] and res.truncated == 1, res
  with VerifierPool("reward_fns:exact", num_workers=1) as pool:
    res = pool.score(["abcdef"], ["abc"])
    assert res.rewards_R.tolist() == [0.0] and res.truncated == 0, res
  with VerifierPool("reward_fns:call_count", num_workers=1, warm_up=("x", "y")) as pool:
    assert pool.score(["a"], ["b"]).rewards_R.tolist() == [2.0]  # the warm-up was call 1
  with VerifierPool("reward_fns:call_count", num_workers=1) as pool:
    assert pool.score(["a"], ["b"]).rewards_R.tolist() == [1.0]


def test_answer_window():
  assert answer_window(r"a \boxed{1} b \boxed{22} c") == (r"\boxed{22} c", False)
  assert answer_window(r"\fbox{3}") == (r"\fbox{3}", False)
  assert answer_window(r"\boxed{\{1,2\}}") == (r"\boxed{\{1,2\}}", False)
  assert answer_window(r"\boxed{3") == (r"\boxed{3", True)
  assert answer_window("x" * 5000 + "42") == (("x" * 5000 + "42")[-MAX_ANSWER_CHARS:], True)
  assert answer_window("short", max_chars=5) == ("short", False)
  window, cut = answer_window("\\boxed{" + "9" * 2000 + "}")
  assert len(window) == MAX_ANSWER_CHARS and cut
  with pytest.raises(ValueError, match="max_chars must be positive"):
    answer_window("1", max_chars=0)


def test_load_reward_fn(tmp_path, monkeypatch):
  assert load_reward_fn(MATH_REWARD)(r"\boxed{2}", "2") == 1.0
  assert load_reward_fn("reward_fns:exact")("a ", "a") == 1.0
  assert load_reward_fn("os.path:join.__call__")("a", "b") == os.path.join("a", "b")
  for spec in ("reward_fns", "a:b:c", ":exact", "reward_fns:"):
    with pytest.raises(RewardFnError, match="not of the form 'module:function'"):
      load_reward_fn(spec)
  with pytest.raises(RewardFnError, match="module 'no_such_module_xyz' not found"):
    load_reward_fn("no_such_module_xyz:fn")
  with pytest.raises(RewardFnError, match="module 'jaxrl.no_such_mod' not found"):
    load_reward_fn("jaxrl.no_such_mod:fn")
  with pytest.raises(RewardFnError, match="has no attribute 'nope'"):
    load_reward_fn("reward_fns:nope")
  with pytest.raises(RewardFnError, match="is a int, not callable"):
    load_reward_fn("reward_fns:NOT_CALLABLE")
  (tmp_path / "reward_broken_dep.py").write_text("import no_such_dependency_xyz\n")
  (tmp_path / "reward_raises.py").write_text("raise RuntimeError('config missing')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(RewardFnError, match="importing 'reward_broken_dep' failed: No module named"):
    load_reward_fn("reward_broken_dep:fn")
  with pytest.raises(RewardFnError, match="raised RuntimeError: config missing"):
    load_reward_fn("reward_raises:fn")
  with pytest.raises(RewardFnError, match="has no attribute 'nope'"):
    VerifierPool("reward_fns:nope", num_workers=1)


@pytest.mark.parametrize("deaths", [2, 10])
def test_a_worker_that_dies_while_starting_is_retried_then_a_clear_error(
  tmp_path, monkeypatch, deaths
):
  """Workers that die before saying ready are replaced, up to a bound in a row; past it, an error
  that says so (a spec or memory limit that can never start a worker)."""
  counter = tmp_path / "deaths"
  counter.write_text(str(deaths))
  monkeypatch.setenv("JAXRL_TEST_START_DEATHS", str(counter))
  monkeypatch.setenv("JAXRL_TEST_PARENT", str(os.getpid()))
  with VerifierPool("dies_at_start:exact", num_workers=1, time_limit_s=2.0) as pool:
    if deaths <= workers._START_RETRIES:
      res = pool.score(["a", "b"], ["a", "x"])
      assert res.rewards_R.tolist() == [1.0, 0.0] and res.scored.all(), res
      assert pool.restarts == deaths
    else:
      with pytest.raises(RuntimeError, match="died while starting 4 times in a row"):
        pool.score(["a"], ["a"])
