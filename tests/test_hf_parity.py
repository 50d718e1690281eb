"""HF checkpoint import/export (jaxrl.nn.hf_load, jaxrl.nn.hf) against transformers' own Qwen2/Qwen3/Llama as the oracle.

Tiny random models (GQA, float32, non-trivial norms and biases; Llama with llama3 RoPE scaling) are
saved with ``save_pretrained`` as several shards; our forward on the loaded params, in the loop and
the scan layout, must give torch's logits on a left-padded batch, and our exports must load back
bitwise, in transformers as the same tensors, and with the same logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hf_fixtures  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hf_fixtures import hf_logits, left_padded_batch, load_hf_model, our_logits  # noqa: E402
from rounding import logits_atol  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from jaxrl.nn import hf, hf_config, hf_load, hf_safetensors, model, model_config
from jaxrl.parallel import sharding  # noqa: E402

KINDS = [(k, t) for k in hf_fixtures.KINDS for t in (False, True)]
LAYOUTS = ("loop", "scan")
_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _name(kind, tie):
  return f"{kind}-{'tied' if tie else 'untied'}"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  base = tmp_path_factory.mktemp("hf")
  return {(k, t): hf_fixtures.make_tiny_hf(k, t, base / _name(k, t)) for k, t in KINDS}


def _load(path, layout="loop", **kwargs):
  return hf_load.load_hf_checkpoint(path, scan_layers=layout == "scan", **kwargs)


def _assert_logits_match(ours_BxTxV, ref_BxTxV, mask_BxT, cfg):
  assert ours_BxTxV.shape == ref_BxTxV.shape
  ours, ref = ours_BxTxV[mask_BxT], ref_BxTxV[mask_BxT]
  assert np.std(ref) > 0.3  # non-degenerate logits, so the tolerance means something
  atol = logits_atol(cfg, ref, mask_BxT.shape[1])
  np.testing.assert_allclose(ours, ref, rtol=0, atol=atol)


def _assert_params_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fixtures_are_sharded(hf_dirs):
  for path in hf_dirs.values():
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) >= 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind,tie", KINDS, ids=[_name(*k) for k in KINDS])
def test_loaded_checkpoint_matches_hf_logits(hf_dirs, kind, tie, layout):
  path = hf_dirs[kind, tie]
  hf_model = load_hf_model(path)
  assert type(hf_model).__name__ == _CLASSES[kind]
  cfg, graphdef, params = _load(path, layout)
  c = hf_model.config
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_embeddings) == (
    c.head_dim,
    c.num_key_value_heads,
    c.rope_parameters["rope_theta"],
    c.rms_norm_eps,
    tie,
  )
  assert (cfg.qkv_bias, cfg.qk_norm) == {
    "qwen2": (True, False),
    "qwen3": (False, True),
    "llama": (False, False),
  }[kind]
  assert cfg.rope_type == c.rope_parameters["rope_type"] and cfg.scan_layers == (layout == "scan")
  tokens, mask = left_padded_batch(cfg.vocab_size)
  _assert_logits_match(
    our_logits(graphdef, params, tokens, mask), hf_logits(hf_model, tokens, mask), mask, cfg
  )


@pytest.mark.parametrize("kind,tie", KINDS, ids=[_name(*k) for k in KINDS])
def test_blockwise_attention_matches_hf_logits(hf_dirs, kind, tie):
  """Attention in blocks of 4 queries (T = 11: blocks 4, 4, 3 + a padded query) still gives
  transformers' logits on the left-padded batch (the layer scan and remat as the 7B config runs)."""
  path = hf_dirs[kind, tie]
  cfg, _, params = _load(path, "scan")
  graphdef, _ = model.abstract(dataclasses.replace(cfg, attention_block=4, remat="full"))
  tokens, mask = left_padded_batch(cfg.vocab_size)
  _assert_logits_match(
    our_logits(graphdef, params, tokens, mask),
    hf_logits(load_hf_model(path), tokens, mask),
    mask,
    cfg,
  )


