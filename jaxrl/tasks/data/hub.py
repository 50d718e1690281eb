"""Hugging Face Hub ids, resolved to local snapshots through ``huggingface_hub``'s cache: a model
(``model.checkpoint=ORG/NAME[@REVISION]``) and datasets (``data.train=hf:ORG/NAME[:CONFIG][:SPLIT]``).

Process 0 downloads first while the others wait; then they resolve through their own host's
cache (filled by process 0 when ``HF_HUB_CACHE`` is on a shared filesystem). Offline
(``HF_HUB_OFFLINE=1``, as ``make`` sets it, or no network) a snapshot that is not in the cache is
a ``HubError``: one line saying what to download and where.

A spec written as a path (``/``, ``./``, ``../``, ``~``, or whose first component exists here) is
never a Hub id: missing, it is an error naming it. Revisions, dataset configs and splits are
names, never paths: a ``..`` or ``/`` that would leave the cache or the snapshot is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re

from jaxrl.parallel import distributed

_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_MODEL_ID = re.compile(rf"^(?P<repo>{_REPO})(@(?P<revision>[\w./-]+))?$")
# A dataset's config is one directory of its snapshot; a split is the name its parquet files start
# with (``SPLIT-00000-of-00001.parquet``), by the datasets library's rule for split names.
_CONFIG_NAME = re.compile(r"\w[\w.-]*")
_SPLIT_NAME = re.compile(r"\w+(\.\w+)*")
# What a checkpoint needs: its config, weights, tokenizer and generation config.
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")


class HubError(ValueError):
  """A Hub id that cannot be resolved to a local snapshot (offline and not cached, unknown id, a
  config, split or revision that is not a name), or a model path that does not exist."""


@dataclasses.dataclass(frozen=True)
class DatasetId:
  repo: str
  config: str = ""
  split: str = ""  # "" = the caller's split (train / test)


def _looks_like_path(spec: str) -> bool:
  """Whether ``spec`` is written as a local path: absolute, ``./``, ``../``, ``~``, or its first
  component exists here (``models/X`` with a ``models/`` here is a path, not a Hub id)."""
  first = spec.split("/")[0]
  return (
    spec.startswith(("/", "./", "../", "~"))
    or spec in (".", "..")
    or (bool(first) and os.path.exists(first))  # spec itself, or its first directory
  )


def model_id(spec: str) -> tuple[str, str | None] | None:
  """(repo, revision) when ``spec`` is a Hub model id ``ORG/NAME[@REVISION]`` rather than a local
  path (on disk, or written as one: ``_looks_like_path``); a revision that climbs out of the cache
  (``..``, a leading ``/``) is a ``HubError``."""
  if not spec or _looks_like_path(spec):
    return None
  match = _MODEL_ID.match(spec)
  if not match:
    return None
  revision = match["revision"]
  if revision is not None and any(part in ("", ".", "..") for part in revision.split("/")):
    raise HubError(f"{spec!r}: revision {revision!r} is not a branch, tag or commit name")
  return match["repo"], revision


def split_name(split: str, spec: str) -> str:
  """``split`` when it is a split name (words of letters, digits and ``_`` joined by ``.``: the
  datasets library's rule), else a ``HubError`` naming ``spec``."""
  if not _SPLIT_NAME.fullmatch(split):
    raise HubError(f"{spec!r}: {split!r} is not a split name (letters, digits, _ and .)")
  return split


def _config_name(config: str, spec: str) -> str:
  if config and not _CONFIG_NAME.fullmatch(config):
    raise HubError(
      f"{spec!r}: {config!r} is not a config name (letters, digits, _ . -: one directory of the "
      "dataset's snapshot)"
    )
  return config


def dataset_id(spec: str) -> DatasetId | None:
  """``hf:ORG/NAME[:CONFIG][:SPLIT]`` → its parts (the config and split checked to be names);
  None for a local path."""
  if not spec.startswith("hf:"):
    return None
  repo, *rest = spec[3:].split(":")
  if not re.fullmatch(_REPO, repo) or len(rest) > 2:
    raise HubError(f"{spec!r}: expected hf:ORG/NAME[:CONFIG][:SPLIT]")
  config, split = (*rest, "", "")[:2]
  if split:
    split_name(split, spec)
  return DatasetId(repo, _config_name(config, spec), split)


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
  """``ORG/NAME[@REVISION]`` → its local snapshot directory holding ``files`` (patterns); a local
  path is returned as is, and a missing one is a ``HubError``."""
  parsed = model_id(spec)
  if parsed is None:
    if not os.path.exists(spec):
      tilde = " (~ is not expanded: give the full path)" if spec.startswith("~") else ""
      raise HubError(
        f"{spec!r}: no such local checkpoint directory{tilde}; a Hub id is ORG/NAME[@REVISION]"
      )
    return spec
  return snapshot(parsed[0], "model", parsed[1], list(files))


def dataset_snapshot(spec: DatasetId) -> str:
  """The directory of the dataset's parquet files for its config: ``CONFIG/`` when named (the
  Hub's layout of a dataset with several configs), else ``data/`` (the default config), else the
  snapshot itself."""
  _config_name(spec.config, f"hf:{spec.repo}:{spec.config}")
  root = snapshot(spec.repo, "dataset")
  default = ["data", ""]
  named = [spec.config] if spec.config else []
  for sub in named + (default if spec.config in ("", "default") else []):
    if os.path.isdir(os.path.join(root, sub)):
      return os.path.join(root, sub)
  raise HubError(f"hf:{spec.repo}: no config {spec.config!r} in its snapshot {root}")
