"""Checkpoints, Hub ids and dataset specs come from outside: a safetensors header, an index's file
names, a dataset's config and split names are refused, with a line naming the file or field, when
they would read past the file, outside the checkpoint or snapshot directory, or a split other
than the one asked for."""

import json
import shutil
import struct

import hf_fixtures
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl.nn import hf_load
from jaxrl.tasks.data import hub
from jaxrl.tasks.data.datasets import Fields, load_questions

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  """A tiny Qwen2 checkpoint saved as several safetensors shards with an index."""
  path = hf_fixtures.make_tiny_hf("qwen2", False, tmp_path_factory.mktemp("ckpt") / "qwen2")
  assert (path / INDEX).exists()
  return path


def _copy(sharded, tmp_path):
  out = tmp_path / "ckpt"
  shutil.copytree(sharded, out)
  return out


def _single_file(sharded, tmp_path, tensors: bytes):
  """A checkpoint directory with the fixture's config.json and ``tensors`` as model.safetensors."""
  out = tmp_path / "single"
  out.mkdir()
  shutil.copy(sharded / "config.json", out / "config.json")
  (out / "model.safetensors").write_bytes(tensors)
  return out


@pytest.mark.parametrize("length", [2**63, 2**40, 2**64 - 1])
def test_a_header_length_past_the_file_is_refused(sharded, tmp_path, length):
  path = _single_file(sharded, tmp_path, struct.pack("<Q", length) + b"{}")
  with pytest.raises(ValueError, match="model.safetensors.*header of .* bytes.*file has 10"):
    hf_load.load_hf_checkpoint(path)


def test_tensor_offsets_past_the_data_are_refused(sharded, tmp_path):
  header = json.dumps(
    {"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [1 << 40, (1 << 40) + 16]}}
  ).encode()
  path = _single_file(sharded, tmp_path, struct.pack("<Q", len(header)) + header + bytes(16))
  with pytest.raises(ValueError, match="'model.norm.weight'.*data_offsets.*16 bytes of data"):
    hf_load.load_hf_checkpoint(path)


def _point_first_entry_at(ckpt, name: str) -> str:
  """Rewrite the index so its first tensor lives in the file ``name``; returns that tensor."""
  index = json.loads((ckpt / INDEX).read_text())
  tensor, shard = sorted(index["weight_map"].items())[0]
  index["weight_map"] = {t: (name if t == tensor else f) for t, f in index["weight_map"].items()}
  (ckpt / INDEX).write_text(json.dumps(index))
  return shard


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_file_names_outside_the_checkpoint_are_refused(sharded, tmp_path, where):
  ckpt = _copy(sharded, tmp_path)
  outside = tmp_path / "outside.safetensors"
  name = "../outside.safetensors" if where == "parent" else str(outside)
  shard = _point_first_entry_at(ckpt, name)
  shutil.copy(ckpt / shard, outside)  # a loadable file: only the check can stop the read
  with pytest.raises(ValueError, match=f"{INDEX}: .*{name!s}.* outside the checkpoint directory"):
    hf_load.load_hf_checkpoint(ckpt)


def test_shards_linked_from_outside_as_in_the_hub_cache_still_load(sharded, tmp_path):
  """huggingface_hub's snapshots hold links into ``blobs/``: names inside the directory whose
  files live elsewhere are fine."""
  snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
  snapshot.mkdir(parents=True)
  blobs.mkdir()
  for i, f in enumerate(sorted(sharded.iterdir())):
    shutil.copy(f, blobs / str(i))
    (snapshot / f.name).symlink_to(f"../../blobs/{i}")
  cfg, _, params = hf_load.load_hf_checkpoint(snapshot)
  assert cfg.num_layers == 2 and params["embed_tokens"].shape == (160, 64)


def test_a_malformed_index_names_the_file(sharded, tmp_path):
  ckpt = _copy(sharded, tmp_path)
  (ckpt / INDEX).write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
  with pytest.raises(ValueError, match=f"{INDEX}: .*weight_map"):
    hf_load.load_hf_checkpoint(ckpt)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\udcff"])
def test_a_broken_config_json_names_the_file(sharded, tmp_path, text):
  ckpt = _copy(sharded, tmp_path)
  (ckpt / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
  with pytest.raises(ValueError, match=f"{ckpt / 'config.json'}: (not valid JSON|expected a JSON)"):
    hf_load.load_hf_checkpoint(ckpt)


# Hub datasets: a cache laid out as huggingface_hub leaves it.


@pytest.fixture
def cache(tmp_path, monkeypatch):
  from huggingface_hub import constants

  path = tmp_path / "hub-cache"
  path.mkdir()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  return path


def _rows(tag, n):
  return [{"problem": f"{tag}{i}", "answer": str(i)} for i in range(n)]


def _dataset(cache, files: dict):
  """acme/math in ``cache`` with ``files`` (path in the snapshot → rows); its snapshot directory."""
  root = cache / "datasets--acme--math"
  snapshot = root / "snapshots" / ("a" * 40)
  for name, rows in files.items():
    (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), snapshot / name)
  (root / "refs").mkdir(exist_ok=True)
  (root / "refs" / "main").write_text("a" * 40)
  return snapshot


def _load(spec, **kw):
  return load_questions(spec, Fields(), **kw)[0].questions


@pytest.mark.parametrize("config", ["../../secret", "..", "/ABS", "a/b"])
def test_a_dataset_config_cannot_leave_the_snapshot(cache, tmp_path, config):
  snapshot = _dataset(cache, {"data/train-00000-of-00001.parquet": _rows("t", 1)})
  # Parquet files where each config would lead, so only the check stops the read.
  target = (snapshot / config) if not config.startswith("/") else tmp_path / config.lstrip("/")
  target = target.resolve()
  target.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(_rows("x", 1)), target / "train-00000-of-00001.parquet")
  spec = f"hf:acme/math:{tmp_path / 'ABS'}" if config.startswith("/") else f"hf:acme/math:{config}"
  with pytest.raises(hub.HubError, match="config name"):
    _load(spec)


