"""The config a run's state depends on: what every checkpoint records of it, which fields a resume
may change, and the keys of the run's caches.

Every checkpoint records the resolved config (``record``): every field, a Hub model as
``ORG/NAME@COMMIT``, and the commit of each Hub dataset and of each Hub model a reward term loads
(a reward model, the judge the run serves). A resume whose config differs from its
checkpoint's in any field outside ``SAFE`` (another seed, learning rate, loss, staleness, dataset,
or a Hub id that now resolves to another commit) is refused by name (``check_resume``,
``ChangedConfig``: exit 2), never continued as a mix of two runs.

The run's caches are keyed the same way, by the fields they are computed from: the SFT warm start
(``sft_key``) and each held-out evaluation (``eval_key``, with the evaluated params' fingerprint).
A cache whose key differs from the run's is computed again, and ``describe`` says which fields
differ. (The run's other caches key themselves: the tokenizer's by its vocabulary's version, which
no config field changes; JAX's compiled programs by the program, the devices and the compiler.)
"""

from __future__ import annotations

import json
import logging
import os
import re

from jaxrl.config import Config, to_dict
from jaxrl.fields import ConfigError
from jaxrl.run import json_config
from jaxrl.run.phases import run_phases
from jaxrl.tasks.data import hub
from jaxrl.tasks.mixture import parse_mixture
from jaxrl.tasks.term_specs import SIDECAR, parse_terms
from jaxrl.workdir.checkpoint import Checkpointer

log = logging.getLogger(__name__)

# What a resume may change: how long, how often, where and how fast the run does things, never what
# a step computes from its checkpoint. A dotted prefix covers the fields under it.
SAFE = (
  # The run's length: going on past the first run's end is what a resume is for. The schedules
  # over the run's length (E3's annealing start and t_max, the clip's entropy schedule) follow the
  # new length from the resumed step on.
  "steps",
  # Where compiled programs are kept: the programs are the same either way.
  "compile_cache",
  # Where metrics go, what is printed, logged as text or profiled: nothing a step computes.
  "log",
  # How often, how many and how checkpoints are written, and how long a write may take: not what
  # they hold.
  "checkpoint",
  # Held-out evaluation (its cadence, samples, temperature, k of pass@k): training never reads it,
  # and every evaluation cache is keyed by these fields (``eval_key``).
  "eval",
  # The verifier pool's size: each answer is scored alike by any worker, within the same limits.
  "reward.workers",
  # How a judge's requests are sent, waited for and retried, and where its API key is read: the
  # same judge gives the same verdicts.
  "reward.judge_workers",
  "reward.judge_timeout",
  "reward.judge_retries",
  "reward.judge_backoff",
  "reward.judge_api_key_env",
  # How long a callable term may take: a limit, not what it computes.
  "reward.fn_time_limit",
  # The tool pool's size: each call is answered alike by any worker, within the same limits.
  "tool.workers",
  # Measurements at fixed params on their own random stream: no step reads them.
  "diagnostics",
  # How many consecutive skipped non-finite updates stop the run: a guard, not the update.
  "optim.max_nonfinite_steps",
  # Named only in an error message (where to download model.checkpoint from).
  "model.hub_id",
  # Where and how a vLLM sidecar is started or reached, and how long and how often its requests
  # are waited for and retried: the same server serves the same completions.
  "vllm.python",
  "vllm.urls",
  "vllm.cpus",
  "vllm.weights_dir",
  "vllm.startup_timeout",
  "vllm.request_timeout",
  "vllm.retries",
  "vllm.max_restarts",
)

# What the SFT warm start is computed from: the initial params (seed, architecture or checkpoint),
# its corpus (task, data, prompt and response lengths), its optimizer, the log-prob chunk of its
# loss and the mesh it ran on. Not ``model.lora``: the cache holds the base alone, shared by a full
# fine-tuning and a LoRA run of the same seed.
SFT_FIELDS = (
  "seed",
  "model",
  "task",
  "data",
  "sft",
  "rollout.max_new_tokens",
  "rollout.max_observation_tokens",  # a tool task's corpus holds observations, cut at this
  "loss.logprob_chunk",
  "mesh",
)
_SFT_IGNORED = ("model.lora", "model.hub_id")

