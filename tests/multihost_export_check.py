"""Run as one rank of a 2-process jax.distributed job (2 CPU devices each): params sharded over
all 4 devices (no process holds a whole tensor) are exported in HF layout by every process, each
gathering tensor by tensor — what each host does to feed its own vLLM sidecar.

  python multihost_export_check.py PORT RANK OUT_DIR   # writes OUT_DIR/{loop,scan}.rankN
"""

import os
import sys

import jax

from jaxrl.nn import hf, model
from jaxrl.parallel import distributed, sharding

SEED = 3


def config(scan: bool) -> model.ModelConfig:
  return model.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=1e6,
    tie_embeddings=False,
    scan_layers=scan,
  )


def main(port: str, rank: str, out_dir: str) -> None:
  distributed.initialize(f"127.0.0.1:{port}", 2, int(rank), cpu_devices=2)
  mesh = sharding.make_mesh(1, 4, 1)
  for layout in ("loop", "scan"):
    cfg = config(layout == "scan")
    shardings = sharding.tree_shardings(model.abstract(cfg)[1], mesh)
    params = jax.jit(lambda cfg=cfg: model.create(cfg, SEED)[1], out_shardings=shardings)()
    split = [x for x in jax.tree.leaves(params) if not x.is_fully_addressable]
    assert split, "no param spans both processes: the check would test nothing"
    hf.save_hf_checkpoint(cfg, params, os.path.join(out_dir, f"{layout}.rank{rank}"), untie=True)
  print("ok", len(split), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
