"""bench/gpu_check.py, the GPU host's one command, kept from rotting: its ``--smoke`` run (every
stage at tiny shapes on this CPU) writes each stage's JSON line and table; a stage that fails or
runs out of time is recorded and ends alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_check  # noqa: E402

RUN = {"run": "2026-01-01T00:00:00+00:00", "commit": "abc", "smoke": True}
RUN["repeats"] = 2


@pytest.mark.slow  # about 3 minutes on 2 cores: seven stages, each compiling in its own process
def test_smoke_run_writes_every_stage(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
  cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--smoke", "--out", tmp_path]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(tmp_path / "gpu.jsonl") as f:
    records = {r["stage"]: r for r in map(json.loads, f)}
  assert set(records) == {"env", 1, 2, 3, 4, 5, 6, 7}
  for stage, r in records.items():
    assert "error" not in r, (stage, r["error"])
  assert records["env"]["matmul_peak_flops"] > 0 and records["env"]["copy_bandwidth"] > 0
  # The device checks are the test suite's own, so on this CPU they pass.
  assert records[1]["ok"], records[1]["checks"]
  assert records[2]["held_out"]["after"]["pass@1"] >= 0
  assert records[3]["sizes"]["tiny"]["ratio_vs_torch"] > 0
  assert records[4]["ratio"] > 0 and records[6]["peak_bytes"] > 0
  assert records[7]["ratio_vs_padded"] > 0 and records[7]["ratio_vs_torch"] > 0
  md = (tmp_path / "gpu.md").read_text()
  sections = md.split("\n## ")[1:]
  assert [s.split(".")[0] for s in sections] == ["1", "2", "3", "4", "5", "6", "7"]
  for section in sections:
    assert "\n|---" in section, section  # each stage's table
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no inputs left behind


def test_a_stage_past_its_timeout_ends_with_its_workers():
  start = time.perf_counter()
  # a child that starts a grandchild: both belong to the group that is killed
  code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
  code += "'import time; time.sleep(60)']); time.sleep(60)"
  why = gpu_check._run_group([sys.executable, "-c", code], timeout=2)
  assert why == "timed out after 2 s"
  assert time.perf_counter() - start < 30


def test_failed_and_partial_stages_render():
  records = [
    {"stage": "env", "error": "exit code 1"},
    {"stage": 3, "name": gpu_check.STAGES[3], "error": "timed out after 60 s", "rows": 8,
     "prompt": 64, "response": 512,
     "sizes": {"0.5b": {"jaxrl": {"error": "OOM"}, "torch": {"skipped": "why"}}}},
    {"stage": 6, "name": gpu_check.STAGES[6], "error": "exit code -9"},
  ]  # fmt: skip
  md = gpu_check.render(RUN, records)
  assert "Environment report failed" in md
  assert "**Error**: `timed out after 60 s`" in md and "error: `OOM`" in md
  assert "## 6. 7B LoRA update vs --plan" in md and "**Error**: `exit code -9`" in md
