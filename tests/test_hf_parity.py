"""HF checkpoint import/export (jaxrl.hf) against transformers' own Qwen2/Qwen3 as the oracle.

Tiny random models (GQA, float32, non-trivial norms and biases) are saved with ``save_pretrained``;
our forward on the loaded params must give torch's logits on a left-padded batch, and our exports
must load back bitwise and in transformers with the same logits.
"""
from __future__ import annotations

import functools
import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import hf_fixtures  # noqa: E402
from jaxrl import hf, model, sharding  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

KINDS = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)]
TOL = 1e-4


def _name(kind, tie):
  return f"{kind}-{'tied' if tie else 'untied'}"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  base = tmp_path_factory.mktemp("hf")
  return {(k, t): hf_fixtures.make_tiny_hf(k, t, base / _name(k, t)) for k, t in KINDS}


def _left_padded_batch(vocab):
  """Prompts of lengths 11, 6, 1, 9 left-padded to T=11 (pad id 0)."""
  lengths_B = np.array([11, 6, 1, 9])
  t = lengths_B.max()
  mask_BxT = np.arange(t)[None, :] >= (t - lengths_B)[:, None]
  tokens_BxT = np.random.default_rng(0).integers(1, vocab, (len(lengths_B), t))
  return np.where(mask_BxT, tokens_BxT, 0), mask_BxT


@functools.partial(jax.jit, static_argnums=0)
def _our_logits_jit(graphdef, params, tokens_BxT, mask_BxT):
  hidden_BxTxD, lm_head_DxV, _ = model.forward(
      graphdef, params, tokens_BxT, model.positions_from_mask(mask_BxT), mask_BxT)
  return hidden_BxTxD @ lm_head_DxV


def _our_logits(graphdef, params, tokens_BxT, mask_BxT):
  return np.asarray(_our_logits_jit(graphdef, params, jnp.asarray(tokens_BxT), jnp.asarray(mask_BxT)))


@torch.no_grad()
def _hf_logits(hf_model, tokens_BxT, mask_BxT):
  mask = torch.tensor(mask_BxT, dtype=torch.long)
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  out = hf_model(input_ids=torch.tensor(tokens_BxT), attention_mask=mask, position_ids=positions)
  return out.logits.float().numpy()


def _assert_logits_match(ours_BxTxV, ref_BxTxV, mask_BxT):
  assert ours_BxTxV.shape == ref_BxTxV.shape
  ours, ref = ours_BxTxV[mask_BxT], ref_BxTxV[mask_BxT]
  assert np.std(ref) > 0.3  # non-degenerate logits, so the tolerance means something
  np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL)


def _assert_params_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind,tie", KINDS, ids=[_name(*k) for k in KINDS])
def test_loaded_checkpoint_matches_hf_logits(hf_dirs, kind, tie):
  path = hf_dirs[kind, tie]
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  cfg, graphdef, params = hf.load_hf_checkpoint(path)
  c = hf_model.config
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_embeddings) == (
      c.head_dim, c.num_key_value_heads, c.rope_parameters["rope_theta"], c.rms_norm_eps, tie)
  assert (cfg.qkv_bias, cfg.qk_norm) == ((True, False) if kind == "qwen2" else (False, True))
  tokens, mask = _left_padded_batch(cfg.vocab_size)
  _assert_logits_match(_our_logits(graphdef, params, tokens, mask),
                       _hf_logits(hf_model, tokens, mask), mask)


def test_sharded_checkpoint_loads_identically(hf_dirs, tmp_path):
  src = hf_dirs["qwen3", False]
  transformers.AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path, max_shard_size="100KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  cfg_a, _, params_a = hf.load_hf_checkpoint(src)
  cfg_b, _, params_b = hf.load_hf_checkpoint(tmp_path)
  assert cfg_a == cfg_b
  _assert_params_equal(params_a, params_b)


