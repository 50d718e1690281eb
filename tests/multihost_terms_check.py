"""Run as one rank of a 2-process jax.distributed job (1 CPU device each): ``reward.terms`` with the
verifier, a callable whose values are its process's (``reward_fns.trl_process_id``), a reward
model whose rows span both processes' devices and a judge at JUDGE_URL score one fixed batch. The
verifier's verdicts differ too, as a time limit can pass on one process and not the other: process
1 did not score answer 0.

  python multihost_terms_check.py PORT RANK RM_DIR JUDGE_URL OUT_DIR  # writes OUT_DIR/rankN.*
"""

import json
import os
import sys

import numpy as np

from jaxrl.config import default_configdict, from_configdict
from jaxrl.parallel import distributed, sharding
from jaxrl.run.components import task_sections
from jaxrl.tasks.rewards.pool import VerifyResult
from jaxrl.tasks.rewards.terms import build_terms

PROMPTS = ["What is 2+3?"] * 3 + ["What is 6*7?"] * 3
COMPLETIONS = ["5", "The answer is 5.", "six", "42", "\\boxed{42}", ""]
ANSWERS = ["5"] * 3 + ["42"] * 3
GROUPS_R = np.array([0, 0, 0, 1, 1, 1])
TERMS = "verifier, fn:reward_fns:trl_process_id*0.5, model:{}*0.25, judge:{}*0.125"


def main(port: str, rank: str, rm_dir: str, judge_url: str, out_dir: str) -> None:
  rank = int(rank)
  distributed.initialize(f"127.0.0.1:{port}", 2, rank, cpu_devices=1)
  mesh = sharding.make_mesh(2, 1, 1)
  cd = default_configdict()
  cd.reward.terms, cd.reward.model_rows = TERMS.format(rm_dir, judge_url), 4
  terms = build_terms(task_sections(from_configdict(cd)), mesh)
  scored_R = np.array([rank == 0, 1, 1, 1, 1, 1], bool)
  rewards_R = np.array([1, 1, 0, 1, 1, 0], np.float32) * scored_R
  verified = VerifyResult(rewards_R, int(rank == 1), 0, 0, 0, None, scored_R)
  got = terms.score(PROMPTS, COMPLETIONS, ANSWERS, verified, GROUPS_R, 2)
  np.savez(os.path.join(out_dir, f"rank{rank}.npz"), rewards_R=got.rewards_R, kept_R=got.kept_R)
  with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"metrics": got.metrics, "pid": os.getpid()}, f)
  print("ok", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