# What a held-out evaluation of given params depends on besides them: the held-out set and its
# prompts, the sampler (engine, lengths, turns, top-p, the questions per call, the server), the
# samples, temperature and k, the verifier and the tools, and the seed of its random keys.
EVAL_FIELDS = (
  "seed",
  "model",
  "task",
  "data",
  "reward",
  "tool",
  "eval.num_samples",
  "eval.temperature",
  "eval.ks",
  "batch_questions",
  "rollout.engine",
  "rollout.group_size",
  "rollout.max_new_tokens",
  "rollout.max_turns",
  "rollout.max_turn_tokens",
  "rollout.max_observation_tokens",
  "rollout.top_p",
  "vllm",
)

PARAMS = "params fingerprint"  # an evaluation key's entry for the evaluated params themselves
REVISION = "revision of "  # the field name of a Hub dataset's commit: "revision of hf:ORG/NAME"
_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--([^/]+?)--([^/]+)/snapshots/([^/]+)")


class ChangedConfig(ConfigError):
  """A resume whose config differs from its checkpoint's in fields a resume may not change."""

  def __init__(self, where: str, step: int, changed: list[tuple[str, object, object]]):
    pin = _pin_hint(changed)
    ValueError.__init__(
      self,
      f"resuming {where} from step {step} with another config: {describe(changed)}. A resumed "
      "run keeps the config its checkpoint was trained with: set these back, or start a new "
      f"--workdir{pin} (a resume may change {', '.join(SAFE)})",
    )
    self.field = changed[0][0]
    self.fields = [name for name, _, _ in changed]


def _pin_hint(changed: list[tuple[str, object, object]]) -> str:
  """How to resume on the recorded commit of a Hub model whose id now resolves to another."""
  for name, old, _ in changed:
    parsed = hub.model_id(old) if name == "model.checkpoint" and isinstance(old, str) else None
    if parsed is not None and parsed[1]:
      return f" (--config.model.checkpoint={old} resumes on the checkpoint's commit)"
    kind, _, repo = name.removeprefix(REVISION).partition(":")
    if name.startswith(REVISION) and kind == "judge" and old:
      return f" (--config.reward.judge_model={repo}@{old} resumes on the checkpoint's commit)"
    if name.startswith(REVISION) and kind == "model" and old:
      return f" (model:{repo}@{old} in reward.terms resumes on the checkpoint's commit)"
  return ""


def snapshot_revision(path: str) -> str | None:
  """``ORG/NAME@COMMIT`` of a Hugging Face cache snapshot directory (or a path inside one);
  None for any other path."""
  match = _SNAPSHOT.search(os.path.abspath(path)) if path else None
  return f"{match[2]}/{match[3]}@{match[4]}" if match else None


def _hub_datasets(cfg: Config) -> list[str]:
  if cfg.task.name != "math":  # the built-in task reads no dataset
    return []
  specs = [name for name, _ in parse_mixture(cfg.data.train, "data.train")] + [cfg.data.heldout]
  return sorted({s for s in specs if s.startswith("hf:")})


def _term_hub_models(terms: str, judge_model: str) -> list[tuple[str, str]]:
  """(revision key, Hub id) of each Hub model the reward terms load: a reward model
  (``model:ORG/NAME[@REVISION]``, key ``model:ORG/NAME``) and the judge the run serves
  (``judge:sidecar``'s ``reward.judge_model``, key ``judge:ORG/NAME``). A ``judge:URL``'s
  ``reward.judge_model`` is the name its server serves, which the run does not load."""
  out = []
  for term in parse_terms(terms):
    if term.kind == "model":
      source = term.source
    elif term.kind == "judge" and term.source == SIDECAR:
      source = judge_model
    else:
      continue
    if (parsed := hub.model_id(source)) is not None:
      out.append((f"{term.kind}:{parsed[0]}", source))
  return out


