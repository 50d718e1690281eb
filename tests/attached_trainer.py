"""A trainer process attached to a vLLM server by URL (``vllm.urls``): it pushes one weight version,
prints the directory the version went to, and waits to be killed. Run by
``tests/test_sidecar_security.py`` as ``python attached_trainer.py URL WORKDIR``."""

import signal
import sys

from jaxrl.nn import model
from jaxrl.rollout.vllm_engine import EngineConfig, VllmEngine

CFG = model.ModelConfig(
  vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
  num_kv_heads=1, head_dim=32, rope_theta=1e6, tie_embeddings=False,
)  # fmt: skip

if __name__ == "__main__":
  url, workdir = sys.argv[1:3]
  engine = VllmEngine(
    CFG, None, EngineConfig(launch=None, urls=(url,), request_timeout=10.0, retries=0),
    workdir=workdir,
    max_new_tokens=4, eos_id=1, pad_id=0,
  )  # fmt: skip
  engine.set_weights(model.create(CFG, 0)[1], 1)
  print(engine._root, flush=True)
  signal.pause()  # until SIGKILLed
