"""The judge's own vLLM server (``judge:sidecar`` in ``reward.terms``, docs/rewards.md).

The run serves ``reward.judge_model`` with the rollout sidecar's machinery
(``jaxrl.rollout.sidecar``): the server in its own process group under a guard, so it leaves no
orphan even when the trainer is killed; HTTP on a Unix socket in a fresh private directory, so no
TCP port is open and no other user reaches it; its log in ``WORKDIR/judge.log``. It runs from the
vLLM environment ``vllm.python`` names, with the policy server's dtype, start-up time limit and
cores, and its own context (``reward.judge_max_model_len``) and extra flags
(``reward.judge_extra_args``; on a GPU shared with the policy's server, e.g.
``--gpu-memory-utilization 0.3``). Only process 0 starts one: the other processes' rewards are
process 0's. A judge server that dies mid-run is restarted before the next batch, at most
``vllm.max_restarts`` times in a run; past that, or while a restart fails, its verdicts fail,
counted in ``reward_term_judge_failed`` and logged at every step.
"""

from __future__ import annotations

import logging

from jaxrl.config import Config
from jaxrl.fields import ConfigError
from jaxrl.parallel import distributed
from jaxrl.rollout import sidecar, unix_http
from jaxrl.rollout.build import vllm_python
from jaxrl.run.components import task_sections
from jaxrl.tasks.rewards.judge import Endpoint
from jaxrl.tasks.rewards.terms import RewardTerms, build_terms, model_dir
from jaxrl.tasks.term_specs import SIDECAR, parse_terms

log = logging.getLogger(__name__)

LOG_NAME = "judge.log"


def launch_config(cfg: Config, workdir: str) -> sidecar.LaunchConfig:
  r, v = cfg.reward, cfg.vllm
  return sidecar.LaunchConfig(
    python=vllm_python(v.python),
    log_dir=workdir,
    log_name=LOG_NAME,
    dtype=v.dtype or cfg.model.dtype,
    max_model_len=r.judge_max_model_len,
    max_num_seqs=r.judge_workers,  # as many sequences as requests in flight
    startup_timeout=v.startup_timeout,
    extra_args=tuple(r.judge_extra_args.split()),
    cpus=v.cpus,
  )


def wanted(cfg: Config) -> bool:
  """Whether this process serves a judge: ``judge:sidecar`` is a term, and it is process 0."""
  terms = parse_terms(cfg.reward.terms)
  return distributed.is_main() and any(t.kind == "judge" and t.source == SIDECAR for t in terms)


def start(cfg: Config, workdir: str) -> Endpoint | None:
  """The started judge server as an ``Endpoint`` (its ``close`` stops it), or None when this
  process serves none. A server that does not start is a ``SidecarError`` quoting its log."""
  if not wanted(cfg):
    return None
  if not cfg.reward.judge_model:
    raise ConfigError("reward.judge_model", "judge:sidecar serves this checkpoint: set it")
  path = model_dir(cfg.reward.judge_model)
  server = sidecar.Sidecar(launch_config(cfg, workdir))
  try:
    server.start(path)
  except BaseException:
    server.close()
    raise
  # vLLM serves the model under the path it was given: requests name it so.
  revive = _reviver(server, path, cfg.vllm.max_restarts)
  return Endpoint(server.url, path, unix_http.urlopen, server.close, revive)


def _reviver(server: sidecar.Sidecar, path: str, restarts: int):
  """A function that restarts ``server`` when it has died, ``restarts`` times at most, and returns
  its new URL (None when it is alive, out of restarts, or the restart failed: logged)."""
  left = [restarts]

  def revive() -> str | None:
    if server.alive() or left[0] <= 0:
      return None
    left[0] -= 1
    log.warning(
      "the judge's vLLM server has died (log %s): restarting it, %d restart(s) left after this",
      server.log_path,
      left[0],
    )
    try:
      server.restart(path)
    except sidecar.SidecarError as e:  # the batch's verdicts fail, counted
      log.error("the judge's vLLM server did not restart: %s", e)
      return None
    return server.url

  return revive


def open_terms(cfg: Config, mesh, workdir: str) -> RewardTerms | None:
  """``reward.terms`` built, a judge server started first when one is named; ``close`` on the
  terms stops it, and a failed build stops it at once."""
  endpoint = start(cfg, workdir)
  try:
    return build_terms(task_sections(cfg), mesh, endpoint, workdir)
  except BaseException:
    if endpoint is not None:
      endpoint.close()
    raise