def _unpinned(fields: dict) -> dict:
  """``reward.terms`` and a served judge's ``reward.judge_model`` with each Hub model's
  ``@REVISION`` left out: the commit it resolves to is compared instead (``revision of
  model:ORG/NAME``, ``revision of judge:ORG/NAME``), so naming the recorded commit is no change."""
  terms, judge = fields["reward.terms"], fields["reward.judge_model"]
  try:
    models = _term_hub_models(terms, judge)
  except ConfigError:  # not a config this jaxrl reads: compared as written
    return fields
  parts = terms.split(",")
  for key, source in models:
    repo, revision = hub.model_id(source)
    if revision is None:
      continue
    if key.startswith("judge:"):
      fields = dict(fields, **{"reward.judge_model": repo})
    else:  # the term's own text, spacing and weight kept
      parts = [p.replace(source, repo) if p.strip().startswith("model") else p for p in parts]
  return dict(fields, **{"reward.terms": ",".join(parts)})


def record(cfg: Config) -> dict:
  """What a checkpoint records of its run's config: every field, and the commit each Hub id
  resolves to (a Hub model's ``model.checkpoint`` is already its local snapshot, whose directory is
  the commit; a Hub dataset and the Hub models of the reward terms, a reward model's and the
  served judge's, are resolved here, from the cache, as the task and the terms load them)."""
  revisions = {}
  if model := snapshot_revision(cfg.model.checkpoint):
    revisions["model.checkpoint"] = model
  for spec in _hub_datasets(cfg):
    found = snapshot_revision(hub.dataset_snapshot(hub.dataset_id(spec)))
    if found is not None:
      revisions[spec] = found.rpartition("@")[2]
  for key, source in _term_hub_models(cfg.reward.terms, cfg.reward.judge_model):
    found = snapshot_revision(hub.model_snapshot(source))  # as the terms load it
    if found is not None:
      revisions[key] = found.rpartition("@")[2]
  # Where the phases start follows from other fields (`steps`, which a resume may change, among
  # them): recorded as resolved, so that a resume cannot move a boundary the run has crossed.
  starts = [p.start for p in run_phases(cfg)]
  return {"config": to_dict(cfg), "revisions": revisions, "phase_starts": starts}


def comparable(rec: dict) -> dict:
  """A record as one flat dict of this jaxrl's dotted fields: a field it lacks (written before the
  field existed) at its default, one this jaxrl no longer has left out, a Hub model as
  ``ORG/NAME@COMMIT`` whatever the cache's path, each Hub dataset's commit as
  ``revision of hf:ORG/NAME``, a reward term's Hub model's as ``revision of model:ORG/NAME`` (or
  ``judge:ORG/NAME``) with the term's own ``@REVISION`` left out (``_unpinned``)."""
  fields = json_config.flatten(to_dict(Config()))
  fields.update(
    {k: v for k, v in json_config.flatten(rec.get("config", {})).items() if k in fields}
  )
  fields = _unpinned(fields)
  revisions = dict(rec.get("revisions", {}))
  model = revisions.pop("model.checkpoint", None) or snapshot_revision(fields["model.checkpoint"])
  if model:
    fields["model.checkpoint"] = model
  fields.update({REVISION + spec: commit for spec, commit in revisions.items()})
  return fields


def _covered(name: str, prefixes) -> bool:
  return any(name == p or name.startswith(p + ".") for p in prefixes)


def select(fields: dict, include, exclude=()) -> dict:
  """The fields under the prefixes ``include`` and not under ``exclude``."""
  return {k: v for k, v in fields.items() if _covered(k, include) and not _covered(k, exclude)}


def changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
  """(field, old value, new value) for each field that differs between two flat dicts; a Hub
  dataset's commit only where both know it (a record of an older jaxrl has none)."""
  out = []
  for name in sorted(old.keys() | new.keys()):
    if name.startswith(REVISION) and not (name in old and name in new):
      continue
    if old.get(name) != new.get(name):
      out.append((name, old.get(name), new.get(name)))
  return out


def describe(changed: list[tuple[str, object, object]]) -> str:
  """``"seed 0 → 1, optim.learning_rate 0.0003 → 0.001"``."""
  return ", ".join(f"{name} {old!r} → {new!r}" for name, old, new in changed)


def resume_changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
  """The changes of config from a checkpoint's record to this run's that a resume may not make."""
  old, new = comparable(saved), comparable(now)
  out = [c for c in changes(old, new) if not _covered(c[0], SAFE)]
  starts = saved.get("phase_starts"), now.get("phase_starts")
  if None not in starts and starts[0] != starts[1]:  # e.g. `steps` moved the annealing phase
    out.append(("phase starts (from steps and the schedules)", starts[0], starts[1]))
  return out


def check_resume(now: dict, directory: str) -> int | None:
  """Refuse (``ChangedConfig``) to resume from the latest checkpoint in ``directory`` with a
  config that differs from the one it records in a field a resume may not change; returns that
  checkpoint's step (None: nothing to resume). A checkpoint that records no config (an older
  jaxrl wrote it) is compared with the run's ``config.json``, its last start's config."""
  reader = Checkpointer.reader(directory)
  try:
    if not reader.all_steps():
      return None
    # The newest whose metadata reads (the trainer falls back past a damaged one, logging it).
    step, saved = reader.newest_readable(reader.recorded_config)
  finally:
    reader.close()
  if saved is None:
    saved = _config_json(os.path.dirname(directory), step)
  if saved is not None and (changed := resume_changes(saved, now)):
    raise ChangedConfig(directory, step, changed)
  return step


def _config_json(workdir: str, step: int) -> dict | None:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    log.warning(
      "checkpoint %d records no config and there is no %s: the resume is unchecked", step, path
    )
    return None
  log.warning("checkpoint %d records no config: the resume is checked against %s", step, path)
  with open(path) as f:
    flat = json_config.drop_removed(json_config.flatten(json.load(f)), path)
  return {"config": json_config.unflatten(flat)}


def sft_key(rec: dict) -> dict:
  """The fields the SFT warm start is computed from (its cache's key)."""
  return select(comparable(rec), SFT_FIELDS, _SFT_IGNORED)


def eval_key(rec: dict, after_rl: bool, params: str) -> dict:
  """The key of a held-out evaluation's cache: the fields its params were computed from (the SFT
  warm start's, or after RL every field a resume keeps), those of the evaluation itself, and the
  params' own fingerprint (``params``, under ``PARAMS``): the fields name what changed, the
  fingerprint tells apart params they do not pin (steps trained again after a resume that changed
  ``steps``, which the schedules follow)."""
  fields = comparable(rec)
  if after_rl:
    origin = {k: v for k, v in fields.items() if not _covered(k, SAFE)}
  else:
    origin = sft_key(rec)
  evaluation = select(fields, EVAL_FIELDS, [s for s in SAFE if s != "eval"])
  return {**origin, **evaluation, PARAMS: params}


def cache_changes(saved: dict | None, key: dict) -> str | None:
  """Why a cache keyed ``saved`` is not the one for ``key`` (None: it is)."""
  if saved is None:
    return "it records no config (an older jaxrl wrote it)"
  # A field the cache's key lacks did not exist when it was written: its default computes the same.
  defaults = json_config.flatten(to_dict(Config()))
  saved = {**{k: defaults[k] for k in key.keys() - saved.keys() if k in defaults}, **saved}
  changed = changes(saved, key)
  return f"its config differs: {describe(changed)}" if changed else None
