"""Reward terms on several processes: 2 real ``jax.distributed`` processes (CPU, Gloo) score one
batch with the verifier, a callable, a reward model and a judge, each term's values differing
between the processes, computed across both or asked by one, and hold the same rewards and term
metrics: process 0's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hf_fixtures  # noqa: E402
import math_fixtures  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from judge_fixtures import ChatServer, chat  # noqa: E402
from multihost_helpers import free_port  # noqa: E402
from multihost_terms_check import COMPLETIONS  # noqa: E402
from run_helpers import ROOT  # noqa: E402

pytestmark = pytest.mark.slow


def test_two_processes_score_reward_terms_alike(tmp_path):
  tok = math_fixtures.make_tokenizer("chatml")
  rm_dir = hf_fixtures.make_tiny_hf_reward_model("qwen2", tmp_path / "rm", vocab_size=len(tok))
  tok.save_pretrained(rm_dir)
  judge = ChatServer(lambda prompt, tries, release: chat("Fine. Score: 7"))
  port, script = free_port(), "tests/multihost_terms_check.py"
  procs = [
    subprocess.Popen(
      [sys.executable, script, str(port), str(r), str(rm_dir), judge.url, str(tmp_path)],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for r in range(2)
  ]
  try:
    for p in procs:
      out, err = p.communicate(timeout=300)
      assert p.returncode == 0 and out.splitlines()[-1] == "ok", err[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    judge.close()
  ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
  (zero, one) = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
  for key in ("rewards_R", "kept_R"):
    np.testing.assert_array_equal(ranks[1][key], ranks[0][key], err_msg=key)
  assert one["metrics"] == zero["metrics"]
  m = zero["metrics"]
  # the verifier: process 0 scored answer 0 (process 1 did not): it is kept everywhere
  assert ranks[0]["kept_R"].all()
  assert m["reward_term_verifier_n"] == len(COMPLETIONS)
  # the callable ran on process 0: its values (index 0, its pid), not process 1's
  values = [(zero["pid"] % 1000) / 1000 + i for i in range(len(COMPLETIONS) - 1)]
  assert m["reward_term_fn_trl_process_id_sum"] == pytest.approx(sum(values), rel=1e-6)
  assert m["reward_term_fn_trl_process_id_n"] == len(COMPLETIONS) - 1
  assert m["reward_term_fn_trl_process_id_failed"] == 0
  # the reward model scored every answer, over both processes' devices
  assert m["reward_term_model_n"] == len(COMPLETIONS)
  assert np.isfinite(m["reward_term_model_sum"]) and m["reward_model_truncated"] == 0
  # the judge was asked once per answer, by process 0: its verdicts are every process's
  assert len(judge.chats()) == len(COMPLETIONS)
  assert m["reward_term_judge_n"] == len(COMPLETIONS) and m["reward_term_judge_failed"] == 0
  assert m["reward_term_judge_sum"] == pytest.approx(0.7 * len(COMPLETIONS), rel=1e-6)
  # the combined reward (sum-then-normalise) of process 0's values
  want = 4 + 0.5 * sum(values) + 0.25 * m["reward_term_model_sum"] + 0.125 * 0.7 * 6
  assert ranks[0]["rewards_R"].sum() == pytest.approx(want, rel=1e-5)
