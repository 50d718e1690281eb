"""The rollout engine a config asks for: the built-in JAX sampler or vLLM sidecars."""

from __future__ import annotations

import os

import jax

from jaxrl.fields import ConfigError
from jaxrl.methods.sections import AnnealPhaseSection
from jaxrl.nn.sections import ModelSection
from jaxrl.rollout import multiturn
from jaxrl.rollout.engine import JaxEngine
from jaxrl.rollout.hosts import PerHostEngine
from jaxrl.rollout.sections import RolloutSection, VllmSection, response_lengths, turn_tokens


def build_engine(
  graphdef,
  model_cfg,
  *,
  rollout: RolloutSection,
  vllm: VllmSection,
  model: ModelSection,
  anneal_phase: AnnealPhaseSection,
  tokenizer,
  eos_id: int | tuple[int, ...],
  pad_id: int,
  prompt_len: int,
  workdir: str,
  environment=None,
  environment_name: str = "",
):
  """The rollout engine ``rollout.engine`` names: the JAX sampler, or vLLM sidecar(s) (``vllm``,
  serving ``model``); ``anneal_phase`` gives the phases' response lengths (a turn fits the
  shortest, a sidecar's context the longest).

  With an ``environment`` (``task.environment``, named ``environment_name``): multi-turn rollouts,
  the JAX sampler's (``multiturn``) or the sidecar's (``vllm_multiturn``). A caller that knows its
  questions puts ``multiturn.EnvironmentRespond(environment, question_ids_R)`` in its
  ``SampleRequest.respond``; without one, the environment is reset with each row's prompt index
  among the call's prompts (held-out evaluation's chunks)."""
  common = dict(
    max_new_tokens=rollout.max_new_tokens, eos_id=eos_id, pad_id=pad_id, top_p=rollout.top_p
  )
  turns = {}
  if environment is not None:
    common["respond_factory"] = lambda group_ids_R: multiturn.EnvironmentRespond(
      environment, group_ids_R
    )
    t = turn_tokens(rollout, anneal_phase)
    turns = dict(name=environment_name, rollout=rollout, turn_tokens=t)
  if rollout.engine == "jax":
    if environment is not None:
      common["turns"] = turn_config(environment, **turns)
    return JaxEngine(graphdef, model_cfg, compact_every=rollout.compact_every, **common)
  if environment is not None:
    common["turns"] = sidecar_turns(environment, **turns)
  return _vllm_engine(
    vllm,
    model,
    model_cfg,
    tokenizer=tokenizer,
    prompt_len=prompt_len,
    max_response=max(response_lengths(rollout, anneal_phase)),
    workdir=workdir,
    common=common,
  )


def _turn_shape(
  r: RolloutSection, turn_tokens: int, stop_ids: tuple[int, ...], environment
) -> multiturn.TurnConfig:
  """The turn limits of every phase: a turn fits the shortest phase's response (``turn_tokens``:
  ``anneal_phase.turn_tokens``)."""
  return multiturn.TurnConfig(
    stop_ids=stop_ids,
    call_ids=tuple(environment.call_ids),
    max_turn_tokens=turn_tokens,
    max_observation_tokens=r.max_observation_tokens,
    max_turns=r.max_turns,
  )


def turn_config(
  environment, *, name: str, rollout: RolloutSection, turn_tokens: int
) -> multiturn.TurnConfig:
  """The multi-turn sampler's shapes: it ends a turn at one token id, so each of the
  environment's stop sequences (of ``name``, ``task.environment``) must be a single token."""
  stops = tuple(environment.stop_sequences)
  if not stops or any(len(seq) != 1 for seq in stops):
    raise ConfigError(
      "task.environment",
      f"{name!r}: the JAX multi-turn sampler ends a turn at a single token, but "
      f"the stop sequences are {stops} (make each stop string one token of the vocabulary)",
    )
  return _turn_shape(rollout, turn_tokens, tuple(seq[0] for seq in stops), environment)


def sidecar_turns(environment, *, name: str, rollout: RolloutSection, turn_tokens: int):
  """How the sidecar ends a turn: the single-token stop sequences as stop token ids (the JAX
  sampler's exact rule), the longer ones as their stop strings (the server matches text)."""
  from jaxrl.rollout.vllm_multiturn import TurnStops  # lazy, as in _vllm_engine

  seqs, strings = tuple(environment.stop_sequences), tuple(environment.stop_strings)
  if not seqs or len(seqs) != len(strings):
    raise ConfigError(
      "task.environment",
      f"{name!r}: needs one stop string per stop sequence, got {strings} and {seqs}",
    )
  single = tuple(seq[0] for seq in seqs if len(seq) == 1)
  longer = tuple(text for text, seq in zip(strings, seqs) if len(seq) != 1)
  return TurnStops(_turn_shape(rollout, turn_tokens, single, environment), longer)