@pytest.mark.parametrize("split", ["../train", "train/..", "tr ain", "*"])
def test_a_dataset_split_must_be_a_split_name(split):
  with pytest.raises(hub.HubError, match="split name"):
    hub.dataset_id(f"hf:acme/math::{split}")


def test_a_split_is_matched_by_its_whole_name(cache):
  _dataset(
    cache,
    {
      "data/train-00000-of-00001.parquet": _rows("t", 2),
      "data/train_sft-00000-of-00001.parquet": _rows("s", 3),
      "data/trainx.parquet": _rows("x", 1),
      "data/test.parquet": _rows("e", 1),
    },
  )
  assert _load("hf:acme/math") == ["t0", "t1"]
  assert _load("hf:acme/math::train_sft") == ["s0", "s1", "s2"]
  assert _load("hf:acme/math::test") == ["e0"]


def test_a_local_parquet_directory_matches_the_split_by_name(tmp_path):
  for name, rows in (
    ("train-00000-of-00001.parquet", _rows("t", 1)),
    ("train_sft-00000-of-00001.parquet", _rows("s", 2)),
  ):
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
  assert _load(str(tmp_path)) == ["t0"]
  assert _load(str(tmp_path), split="train_sft") == ["s0", "s1"]


def test_a_local_parquet_directory_of_other_splits_is_refused_not_mixed(tmp_path):
  """No file of the asked split and files of several other names: an error naming them, never
  every file (a test split's rows would train); one unnamed split's parts are its rows."""
  for name, rows in (("train_0.parquet", _rows("t", 1)), ("test_0.parquet", _rows("x", 1))):
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
  with pytest.raises(ValueError, match="test_0"):
    _load(str(tmp_path))
  parts = tmp_path / "parts"
  parts.mkdir()
  for i in range(2):
    pq.write_table(pa.Table.from_pylist(_rows(f"p{i}", 1)), parts / f"part-{i:05d}.parquet")
  assert sorted(_load(str(parts))) == ["p00", "p10"]


def test_a_revision_cannot_climb_out_of_the_cache():
  for spec in ("acme/tiny@../../x", "acme/tiny@refs/../../x", "acme/tiny@/abs"):
    with pytest.raises(hub.HubError, match="revision"):
      hub.model_id(spec)
  assert hub.model_id("acme/tiny@refs/pr/1") == ("acme/tiny", "refs/pr/1")


@pytest.mark.parametrize("spec", ["./acme/tiny", "../acme/tiny", "/no/such/R1", "~/acme/tiny"])
def test_a_missing_path_is_an_error_not_a_hub_id(tmp_path, monkeypatch, spec):
  monkeypatch.chdir(tmp_path)
  assert hub.model_id(spec) is None
  with pytest.raises(hub.HubError, match="no such local checkpoint directory"):
    hub.model_snapshot(spec)


def test_an_org_that_is_a_local_file_makes_a_path(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "acme").write_text("not a directory")
  assert hub.model_id("acme/tiny") is None
  with pytest.raises(hub.HubError, match="'acme/tiny': no such local checkpoint directory"):
    hub.model_snapshot("acme/tiny")
