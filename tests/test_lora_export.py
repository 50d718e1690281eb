"""LoRA exports: merged weights in HF layout compute the adapted model; the PEFT-layout adapter
loads with transformers + peft onto the base and gives the same logits; a run checkpoint's
adapters are exported on the base the run rebuilt (``jaxrl-export``)."""

from __future__ import annotations

import json

import hf_fixtures
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from hf_fixtures import hf_logits, left_padded_batch, load_hf_model, our_logits
from rounding import logits_atol
from run_helpers import moved_adapters, tiny_config
from safetensors import safe_open

from jaxrl.nn import arch, hf_load, lora, model
from jaxrl.nn import peft as jaxrl_peft
from jaxrl.parallel import sharding
from jaxrl.run import weights

RANK, ALPHA = 4, 8.0


@pytest.mark.parametrize("layout", ["loop", "scan"])
def test_merged_and_peft_exports_compute_the_adapted_model(tmp_path, layout):
  base_dir = hf_fixtures.make_tiny_hf("qwen2", False, tmp_path / "base")
  cfg = tiny_config(
    "test",
    **{
      "model.checkpoint": str(base_dir),
      "sft.steps": 0,  # RL straight from the checkpoint: the PEFT adapter names it as its base
      "model.lora.rank": RANK,
      "model.lora.alpha": ALPHA,
      "model.scan_layers": layout == "scan",
    },
  )
  model_cfg = arch.model_config(cfg.model)
  assert (model_cfg.lora_rank, model_cfg.lora_alpha) == (RANK, ALPHA)
  graphdef, abstract = model.abstract(model_cfg)
  shardings = sharding.tree_shardings(abstract, sharding.make_mesh(1, 1, 1))
  fresh = weights.load_params(cfg, str(base_dir), (abstract, shardings))
  tokens, mask = left_padded_batch(model_cfg.vocab_size)
  base_logits = hf_logits(load_hf_model(base_dir), tokens, mask)
  # Each comparison below is of two float32 forwards of the same function (two frameworks, or
  # merged weights against the adapter path), summing in other orders: ``logits_atol`` of the
  # LoRA model (which counts the adapters' extra terms). Measured differences ~2e-6.
  slots = mask.shape[1]
  # Fresh adapters: the base's function (HF's logits).
  atol = logits_atol(model_cfg, base_logits[mask], slots)
  np.testing.assert_allclose(
    our_logits(graphdef, fresh, tokens, mask)[mask], base_logits[mask], atol=atol, rtol=0
  )
  # adapters as after training: A and B moved by 0.1 per entry, which moves the logits by ~3
  params = moved_adapters(fresh, 0.1, seed=0, move_a=True)
  ours = our_logits(graphdef, params, tokens, mask)
  assert np.max(np.abs(ours - base_logits)[mask]) > 0.1  # the adapters change the model
  atol = logits_atol(model_cfg, ours[mask], slots)

  out = weights.write_hf(cfg, model_cfg, params, str(tmp_path / "export"), None, "float32")
  # Merged: a plain HF model, read back by our loader and by transformers.
  _, g_merged, merged = hf_load.load_hf_checkpoint(out, scan_layers=layout == "scan")
  assert not lora.has_adapters(merged)
  np.testing.assert_allclose(our_logits(g_merged, merged, tokens, mask), ours, atol=atol, rtol=0)
  hf_merged = hf_logits(load_hf_model(out), tokens, mask)

  # PEFT: adapter_config.json + adapter_model.safetensors onto the base, with peft.
  adapter_dir = tmp_path / "export" / "lora"
  config = json.loads((adapter_dir / "adapter_config.json").read_text())
  assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
    RANK,
    ALPHA,
    str(base_dir),
  )
  with safe_open(adapter_dir / "adapter_model.safetensors", "np") as f:
    names = set(f.keys())
    a = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
  assert len(names) == 2 * 7 * model_cfg.num_layers and a.shape == (RANK, model_cfg.hidden_size)
  with torch.no_grad():
    adapted = peft.PeftModel.from_pretrained(load_hf_model(base_dir), adapter_dir).eval()
  peft_logits = hf_logits(adapted, tokens, mask)
  np.testing.assert_allclose(peft_logits[mask], hf_merged[mask], atol=atol, rtol=0)
  np.testing.assert_allclose(peft_logits[mask], ours[mask], atol=atol, rtol=0)


def test_adapter_names_follow_the_hf_modules():
  cfg = model.ModelConfig(
    vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=4, rope_theta=1e6, tie_embeddings=False, lora_rank=2, lora_targets=("v", "up"), scan_layers=True,
  )  # fmt: skip
  _, params = model.create(cfg, 0)
  tensors = dict(jaxrl_peft.adapter_tensors(params))
  assert sorted(tensors) == sorted(
    f"base_model.model.model.layers.{i}.{m}.lora_{x}.weight"
    for i in range(2)
    for m in ("self_attn.v_proj", "mlp.up_proj")
    for x in "AB"
  )
  assert tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"].shape == (12, 2)
  a = params["layers"]["self_attn"]["v_proj_lora_a"][...]
  np.testing.assert_array_equal(
    tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"], np.asarray(a[1])
  )
  assert jnp.all(tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"] == 0)