def test_llama3_rope_scaling_changes_the_logits(hf_dirs):
  """The Llama fixture's scaling is no no-op at the test's positions: its parity test checks it."""
  path = hf_dirs["llama", False]
  cfg = hf_config.load_model_config(path)
  scaled_E, unscaled_E = (
    np.asarray(model_config.rope_inv_freq(c))
    for c in (cfg, dataclasses.replace(cfg, rope_type="default"))
  )
  ratio = scaled_E / unscaled_E
  # All three regimes: kept (high frequencies), interpolated, divided by the factor (low ones).
  assert np.any(ratio == 1) and np.any(ratio == 1 / cfg.rope_factor)
  assert np.any((ratio > 1 / cfg.rope_factor + 1e-3) & (ratio < 1 - 1e-3))
  scaled = load_hf_model(path)
  unscaled = hf_fixtures.make_tiny_hf_model(
    "llama", False, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}
  )
  unscaled.load_state_dict(scaled.state_dict())
  tokens, mask = left_padded_batch(cfg.vocab_size)
  diff = np.abs(hf_logits(scaled, tokens, mask) - hf_logits(unscaled, tokens, mask))[mask]
  assert diff.max() > 100 * logits_atol(cfg, hf_logits(scaled, tokens, mask)[mask], mask.shape[1])


_LLAMA31 = {  # the text config of Llama-3.1-8B, legacy format (top-level θ, rope_scaling)
  "model_type": "llama",
  "vocab_size": 128256,
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "num_hidden_layers": 32,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-5,
  "rope_theta": 500000.0,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
  },
  "tie_word_embeddings": False,
  "attention_bias": False,
  "mlp_bias": False,
}


def test_max_position_embeddings_is_carried_through_export():
  """A re-exported Llama 3.1 keeps its 131072-token context (vLLM's max_model_len comes from it)."""
  cfg = hf_config.model_config_from_hf(_LLAMA31)
  assert cfg.max_position_embeddings == 131072
  assert hf_config.hf_config_from_model(cfg)["max_position_embeddings"] == 131072
  missing = {k: v for k, v in _LLAMA31.items() if k != "max_position_embeddings"}
  assert hf_config.model_config_from_hf(missing).max_position_embeddings == 32768


