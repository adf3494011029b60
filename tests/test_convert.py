"""HF GPT-OSS converter: layouts, round trips and every error it promises."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import dense_from_mxfp4, random_hf_weights, tiny_hf_config, write_hf_checkpoint

from eagle3_jax.convert import load_gpt_oss, params, restore_checkpoint, save_checkpoint, save_gpt_oss
from eagle3_jax.models import GptOssConfig, gpt_oss


@pytest.fixture
def hf(tmp_path):
    cfg = tiny_hf_config()
    return cfg, random_hf_weights(cfg, seed=np.random.randint(1 << 20)), tmp_path / "ckpt"


def assert_same_params(a, b):
    la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_packed_experts_stay_packed(hf):
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w)
    m = load_gpt_oss(path)
    ex = m.layers[0].mlp.experts
    assert ex.gate_up_blocks[...].dtype == jnp.uint8 and ex.gate_up_blocks[...].shape == (8, 128, 2, 16)
    np.testing.assert_array_equal(ex.down_scales[...], w["model.layers.0.mlp.experts.down_proj_scales"])
    assert m.embed[...].dtype == jnp.bfloat16 and m.norm.scale[...].dtype == jnp.float32


def test_qkv_fill_the_fused_projection_in_order(hf):
    """q, k, v (weights and biases) land one after the other in wqkv / bqkv ([out, in], as HF stores
    them), each in its own rows."""
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w)
    att = load_gpt_oss(path, dtype=jnp.float32).layers[1].self_attn
    p = "model.layers.1.self_attn."
    np.testing.assert_array_equal(np.asarray(att.wqkv[...]), np.concatenate(
        [w[p + f"{n}_proj.weight"].astype(np.float32) for n in "qkv"], axis=0))
    np.testing.assert_array_equal(np.asarray(load_gpt_oss(path, dtype=jnp.float32).layers[1].self_attn.wo[...]),
                                  w[p + "o_proj.weight"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(att.bqkv[...]), np.concatenate(
        [w[p + f"{n}_proj.bias"].astype(np.float32) for n in "qkv"]))


def test_filler_rejects_a_partly_filled_param():
    var = nnx.Param(jnp.zeros((3, 6)))
    fill = params.Filler()
    fill.put(var, np.ones((3, 2)), (0, 2))
    fill.put(var, np.full((3, 2), 2.0), (4, 6))
    with pytest.raises(RuntimeError, match="left with columns unset"):
        fill.finish()
    fill.put(var, np.full((3, 2), 3.0), (2, 4))
    fill.finish()
    np.testing.assert_array_equal(np.asarray(var[...]), np.repeat([[1.0, 1, 3, 3, 2, 2]], 3, axis=0))
    # along the first axis (the target's wqkv rows): set once every row is in
    var = nnx.Param(jnp.zeros((5, 2)))
    fill = params.Filler()
    fill.put(var, np.ones((2, 2)), (0, 2), axis=0)
    fill.put(var, np.full((3, 2), 2.0), (2, 5), axis=0)
    fill.finish()
    np.testing.assert_array_equal(np.asarray(var.get_value()), [[1, 1]] * 2 + [[2, 2]] * 3)


@pytest.mark.parametrize("experts", ["mxfp4", "dense"])
def test_hf_save_load_round_trip(hf, experts, tmp_path):
    cfg, w, path = hf
    if experts == "dense":
        w = dense_from_mxfp4(w)
    write_hf_checkpoint(path, cfg, w)
    m = load_gpt_oss(path, dtype=jnp.bfloat16)
    out = tmp_path / "resaved"
    save_gpt_oss(m, out, max_shard_bytes=200_000)  # forces shards + index
    assert os.path.exists(out / "model.safetensors.index.json")
    assert_same_params(m, load_gpt_oss(out, dtype=jnp.bfloat16))
    assert GptOssConfig.from_hf(out) == m.config


def test_orbax_round_trip(hf, tmp_path):
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w)
    m = load_gpt_oss(path, dtype=jnp.float32)
    save_checkpoint(m, tmp_path / "orbax")
    r = restore_checkpoint(tmp_path / "orbax")
    assert r.config == m.config and r.dtype == m.dtype
    assert_same_params(m, r)
    meta_file = tmp_path / "orbax" / "eagle3_jax.json"
    meta = json.loads(meta_file.read_text())
    del meta["layout"]  # written before the layout field (separate wq / wk / wv)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="parameter layout 1, this version reads layout 3"):
        restore_checkpoint(tmp_path / "orbax")
    meta_file.write_text(json.dumps(dict(meta, layout=2)))  # wqkv and wo [in, out]
    with pytest.raises(ValueError, match=r"parameter layout 2, .* layout 3 \(wqkv and wo \[out, in\]\)"):
        restore_checkpoint(tmp_path / "orbax")


def test_missing_key(hf):
    cfg, w, path = hf
    del w["model.layers.2.self_attn.k_proj.bias"]
    write_hf_checkpoint(path, cfg, w)
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.2\.self_attn\.k_proj\.bias.*\[32\]"):
        load_gpt_oss(path)


def test_wrong_shape_names_file_key_and_shapes(hf):
    cfg, w, path = hf
    w["model.layers.1.self_attn.q_proj.weight"] = w["model.layers.1.self_attn.q_proj.weight"][:32]
    write_hf_checkpoint(path, cfg, w, num_shards=2)
    with pytest.raises(ValueError, match=r"model-0000\d-of-00002\.safetensors: model\.layers\.1\.self_attn\.q_proj"
                                         r"\.weight: expected shape \[64, 64\], found \[32, 64\]"):
        load_gpt_oss(path)


def test_packed_blocks_with_float_dtype(hf):
    cfg, w, path = hf
    k = "model.layers.0.mlp.experts.down_proj_scales"
    w[k] = w[k].astype(np.float32)
    write_hf_checkpoint(path, cfg, w)
    with pytest.raises(ValueError, match=rf"{k}: unexpected dtype F32"):
        load_gpt_oss(path)


def test_unknown_quantization(hf):
    cfg, w, path = hf
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    write_hf_checkpoint(path, cfg, w, match_quantization=False)
    with pytest.raises(ValueError, match=r"config\.json: quantization_config\.quant_method 'gptq'"):
        load_gpt_oss(path)


def test_unknown_expert_layout(hf):
    cfg, w, path = hf
    w = {k: v for k, v in w.items() if "experts.gate_up_proj_" not in k or k.endswith("bias")}
    write_hf_checkpoint(path, cfg, w)
    with pytest.raises(ValueError, match="unknown expert layout"):
        load_gpt_oss(path)


def test_truncated_file(hf):
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: .* needs bytes up to \d+, file has \d+"):
        load_gpt_oss(path)
    f.write_bytes(data[:5])
    with pytest.raises(ValueError, match="truncated"):
        load_gpt_oss(path)


def test_index_names_missing_shard(hf):
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w, num_shards=3)
    os.remove(path / "model-00002-of-00003.safetensors")
    with pytest.raises(ValueError, match=r"model-00002-of-00003\.safetensors: file not found"):
        load_gpt_oss(path)


def test_missing_config_and_folder(hf, tmp_path):
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w)
    os.remove(path / "config.json")
    with pytest.raises(ValueError, match="config.json not found"):
        load_gpt_oss(path)
    with pytest.raises(ValueError, match="checkpoint folder not found"):
        load_gpt_oss(tmp_path / "nowhere")


def test_config_mismatch_with_tensors(hf):
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w)
    c = json.loads((path / "config.json").read_text())
    c["hidden_size"] = 96
    (path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: expected shape \[128, 96\], found \[128, 64\]"):
        load_gpt_oss(path)


def test_tensors_the_config_has_no_place_for(hf):
    """attention_bias false with bias tensors present (or any weight the model would not read): a
    clear error, not a model that silently drops them."""
    cfg, w, path = hf
    write_hf_checkpoint(path, dict(cfg, attention_bias=False), w)
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.self_attn\.k_proj\.bias"):
        load_gpt_oss(path)


def test_f32_sinks_survive_save(hf, tmp_path):
    cfg, w, path = hf
    write_hf_checkpoint(path, cfg, w)
    m = load_gpt_oss(path, dtype=jnp.float32)
    sinks = m.layers[0].self_attn.sinks
    sinks.set_value(sinks[...] + jnp.float32(2.0 ** -12))  # not a bf16 value
    save_gpt_oss(m, tmp_path / "out")
    assert_same_params(m, load_gpt_oss(tmp_path / "out", dtype=jnp.float32))


def test_random_gpt_oss_packed():
    cfg = GptOssConfig.preset("tiny")
    m = gpt_oss.random_gpt_oss(cfg, seed=3)
    assert m.layers[0].mlp.experts.gate_up_blocks[...].dtype == jnp.uint8
    logits, _ = nnx.jit(gpt_oss.forward)(m, jnp.arange(10)[None])  # jitted: ~1 s to compile, eager ~7 s
    assert np.isfinite(np.asarray(logits)).all() and float(jnp.std(logits)) > 0.1


def test_random_gpt_oss_builds_again_without_compiling():
    # the jitted constructors are kept: the same config again (any seed) compiles nothing, same seed same values
    cfg = GptOssConfig.preset("tiny").replace(rms_norm_eps=1.5e-5)  # a config no other test built in this process
    first = gpt_oss.random_gpt_oss(cfg, seed=3, dtype=jnp.float32)
    compiles = []

    def listener(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        again = gpt_oss.random_gpt_oss(cfg, seed=3, dtype=jnp.float32)
        other = gpt_oss.random_gpt_oss(cfg, seed=4, dtype=jnp.float32)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [], compiles
    for (path, a), (_, b), (_, c) in zip(*(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(m))) for m in
                                           (first, again, other))):
        assert np.array_equal(np.asarray(a), np.asarray(b)), path
        if a.size > 64 and a.dtype != jnp.uint8:  # the random matrices (not the norms' ones): redrawn
            assert not np.array_equal(np.asarray(a), np.asarray(c)), path
