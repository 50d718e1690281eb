"""Hugging Face Hub ids, resolved to local snapshots through ``huggingface_hub``'s cache: a model
(``model.checkpoint=ORG/NAME[@REVISION]``) and datasets (``data.train=hf:ORG/NAME[:CONFIG][:SPLIT]``).

Process 0 downloads first while the others wait; then they resolve through their own host's
cache (filled by process 0 when ``HF_HUB_CACHE`` is on a shared filesystem). Offline
(``HF_HUB_OFFLINE=1``, as ``make`` sets it, or no network) a snapshot that is not in the cache is
a ``HubError``: one line saying what to download and where.
"""

from __future__ import annotations

import dataclasses
import os
import re

from jaxrl.parallel import distributed

_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_MODEL_ID = re.compile(rf"^(?P<repo>{_REPO})(@(?P<revision>[\w./-]+))?$")
# What a checkpoint needs: its config, weights, tokenizer and generation config.
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")


class HubError(ValueError):
  """A Hub id that cannot be resolved to a local snapshot (offline and not cached, unknown id)."""


@dataclasses.dataclass(frozen=True)
class DatasetId:
  repo: str
  config: str = ""
  split: str = ""  # "" = the caller's split (train / test)


def model_id(spec: str) -> tuple[str, str | None] | None:
  """(repo, revision) when ``spec`` is a Hub model id rather than a local path: ``ORG/NAME``
  that is not on disk and whose ``ORG`` is not a local directory (``models/X`` with a
  ``models/`` here is a missing local checkpoint, not a Hub id)."""
  if not spec or os.path.exists(spec) or os.path.isdir(spec.split("/")[0]):
    return None
  match = _MODEL_ID.match(spec)
  return (match["repo"], match["revision"]) if match else None


def dataset_id(spec: str) -> DatasetId | None:
  """``hf:ORG/NAME[:CONFIG][:SPLIT]`` → its parts; None for a local path."""
  if not spec.startswith("hf:"):
    return None
  repo, *rest = spec[3:].split(":")
  if not re.fullmatch(_REPO, repo) or len(rest) > 2:
    raise HubError(f"{spec!r}: expected hf:ORG/NAME[:CONFIG][:SPLIT]")
  return DatasetId(repo, *rest)


def _cache() -> str:
  from huggingface_hub import constants

  return constants.HF_HUB_CACHE


def snapshot(repo: str, repo_type: str, revision: str | None = None, allow=None) -> str:
  """The local directory of ``repo`` at ``revision``: from the cache, or downloaded by process 0
  while the others wait."""
  from huggingface_hub import snapshot_download
  from huggingface_hub.errors import HfHubHTTPError

  def fetch():
    return snapshot_download(repo, repo_type=repo_type, revision=revision, allow_patterns=allow)

  try:
    return distributed.main_first(fetch)
  except (OSError, HfHubHTTPError, ValueError) as e:
    at = f"@{revision}" if revision else ""
    kind = "--repo-type dataset " if repo_type == "dataset" else ""
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise HubError(
      f"{repo}{at}: not in the Hugging Face cache {_cache()} and cannot be downloaded "
      f"({reason}); download it where there is network: huggingface-cli download {kind}{repo}"
      f"{' --revision ' + revision if revision else ''} (with HF_HUB_CACHE={_cache()}), "
      "or give a local path"
    ) from None


def model_snapshot(spec: str, files=MODEL_FILES) -> str:
  """``ORG/NAME[@REVISION]`` → its local snapshot directory holding ``files`` (patterns; a local
  path is returned as is)."""
  parsed = model_id(spec)
  if parsed is None:
    return spec
  return snapshot(parsed[0], "model", parsed[1], list(files))


def dataset_snapshot(spec: DatasetId) -> str:
  """The directory of the dataset's parquet files for its config: ``CONFIG/`` when named (the
  Hub's layout of a dataset with several configs), else ``data/`` (the default config), else the
  snapshot itself."""
  root = snapshot(spec.repo, "dataset")
  default = ["data", ""]
  named = [spec.config] if spec.config else []
  for sub in named + (default if spec.config in ("", "default") else []):
    if os.path.isdir(os.path.join(root, sub)):
      return os.path.join(root, sub)
  raise HubError(f"hf:{spec.repo}: no config {spec.config!r} in its snapshot {root}")