def _check_vllm(v, m) -> None:
  """Refuse, before any server starts, a vLLM config (``v``) or model (``m``) vLLM cannot serve."""
  if v.weight_transfer == "nccl":
    # vLLM's NCCL path (/init_weight_transfer_engine with a torch-free nccl_unique_id handshake,
    # /start_weight_update, /update_weights {names, dtypes, shapes} while the trainer broadcasts
    # the tensors, /finish_weight_update) needs CUDA on both sides; it is not built yet.
    raise ConfigError(
      "vllm.weight_transfer",
      "'nccl' needs GPUs and is not implemented in this "
      "build; use 'files' (HF safetensors in tmpfs + reload_weights, CPU and GPU)",
    )
  if not m.qk_norm and m.head_dim * m.num_heads != m.hidden_size:
    raise ConfigError(
      "model.head_dim",
      f"vLLM's Qwen2 derives head_dim = hidden_size / num_heads = "
      f"{m.hidden_size // m.num_heads}, not {m.head_dim}: make them agree",
    )
  if m.head_dim < 32:
    raise ConfigError("model.head_dim", f"{m.head_dim}: vLLM's CPU attention needs head_dim >= 32")


def _vllm_engine(
  v: VllmSection,
  model: ModelSection,
  model_cfg,
  *,
  tokenizer,
  prompt_len: int,
  max_response: int,
  workdir: str,
  common: dict,
):
  """The vLLM engine of this process: attached to ``vllm.urls``, or launching its own sidecar
  (its context: ``prompt_len`` + ``max_response``, the longest phase's response)."""
  # Kept lazy: a run on the JAX engine does not import the vLLM engine, its HTTP client and sidecar.
  from jaxrl.rollout import vllm_engine

  _check_vllm(v, model_cfg)
  p = jax.process_index()
  suffix = f".process{p}" if p else ""  # processes sharing a host keep their files apart
  urls = process_urls(v.urls, p, jax.process_count())
  # No URLs to attach to: this process launches (and restarts) a server of its own.
  lengths = (prompt_len, max_response)
  launch = None if urls else _launch_config(v, model, lengths, workdir, f"vllm{suffix}.log")
  engine_cfg = vllm_engine.EngineConfig(
    launch=launch,
    urls=urls,
    request_timeout=v.request_timeout,
    retries=v.retries,
    max_restarts=v.max_restarts,
    sync_every=v.sync_every,
    fallback_dir=f"sidecar{suffix}",
    lora_adapters=_lora_adapters(model, v),
    weights_root=v.weights_dir,  # each engine writes to a fresh directory of its own under it
  )
  engine = vllm_engine.VllmEngine(model_cfg, tokenizer, engine_cfg, workdir=workdir, **common)
  # Several processes: one sidecar per process (launched on its host, or its group of URLs), each
  # sampling its slice of the questions; the rollouts are gathered to every process.
  return PerHostEngine(engine) if jax.process_count() > 1 else engine


def vllm_python(configured: str) -> str:
  """``vllm.python``; unset: ``$JAXRL_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the working
  directory, else in the checkout jaxrl runs from (an installed jaxrl has none: the first path
  then stands in the error that says how to make it)."""
  if configured or (configured := os.environ.get("JAXRL_VLLM_PYTHON", "")):
    return os.path.abspath(configured)
  venv = os.path.join(".venv-vllm", "bin", "python")
  checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  candidates = [os.path.abspath(venv), os.path.join(checkout, venv)]
  return next((p for p in candidates if os.path.exists(p)), candidates[0])


def _launch_config(
  v: VllmSection, model: ModelSection, lengths: tuple[int, int], workdir, log_name
):
  """How to start this process's own sidecar; its context must hold the prompt + the longest
  response (``lengths``)."""
  from jaxrl.rollout.sidecar import LaunchConfig  # lazy for the same reason as in _vllm_engine

  prompt_len, max_response = lengths
  python = vllm_python(v.python)
  need = prompt_len + max_response
  # Unset: the prompt plus the longest response, rounded up to a multiple of 16.
  max_len = v.max_model_len or -(-need // 16) * 16
  if max_len < need:
    raise ConfigError(
      "vllm.max_model_len",
      f"{max_len} < prompt length {prompt_len} + longest response {max_response}",
    )
  return LaunchConfig(
    python=python,
    log_dir=workdir,
    log_name=log_name,
    dtype=v.dtype or model.dtype,
    max_model_len=max_len,
    max_num_seqs=v.max_num_seqs,
    startup_timeout=v.startup_timeout,
    extra_args=tuple(v.extra_args.split()),
    cpus=v.cpus,
    lora_rank=model.lora.rank if _lora_adapters(model, v) else 0,
  )


def _lora_adapters(model: ModelSection, v: VllmSection) -> bool:
  """Whether the sidecar receives LoRA adapters (else merged weights, or a model without any)."""
  return model.lora.rank > 0 and v.lora_sync == "adapter"


def process_urls(spec: str, process: int, processes: int) -> tuple[str, ...]:
  """The sidecar URLs process ``process`` attaches to. ``spec``: comma-separated URLs shared by
  every process (e.g. ``http://localhost:8000``: each host's own server), or one group per process
  separated by ``;`` (``http://h0:8000;http://h1:8000,http://h1:8001``)."""
  groups = [tuple(u.strip() for u in g.split(",") if u.strip()) for g in spec.split(";")]
  if len(groups) == 1:
    return groups[0]
  if len(groups) != processes or not all(groups):
    raise ConfigError(
      "vllm.urls",
      f"{len(groups)} ';'-separated groups of URLs for {processes} "
      "process(es): give one non-empty group per process, or one for all",
    )
  return groups[process]
