"""One train step on 8 fake CPU devices (fsdp 4 × tensor 2) equals the 1-device step."""

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.parallel import sharding

HERE = os.path.dirname(__file__)


def test_logical_rules_map_axes_and_replicate_indivisible_dims():
  class FakeMesh:
    shape = {"data": 1, "fsdp": 4, "tensor": 2}

  assert sharding.logical_to_spec(("embed", "mlp"), (64, 128), FakeMesh) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("vocab", "embed"), (63, 64), FakeMesh) == P(None, "fsdp")
  assert sharding.logical_to_spec(("norm",), (64,), FakeMesh) == P(None)


@pytest.mark.parametrize(
  "lora,packed", [(False, False), (True, False), (False, True)], ids=["full", "lora", "packed"]
)
def test_sharded_step_equals_single_device(lora, packed):
  """The sharded step (packed: also packed, docs/algorithms.md §1.6) against the padded step on
  one device."""
  env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
  env.pop("XLA_FLAGS", None)
  flags = [*(["--lora"] if lora else []), *(["--packed"] if packed else [])]
  out = subprocess.run(
    [sys.executable, os.path.join(HERE, "sharded_step_check.py"), *flags],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  # The mesh really shards: MLP kernels split over fsdp and tensor.
  specs = result["specs"]
  assert any("'fsdp', 'tensor'" in s for s in specs.values()), specs
  if lora:  # adapters shard with their kernels: B of q over tensor, A of up over fsdp
    assert specs["['layers'][0]['self_attn']['q_proj_lora_b'].value"] == "P('tensor', None)"
    assert specs["['layers'][0]['mlp']['up_proj_lora_a'].value"] == "P(None, 'fsdp')"
  assert result["same_fingerprint"], result
  # Each difference within its bound, derived in sharded_step_check.py from the sums the mesh
  # reorders (the gradients' chain of sums, Adam's slope lr/ε, the metrics' terms' magnitudes).
  assert result["sgd_leaf_ratio"] <= 1, result
  assert result["adam_leaf_ratio"] <= 1, result
  assert result["kl"] > 0, result  # the reference path is exercised
  for name, ratio in result["metric_ratio"].items():
    assert ratio <= 1, (name, result)