@pytest.mark.parametrize(
  "config",
  [
    _LLAMA31,
    {**_LLAMA31, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {**_LLAMA31, "rope_scaling": None},
    {
      **_LLAMA31,
      "hidden_size": 64,
      "num_attention_heads": 4,
      "num_key_value_heads": 2,
      "rope_scaling": None,
      "rope_parameters": hf_fixtures.LLAMA3_ROPE,
    },
  ],
  ids=["llama3.1", "linear", "default", "fixture"],
)
def test_rope_frequencies_match_transformers(config):
  """Our config parsing + ``rope_inv_freq`` against transformers' RoPE init on the same config."""
  config = {k: v for k, v in config.items() if v is not None}
  ours_E = np.asarray(model_config.rope_inv_freq(hf_config.model_config_from_hf(config)))
  ref = transformers.AutoConfig.for_model(**config)
  rope_type = ref.rope_parameters["rope_type"]
  if rope_type == "default":
    ref_E = 1.0 / (
      ref.rope_parameters["rope_theta"]
      ** (torch.arange(0, ours_E.size * 2, 2, dtype=torch.float) / (ours_E.size * 2))
    )
  else:
    ref_E = ROPE_INIT_FUNCTIONS[rope_type](ref, "cpu")[0]
  # Both in float32, the same operations in transformers' order: a pow (an ulp or two in either
  # library), a division, and for llama3 a few more operations: ≤ ~8 ulps apart, each ≤ 2u
  # relative: rtol 1e-6 ≈ 17u, on any CPU (no sums; each library's pow is within its ulps).
  np.testing.assert_allclose(ours_E, ref_E.numpy(), rtol=1e-6, atol=0)


def test_sharded_checkpoint_loads_identically(hf_dirs, tmp_path):
  src = hf_dirs["llama", False]
  load_hf_model(src).save_pretrained(tmp_path, max_shard_size="1GB")
  assert (tmp_path / "model.safetensors").exists()
  cfg_a, _, params_a = _load(src)
  cfg_b, _, params_b = _load(tmp_path)
  assert cfg_a == cfg_b
  _assert_params_equal(params_a, params_b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_places_tensors_on_shardings(hf_dirs, layout):
  path = hf_dirs["qwen2", False]
  n = len(jax.devices())
  mesh = sharding.make_mesh(1, n // 2, 2) if n % 2 == 0 else sharding.make_mesh(1, n, 1)
  cfg, _, reference = _load(path, layout)
  shardings = sharding.tree_shardings(model.abstract(cfg)[1], mesh)
  _, _, params = _load(path, layout, shardings=shardings)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert x.sharding == s
  _assert_params_equal(params, reference)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reading_in_small_chunks_gives_the_same_params(hf_dirs, monkeypatch, layout):
  """Rows read a few at a time (transposed, cast) land where one big read puts them."""
  path = hf_dirs["qwen2", True]
  reference = [_load(path, layout, dtype=d)[2] for d in (jnp.float32, jnp.bfloat16)]
  monkeypatch.setattr(
    hf_safetensors, "_READ_CHUNK_BYTES", 1000
  )  # 3 rows of 64 float32, 1 row of 96
  for d, ref in zip((jnp.float32, jnp.bfloat16), reference):
    _assert_params_equal(_load(path, layout, dtype=d)[2], ref)


def test_scan_layout_stacks_the_loop_layout(hf_dirs):
  """A scanned load's [L, ...] leaves are the loop load's per-layer leaves, stacked."""
  _, _, loop = _load(hf_dirs["qwen2", False], "loop")
  _, _, scan = _load(hf_dirs["qwen2", False], "scan")
  for i in range(len(loop["layers"])):
    for a, b in zip(jax.tree.leaves(loop["layers"][i]), jax.tree.leaves(scan["layers"])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b[i]))


def _random_params(like, seed, dtype=np.float32):
  """Fresh random params shaped like ``like`` (either layout): unit-scale activations, norms and
  biases off 1 and 0."""
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
    else:  # [in, out] or stacked [L, in, out] kernel
      out.append(noise * x.shape[-2] ** -0.5)
  return jax.tree.unflatten(treedef, [jnp.asarray(x.astype(dtype)) for x in out])


def _assert_hf_holds(hf_model, params):
  """transformers' loaded tensors are exactly our exported ones (bitwise, every tensor)."""
  state = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
  ours = dict(hf.to_hf_tensors(params))
  tied = hf_model.config.tie_word_embeddings
  assert set(state) == set(ours) | ({"lm_head.weight"} if tied else set())
  for name, x in ours.items():
    np.testing.assert_array_equal(state[name], x.astype(np.float32), err_msg=name)


# Every kind in both layouts, alternating tied/untied and single-file/sharded exports.
EXPORTS = [
  ("qwen2", False, "loop", None),
  ("qwen2", True, "scan", 100_000),
  ("qwen3", False, "scan", None),
  ("qwen3", True, "loop", 100_000),
  ("llama", False, "loop", 100_000),
  ("llama", True, "scan", None),
]


@pytest.mark.parametrize(
  "kind,tie,layout,shard_bytes",
  EXPORTS,
  ids=[f"{_name(k, t)}-{lay}-{'sharded' if s else 'single'}" for k, t, lay, s in EXPORTS],
)
def test_export_round_trip(hf_dirs, tmp_path, kind, tie, layout, shard_bytes):
  cfg, _, loaded = _load(hf_dirs[kind, tie], layout)
  params = _random_params(loaded, seed=3)
  kwargs = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
  hf.save_hf_checkpoint(cfg, params, tmp_path / "ours", **kwargs)
  assert (tmp_path / "ours/model.safetensors.index.json").exists() == (shard_bytes is not None)

  cfg2, graphdef, params2 = _load(tmp_path / "ours", layout)
  assert cfg2 == cfg
  _assert_params_equal(params2, params)

  hf_model = load_hf_model(tmp_path / "ours")
  assert type(hf_model).__name__ == _CLASSES[kind]
  _assert_hf_holds(hf_model, params)
  tokens, mask = left_padded_batch(cfg.vocab_size)
  _assert_logits_match(
    our_logits(graphdef, params, tokens, mask), hf_logits(hf_model, tokens, mask), mask, cfg
  )
  # And back: transformers' own save of what it loaded gives our params again, bitwise.
  hf_model.save_pretrained(tmp_path / "theirs", max_shard_size="100KB")
  cfg3, _, params3 = _load(tmp_path / "theirs", layout)
  assert cfg3 == cfg
  _assert_params_equal(params3, params)


@pytest.mark.parametrize("kind,tie", KINDS, ids=[_name(*k) for k in KINDS])
def test_scan_export_equals_loop_export(hf_dirs, tmp_path, kind, tie):
  """Both layouts of the same weights write byte-identical files (same shards, same index)."""
  for layout in LAYOUTS:
    cfg, _, params = _load(hf_dirs[kind, tie], layout)
    hf.save_hf_checkpoint(cfg, params, tmp_path / layout, max_shard_bytes=100_000)
  names = sorted(p.name for p in (tmp_path / "loop").iterdir())
  assert names == sorted(p.name for p in (tmp_path / "scan").iterdir())
  assert len(names) >= 4  # config, index, 2+ shards
  for name in names:
    assert (tmp_path / "loop" / name).read_bytes() == (tmp_path / "scan" / name).read_bytes(), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_params_load_and_export(hf_dirs, tmp_path, layout):
  """param_dtype bfloat16: a float32 checkpoint loads rounded to bf16, exports as BF16 safetensors
  that transformers reads as the same bf16 tensors, and loads back bitwise."""
  path = hf_dirs["llama", False]
  _, _, params32 = _load(path, layout)
  cfg, _, params = _load(path, layout, dtype=jnp.bfloat16)
  assert cfg.param_dtype == "bfloat16" and cfg.dtype == "float32"
  for x, x32 in zip(jax.tree.leaves(params), jax.tree.leaves(params32)):
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x), np.asarray(x32).astype(ml_dtypes.bfloat16))

  hf.save_hf_checkpoint(cfg, params, tmp_path, max_shard_bytes=50_000)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  for f in tmp_path.glob("model-*.safetensors"):
    with safe_open(f, "pt") as st:
      assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
  hf_model = load_hf_model(tmp_path)
  assert {p.dtype for p in hf_model.parameters()} == {torch.bfloat16}
  _assert_hf_holds(hf_model, params)
  _, _, params2 = _load(tmp_path, layout, dtype=jnp.bfloat16)
  _assert_params_equal(params2, params)


