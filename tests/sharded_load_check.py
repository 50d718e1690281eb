"""Run as a script with 8 fake CPU devices: load a ~270 MB sharded HF checkpoint onto a (data 1,
fsdp 4, tensor 2) mesh and measure host memory during the load. Prints one JSON line.

  python sharded_load_check.py write DIR          # random float32 model via hf.save_hf_checkpoint
  python sharded_load_check.py load DIR loop|scan # one layout per process

What is measured, per load (the CPU "devices" live in host RAM, so RSS includes their buffers):
  numpy_peak   tracemalloc's peak over the load: every numpy buffer (file rows read, blocks being
               cast/transposed) alive at once. Device buffers are XLA allocations, invisible to it
               (``jax.device_put`` copies on CPU, so a block handed to a device is freed on host).
  rss_peak     VmHWM after the load (reset to the current RSS just before it via clear_refs)
               minus VmRSS before it: devices' buffers plus every transient host copy.
  rss_transient  rss_peak minus the bytes all devices hold at the end: what the load needed on top
               of its result. Device bytes only grow during the load, so this is exact at the end
               and a lower bound earlier; numpy_peak covers the earlier transients.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import gc  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jaxrl.nn import hf, hf_config, hf_load, model
from jaxrl.parallel import sharding  # noqa: E402

# 66.6 M params (266 MB in float32): the embedding and LM head are 13% of it each, an MLP kernel 5%.
CFG = model.ModelConfig(
  vocab_size=8192,
  hidden_size=1024,
  intermediate_size=3072,
  num_layers=4,
  num_heads=8,
  num_kv_heads=4,
  head_dim=128,
  rope_theta=1e6,
  tie_embeddings=False,
  qkv_bias=False,
)
SHARD_BYTES = 64 * 2**20
SEED = 7


def random_params(cfg: model.ModelConfig):
  """Host (numpy) params of the loop layout, each leaf from its own seed so they can be rebuilt."""
  _, abstract = model.abstract(cfg)
  leaves, treedef = jax.tree.flatten(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
  out = [
    v.replace(np.random.default_rng([SEED, i]).standard_normal(v.shape, np.float32))
    for i, v in enumerate(leaves)
  ]
  return jax.tree.unflatten(treedef, out)


def write(out_dir):
  hf.save_hf_checkpoint(CFG, random_params(CFG), out_dir, max_shard_bytes=SHARD_BYTES)


def _status(field: str) -> int:
  """A /proc/self/status memory field in bytes."""
  text = pathlib.Path("/proc/self/status").read_text()
  return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _reset_peak_rss():
  """Make VmHWM = VmRSS (Linux >= 4.0). Without it, the measured peak only grows: conservative."""
  try:
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return True
  except OSError:
    return False


def _device_bytes(params) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)


def measure_load(path, mesh, scan: bool) -> dict:
  cfg = hf_config.load_model_config(path, scan_layers=scan)
  planned = sharding.tree_shardings(model.abstract(cfg)[1], mesh)
  gc.collect()
  reset = _reset_peak_rss()
  rss_before = _status("VmRSS")
  tracemalloc.start()
  start = time.perf_counter()
  _, _, params = hf_load.load_hf_checkpoint(path, shardings=planned, scan_layers=scan)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  numpy_peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  rss_peak = _status("VmHWM") - rss_before
  device_bytes = _device_bytes(params)

  got, want = jax.tree.leaves(params), jax.tree.leaves(planned)
  wrong_sharding = [str(x.sharding) for x, s in zip(got, want) if x.sharding != s]
  # The mesh really splits the matrices both ways (over fsdp and tensor).
  split_both = sum(1 for s in want if {"fsdp", "tensor"} <= set(jax.tree.leaves(tuple(s.spec))))
  # Values: the loaded model's HF tensors equal those of the params that were written.
  mismatched = [
    name
    for (name, a), (name_b, b) in zip(
      hf.to_hf_tensors(params), hf.to_hf_tensors(random_params(CFG))
    )
    if name != name_b or not np.array_equal(a, b)
  ]
  return {
    "layout": "scan" if scan else "loop",
    "seconds": seconds,
    "numpy_peak": numpy_peak,
    "rss_peak": rss_peak,
    "rss_transient": rss_peak - device_bytes,
    "device_bytes": device_bytes,
    "hwm_reset": reset,
    "num_arrays": len(got),
    "wrong_sharding": wrong_sharding,
    "split_both": split_both,
    "mismatched": mismatched,
  }


def control(path) -> dict:
  """A naive read (safetensors.numpy.load_file of one shard) so the test can see that
  tracemalloc does count such host copies."""
  shard = sorted(pathlib.Path(path).glob("model-*.safetensors"))[0]
  tracemalloc.start()
  tensors = load_file(shard)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return {"shard_bytes": sum(t.nbytes for t in tensors.values()), "numpy_peak": peak}


def load(path, layout):
  """Measure one load (a fresh process per layout: XLA's allocator keeps freed buffers, so a second
  load in the same process would reuse them and hide its RSS growth)."""
  assert len(jax.devices()) == 8, jax.devices()
  mesh = sharding.make_mesh(1, 4, 2)
  # Start the backend on every device first, so its one-off allocations are not counted.
  jax.block_until_ready([jax.device_put(np.zeros(8, np.float32), d) for d in jax.devices()])
  result = measure_load(path, mesh, scan={"loop": False, "scan": True}[layout])
  shards = pathlib.Path(path).glob("model-*.safetensors")
  result["model_bytes"] = sum(f.stat().st_size for f in shards)
  result["largest_param_bytes"] = max(x.size * 4 for x in jax.tree.leaves(model.abstract(CFG)[1]))
  result["control"] = control(path)
  print(json.dumps(result))


if __name__ == "__main__":
  if sys.argv[1] == "write":
    write(sys.argv[2])
  else:
    load(sys.argv[2], sys.argv[3])
