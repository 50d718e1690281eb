"""Hub ids, resolved offline through a Hugging Face cache the test lays out as ``huggingface_hub``
leaves it after a download (``refs/<revision>`` → ``snapshots/<sha>``): a model
(``model.checkpoint=ORG/NAME[@REVISION]``) and datasets (``hf:ORG/NAME[:CONFIG][:SPLIT]``); a
missing one is one line, exit 2."""

import dataclasses
import os
import shutil
import subprocess
import sys

import math_fixtures
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from run_helpers import ROOT, tiny_config

from jaxrl.config import parse_mixture
from jaxrl.nn import arch
from jaxrl.run import cli
from jaxrl.tasks.data import hub
from jaxrl.tasks.data.datasets import Fields, load_questions


def _lay_out(cache, kind: str, repo: str, files: dict, revision="main", sha="a" * 40):
  """``files``: path in the repo → a local file to copy, or rows to write as parquet."""
  root = cache / f"{kind}s--{repo.replace('/', '--')}"
  snapshot = root / "snapshots" / sha
  for name, source in files.items():
    (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
    if isinstance(source, list):
      pq.write_table(pa.Table.from_pylist(source), snapshot / name)
    else:
      shutil.copy(source, snapshot / name)
  (root / "refs").mkdir(exist_ok=True)
  (root / "refs" / revision).write_text(sha)
  return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
  from huggingface_hub import constants

  path = tmp_path / "hub-cache"
  path.mkdir()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network here anyway
  return path


def test_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert hub.model_id("acme/tiny") == ("acme/tiny", None)
  assert hub.model_id("acme/tiny@v1.0") == ("acme/tiny", "v1.0")
  (tmp_path / "models").mkdir()
  assert hub.model_id("models/R1") is None  # a missing checkpoint under a local directory
  assert hub.model_id("/abs/R1") is None and hub.model_id("") is None
  assert hub.dataset_id("hf:acme/math:hard:test") == hub.DatasetId("acme/math", "hard", "test")
  assert hub.dataset_id("hf:acme/math::test") == hub.DatasetId("acme/math", "", "test")
  assert hub.dataset_id("data/train.jsonl") is None
  with pytest.raises(hub.HubError, match="hf:ORG/NAME"):
    hub.dataset_id("hf:no-org")
  assert parse_mixture("hf:acme/math::test:2,hf:acme/more,local.jsonl:3", "data.train") == (
    ("hf:acme/math::test", 2.0),
    ("hf:acme/more", 1.0),
    ("local.jsonl", 3.0),
  )


def test_a_hub_model_resolves_to_its_cached_snapshot(cache, tmp_path):
  ckpt = math_fixtures.make_checkpoint(tmp_path / "ckpt")
  files = {p.name: p for p in ckpt.iterdir() if p.is_file()}
  main = _lay_out(cache, "model", "acme/tiny-math", files)
  tagged = _lay_out(cache, "model", "acme/tiny-math", files, revision="v2", sha="b" * 40)
  cfg = tiny_config("test")
  for spec, snapshot in (("acme/tiny-math", main), ("acme/tiny-math@v2", tagged)):
    with_id = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=spec))
    resolved = cli.with_local_checkpoint(with_id)
    assert resolved.model.checkpoint == str(snapshot)
    assert arch.model_config(resolved.model).vocab_size > 0  # the snapshot's config.json, read
  with pytest.raises(hub.HubError, match="huggingface-cli download acme/nothing"):
    hub.model_snapshot("acme/nothing")


def test_a_hub_dataset_reads_the_split_and_config_asked_for(cache):
  rows = lambda tag, n: [{"problem": f"{tag}{i}", "answer": str(i)} for i in range(n)]  # noqa: E731
  _lay_out(
    cache,
    "dataset",
    "acme/math",
    {
      "data/train-00000-of-00002.parquet": rows("t", 2),
      "data/train-00001-of-00002.parquet": rows("u", 1),
      "data/test-00000-of-00001.parquet": rows("e", 2),
      "hard/train-00000-of-00001.parquet": rows("h", 3),
    },
  )
  load = lambda spec, **kw: load_questions(spec, Fields(), **kw)[0].questions  # noqa: E731
  assert load("hf:acme/math") == ["t0", "t1", "u0"]
  assert load("hf:acme/math", split="test") == ["e0", "e1"]  # the caller's split (data.split)
  assert load("hf:acme/math::test") == ["e0", "e1"]  # the spec's own
  assert load("hf:acme/math:hard") == ["h0", "h1", "h2"]
  with pytest.raises(ValueError, match="no 'validation' split .*found: \\['test', 'train'\\]"):
    load("hf:acme/math::validation")
  with pytest.raises(hub.HubError, match="--repo-type dataset acme/none"):
    load("hf:acme/none")


def _main(*flags, cache):
  env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
  return subprocess.run(
    [sys.executable, "-m", "jaxrl.main", *flags],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_missing_ids_are_one_line_and_exit_2(tmp_path):
  model = _main(
    "--config=tiny:test",
    f"--workdir={tmp_path}/a",
    "--config.model.checkpoint=acme/gone@v3",
    cache=tmp_path,
  )
  assert model.returncode == 2 and "Traceback" not in model.stderr, model.stderr[-2000:]
  line = model.stderr.strip().splitlines()[-1]
  assert "acme/gone@v3" in line and "huggingface-cli download acme/gone --revision v3" in line
  assert not os.path.exists(tmp_path / "a")  # nothing written