def test_bfloat16_forward_matches_hf_bfloat16(hf_dirs):
  """A bf16-compute forward (bf16 params) is as close to the float32 logits as transformers' own
  bf16 forward is: ours may round differently, not worse (bf16 has 8 mantissa bits)."""
  path = hf_dirs["qwen2", False]
  tokens, mask = left_padded_batch(160)
  reference = hf_logits(load_hf_model(path), tokens, mask)[mask]
  hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
  hf_err = np.abs(hf_logits(hf_bf16, tokens, mask)[mask] - reference)
  for layout in LAYOUTS:
    _, graphdef, params = _load(path, layout, dtype=jnp.bfloat16, compute_dtype="bfloat16")
    ours = our_logits(graphdef, params, tokens, mask)[mask]
    assert np.all(np.isfinite(ours))
    err = np.abs(ours - reference)
    # Not a rounding bound but a comparison of two bf16 forwards' errors: both round the same
    # weights and (in the same order of operations) the same activations to bf16, so their errors
    # are of one size; CPUs differ only in the float32 sums before each rounding (~1e-6 of a
    # value), which changes a bf16 rounding rarely. Measured ratios 1.00 (means) and 0.99-1.06
    # (maxima) here; 1.5 leaves room for a few such changes, and a worse rounding scheme (a bf16
    # accumulation, a lost upcast) shows as several times HF's error.
    assert err.mean() <= 1.5 * hf_err.mean(), (err.mean(), hf_err.mean())
    assert err.max() <= 1.5 * hf_err.max(), (err.max(), hf_err.max())


# --- errors --------------------------------------------------------------------------------------


def _edited_copy(src, dst, edit):
  """Copy an HF dir as one ``model.safetensors``, applying ``edit(tensors_dict)`` first."""
  tensors = {}
  for f in sorted(src.glob("*.safetensors")):
    with safe_open(f, "np") as st:
      tensors.update((k, st.get_tensor(k)) for k in st.keys())
  edit(tensors)
  dst.mkdir()
  shutil.copy(src / "config.json", dst / "config.json")
  save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  return dst


def test_missing_tensor_is_named(hf_dirs, tmp_path):
  name = "model.layers.1.mlp.up_proj.weight"
  path = _edited_copy(hf_dirs["qwen2", False], tmp_path / "c", lambda t: t.pop(name))
  with pytest.raises(ValueError, match=rf"'{name}'.*missing"):
    hf_load.load_hf_checkpoint(path)
  with pytest.raises(ValueError, match=rf"'{name}'.*missing"):
    hf_load.load_hf_checkpoint(path, scan_layers=True)


def test_missing_untied_lm_head_is_named(hf_dirs, tmp_path):
  path = _edited_copy(hf_dirs["qwen3", False], tmp_path / "c", lambda t: t.pop("lm_head.weight"))
  with pytest.raises(ValueError, match=r"'lm_head.weight'.*missing"):
    hf_load.load_hf_checkpoint(path)