def test_load_places_tensors_on_shardings(hf_dirs):
  path = hf_dirs["qwen2", False]
  n = len(jax.devices())
  mesh = sharding.make_mesh(1, n // 2, 2) if n % 2 == 0 else sharding.make_mesh(1, n, 1)
  cfg, _, reference = hf.load_hf_checkpoint(path)
  shardings = sharding.tree_shardings(model.abstract(cfg)[1], mesh)
  _, _, params = hf.load_hf_checkpoint(path, shardings=shardings)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert x.sharding == s
  _assert_params_equal(params, reference)


def _random_params(like, seed, dtype=np.float32):
  """Fresh random params shaped like ``like``: unit-scale activations, norms and biases off 1 and 0."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  out = []
  for path, x in leaves:
    name, noise = str(path[-2].key), rng.standard_normal(x.shape).astype(np.float32)
    if name.endswith("norm"):
      out.append(1.0 + 0.2 * noise)
    elif name.endswith("_bias"):
      out.append(0.2 * noise)
    elif name == "embed_tokens":
      out.append(noise)
    else:  # [in, out] kernel
      out.append(noise * x.shape[0] ** -0.5)
  return jax.tree.unflatten(treedef, [jnp.asarray(x.astype(dtype)) for x in out])


EXPORTS = [("qwen2", False, None), ("qwen2", True, 100_000), ("qwen3", False, 100_000),
           ("qwen3", True, None)]


@pytest.mark.parametrize("kind,tie,shard_bytes", EXPORTS,
                         ids=[f"{_name(k, t)}-{'sharded' if s else 'single'}" for k, t, s in EXPORTS])
def test_export_round_trip(hf_dirs, tmp_path, kind, tie, shard_bytes):
  cfg, _, loaded = hf.load_hf_checkpoint(hf_dirs[kind, tie])
  params = _random_params(loaded, seed=3)
  kwargs = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
  hf.save_hf_checkpoint(cfg, params, tmp_path, **kwargs)
  assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes is not None)

  cfg2, graphdef, params2 = hf.load_hf_checkpoint(tmp_path)
  assert cfg2 == cfg
  _assert_params_equal(params2, params)

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(hf_model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
  tokens, mask = _left_padded_batch(cfg.vocab_size)
  _assert_logits_match(_our_logits(graphdef, params, tokens, mask),
                       _hf_logits(hf_model, tokens, mask), mask)


def test_export_round_trip_bfloat16(hf_dirs, tmp_path):
  cfg, _, loaded = hf.load_hf_checkpoint(hf_dirs["qwen3", False])
  params = _random_params(loaded, seed=4, dtype=jnp.bfloat16)
  hf.save_hf_checkpoint(cfg, params, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  _, _, params2 = hf.load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)
  _assert_params_equal(params2, params)


# --- errors --------------------------------------------------------------------------------------

def _edited_copy(src, dst, edit):
  """Copy an HF dir, applying ``edit(tensors_dict)`` to its single safetensors file."""
  shutil.copytree(src, dst)
  tensors = load_file(dst / "model.safetensors")
  edit(tensors)
  save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  return dst


def test_missing_tensor_is_named(hf_dirs, tmp_path):
  name = "model.layers.1.mlp.up_proj.weight"
  path = _edited_copy(hf_dirs["qwen2", False], tmp_path / "c", lambda t: t.pop(name))
  with pytest.raises(ValueError, match=rf"'{name}'.*missing"):
    hf.load_hf_checkpoint(path)


def test_missing_untied_lm_head_is_named(hf_dirs, tmp_path):
  path = _edited_copy(hf_dirs["qwen3", False], tmp_path / "c", lambda t: t.pop("lm_head.weight"))
  with pytest.raises(ValueError, match=r"'lm_head.weight'.*missing"):
    hf.load_hf_checkpoint(path)


def test_shape_mismatch_is_named(hf_dirs, tmp_path):
  name = "model.layers.0.self_attn.k_proj.weight"
  path = _edited_copy(hf_dirs["qwen3", True], tmp_path / "c",
                      lambda t: t.update({name: np.zeros((16, 64), np.float32)}))
  with pytest.raises(ValueError, match=rf"'{name}' has shape \(16, 64\).*\(64, 64\)"):
    hf.load_hf_checkpoint(path)


def test_unexpected_tensors(hf_dirs, tmp_path):
  extra = "model.layers.0.mlp.extra_proj.weight"
  path = _edited_copy(hf_dirs["qwen2", False], tmp_path / "bad",
                      lambda t: t.update({extra: np.zeros((2, 2), np.float32)}))
  with pytest.raises(ValueError, match=rf"unexpected tensors \['{extra}'\]"):
    hf.load_hf_checkpoint(path)
  # Rotary caches are derived, so they are ignored.
  inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
  path = _edited_copy(hf_dirs["qwen2", False], tmp_path / "ok",
                      lambda t: t.update({inv_freq: np.ones((8,), np.float32)}))
  hf.load_hf_checkpoint(path)


def test_tied_checkpoint_with_lm_head(hf_dirs, tmp_path):
  def add_head(scale):
    return lambda t: t.update({"lm_head.weight": scale * t["model.embed_tokens.weight"]})
  src = hf_dirs["qwen2", True]
  _, _, reference = hf.load_hf_checkpoint(src)
  _, _, params = hf.load_hf_checkpoint(_edited_copy(src, tmp_path / "same", add_head(1.0)))
  _assert_params_equal(params, reference)
  with pytest.raises(ValueError, match="tie_word_embeddings.*differs"):
    hf.load_hf_checkpoint(_edited_copy(src, tmp_path / "diff", add_head(2.0)))


def _config(hf_dirs, kind="qwen2"):
  return json.loads((hf_dirs[kind, False] / "config.json").read_text())


@pytest.mark.parametrize("edit,match", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_sliding_window": True}, "sliding"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type 'yarn'"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
])
def test_unsupported_config_is_named(hf_dirs, edit, match):
  config = {**_config(hf_dirs), **edit}
  config = {k: v for k, v in config.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    hf.model_config_from_hf(config)


def test_unsupported_model_type_dir(hf_dirs, tmp_path):
  path = shutil.copytree(hf_dirs["qwen2", False], tmp_path / "c")
  config = {**_config(hf_dirs), "model_type": "gemma"}
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="model_type 'gemma'"):
    hf.load_hf_checkpoint(path)


def test_config_defaults_follow_transformers(hf_dirs):
  """Older files: top-level rope_theta; absent θ / head_dim take transformers' defaults."""
  base = {k: v for k, v in _config(hf_dirs).items() if k not in ("rope_parameters", "head_dim")}
  assert hf.model_config_from_hf({**base, "rope_theta": 123.0}).rope_theta == 123.0
  for kind, head_dim in (("qwen2", 64 // 4), ("qwen3", 128)):
    config = {**base, "model_type": kind}
    cfg = hf.model_config_from_hf(config)
    ref = transformers.AutoConfig.for_model(**config)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"] == 10_000.0
    assert cfg.head_dim == head_dim == getattr(ref, "head_dim", ref.hidden_size // ref.num_attention_heads)