def test_shape_mismatch_is_named(hf_dirs, tmp_path):
  name = "model.layers.0.self_attn.k_proj.weight"
  path = _edited_copy(
    hf_dirs["qwen3", True],
    tmp_path / "c",
    lambda t: t.update({name: np.zeros((16, 64), np.float32)}),
  )
  with pytest.raises(ValueError, match=rf"'{name}' has shape \(16, 64\).*\(64, 64\)"):
    hf_load.load_hf_checkpoint(path)


def test_unexpected_tensors(hf_dirs, tmp_path):
  extra = "model.layers.0.mlp.extra_proj.weight"
  path = _edited_copy(
    hf_dirs["qwen2", False],
    tmp_path / "bad",
    lambda t: t.update({extra: np.zeros((2, 2), np.float32)}),
  )
  with pytest.raises(ValueError, match=rf"unexpected tensors \['{extra}'\]"):
    hf_load.load_hf_checkpoint(path)
  # Rotary caches are derived, so they are ignored.
  inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
  path = _edited_copy(
    hf_dirs["qwen2", False],
    tmp_path / "ok",
    lambda t: t.update({inv_freq: np.ones((8,), np.float32)}),
  )
  hf_load.load_hf_checkpoint(path)


def test_tied_checkpoint_with_lm_head(hf_dirs, tmp_path):
  def add_head(scale):
    return lambda t: t.update({"lm_head.weight": scale * t["model.embed_tokens.weight"]})

  src = hf_dirs["qwen2", True]
  _, _, reference = hf_load.load_hf_checkpoint(src)
  _, _, params = hf_load.load_hf_checkpoint(_edited_copy(src, tmp_path / "same", add_head(1.0)))
  _assert_params_equal(params, reference)
  with pytest.raises(ValueError, match="tie_word_embeddings.*differs"):
    hf_load.load_hf_checkpoint(_edited_copy(src, tmp_path / "diff", add_head(2.0)))


def test_tied_head_compared_chunk_by_chunk(hf_dirs, tmp_path, monkeypatch):
  """The tied-head check reads both tensors in pieces; a difference in the last row is found."""
  monkeypatch.setattr(hf_safetensors, "_READ_CHUNK_BYTES", 1000)  # 3 rows of 64 float32 per piece

  def last_row_differs(t):
    head = t["model.embed_tokens.weight"].copy()
    head[-1, -1] += 1.0
    t["lm_head.weight"] = head

  with pytest.raises(ValueError, match="tie_word_embeddings.*differs"):
    hf_load.load_hf_checkpoint(
      _edited_copy(hf_dirs["llama", True], tmp_path / "c", last_row_differs)
    )


def _config(hf_dirs, kind="qwen2"):
  return json.loads((hf_dirs[kind, False] / "config.json").read_text())


@pytest.mark.parametrize(
  "edit,match",
  [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
    # A size that is no positive integer, named (it reached the model's shapes: a traceback)
    ({"hidden_size": "sixty-four"}, "hidden_size must be a positive integer, got 'sixty-four'"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({"num_key_value_heads": 1.5}, "num_key_value_heads must be a positive integer, got 1.5"),
    ({"head_dim": True}, "head_dim must be a positive integer, got True"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_sliding_window": True}, "sliding"),
    (
      {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
      "rope_type 'yarn'",
    ),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    (
      {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
      "low_freq_factor",
    ),
  ],
)
def test_unsupported_config_is_named(hf_dirs, edit, match):
  config = {**_config(hf_dirs), **edit}
  config = {k: v for k, v in config.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    hf_config.model_config_from_hf(config)


def test_unsupported_model_type_dir(hf_dirs, tmp_path):
  path = shutil.copytree(hf_dirs["qwen2", False], tmp_path / "c")
  config = {**_config(hf_dirs), "model_type": "gemma"}
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="model_type 'gemma'"):
    hf_load.load_hf_checkpoint(path)


def test_config_defaults_follow_transformers(hf_dirs):
  """Older files: top-level rope_theta; absent θ / head_dim take transformers' defaults."""
  base = {k: v for k, v in _config(hf_dirs).items() if k not in ("rope_parameters", "head_dim")}
  assert hf_config.model_config_from_hf({**base, "rope_theta": 123.0}).rope_theta == 123.0
  for kind, head_dim in (("qwen2", 64 // 4), ("qwen3", 128), ("llama", 64 // 4)):
    config = {**base, "model_type": kind}
    cfg = hf_config.model_config_from_hf(config)
    ref = transformers.AutoConfig.for_model(**config)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"] == 10_000.0
    assert (
      cfg.head_dim
      == head_dim
      == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    )
    assert cfg.rms_norm_eps == ref.rms_norm_eps
