import copy

import numpy as np
import pytest
from hf_fixtures import tiny_hf_config
from reference_np import yarn_inv_freq_and_scale

from eagle3_jax.models import GptOssConfig, RopeConfig
from eagle3_jax.models.config import FULL, SLIDING
from eagle3_jax.models.rope import inv_freq_and_scale


def test_presets_match_reference_table():
    c = GptOssConfig.preset("gpt-oss-120b")
    assert (c.num_hidden_layers, c.num_local_experts, c.num_experts_per_tok) == (36, 128, 4)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2880, 2880, 64, 8, 64)
    assert (c.vocab_size, c.sliding_window, c.max_position_embeddings) == (201088, 128, 131072)
    assert c.layer_types[:3] == (SLIDING, FULL, SLIDING) and c.layer_types.count(SLIDING) == 18
    assert c.rope == RopeConfig(theta=150000.0, rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                original_max_position_embeddings=4096, truncate=False)
    assert (c.swiglu_limit, c.swiglu_alpha, c.rms_norm_eps) == (7.0, 1.702, 1e-5)
    assert set(c.eos_token_ids) == {200002, 199999, 200012} and c.experts_format == "mxfp4"
    assert c.default_aux_layer_ids() == (1, 17, 32)
    s = GptOssConfig.preset("gpt-oss-20b")
    assert (s.num_hidden_layers, s.num_local_experts) == (24, 32)


def test_yarn_of_120b():
    """low/high from docs/reference.md 2: 8.0928 / 17.3980, concentration 1.34657."""
    inv, scale = inv_freq_and_scale(GptOssConfig().rope, 64, 131072)
    assert scale == pytest.approx(0.1 * np.log(32) + 1)
    freq = 150000.0 ** (np.arange(32) * 2 / 64)
    low, high = 8.0928, 17.3980
    mask = 1 - np.clip((np.arange(32) - low) / (high - low), 0, 1)
    want = (1 / (32 * freq)) * (1 - mask) + (1 / freq) * mask
    np.testing.assert_allclose(inv, want, rtol=1e-4)


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_from_hf_both_rope_spellings(spelling):
    hf = tiny_hf_config()
    if spelling == "rope_parameters":
        hf["rope_parameters"] = dict(hf.pop("rope_scaling"), rope_theta=hf.pop("rope_theta"))
    c = GptOssConfig.from_hf(hf)
    assert c.rope.factor == 4.0 and c.rope.original_max_position_embeddings == 256 and not c.rope.truncate
    assert c.rope.theta == 150000.0 and c.experts_format == "mxfp4" and c.eos_token_ids == (127,)
    inv, scale = inv_freq_and_scale(c.rope, c.head_dim, c.max_position_embeddings)
    ref_inv, ref_scale = yarn_inv_freq_and_scale(tiny_hf_config())
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-6)
    assert scale == pytest.approx(ref_scale)


def test_from_hf_defaults_are_transformers():
    """Fields a config.json leaves out take transformers' GptOssConfig defaults: head_dim 64 (not
    hidden / heads), YaRN factor 32 over 4096 positions; an explicit null rope_scaling is plain RoPE."""
    hf = tiny_hf_config()
    del hf["head_dim"], hf["rope_scaling"]
    c = GptOssConfig.from_hf(hf)
    assert c.head_dim == 64 and c.num_attention_heads * c.head_dim != c.hidden_size
    assert c.rope == RopeConfig(theta=hf["rope_theta"], rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                original_max_position_embeddings=4096, truncate=False)
    assert GptOssConfig.from_hf(dict(tiny_hf_config(), rope_scaling=None)).rope.rope_type == "default"


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 1.0), (1.0, 0.0), (0.707, 1.0)])
def test_yarn_mscale_as_transformers(mscale, mscale_all_dim):
    """attention_factor from mscale / mscale_all_dim where both are set (transformers'
    _compute_yarn_parameters: get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)),
    else 0.1 ln(factor) + 1."""
    hf = tiny_hf_config()
    hf["rope_scaling"] = dict(hf["rope_scaling"], factor=8.0, mscale=mscale, mscale_all_dim=mscale_all_dim)
    _, scale = inv_freq_and_scale(GptOssConfig.from_hf(hf).rope, 16, 2048)

    def get_mscale(m):
        return 0.1 * m * np.log(8.0) + 1.0

    want = get_mscale(mscale) / get_mscale(mscale_all_dim) if mscale and mscale_all_dim else get_mscale(1.0)
    assert scale == pytest.approx(want)


def test_from_hf_reads_layer_types_and_dense():
    hf = tiny_hf_config(quantization_config=None)
    hf["layer_types"] = [FULL, SLIDING, FULL, FULL]
    c = GptOssConfig.from_hf(hf)
    assert c.layer_types == (FULL, SLIDING, FULL, FULL) and c.experts_format == "dense"
    assert c.window(1) == 8 and c.window(0) is None


@pytest.mark.parametrize("field,value,match", [
    ("num_key_value_heads", 3, "num_attention_heads"),
    ("layer_types", ["sliding_attention"] * 3, "layer_types: has 3 entries"),
    ("layer_types", ["sliding_attention", "local", "full_attention", "full_attention"], "layer_types: unknown"),
    ("hidden_size", 0, "hidden_size"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope_type"),
    ("hidden_size", 48, "hidden_size: 48 must be a multiple of 32"),
    ("eos_token_id", 500, "eos_token_ids"),
    ("model_type", "llama", "model_type"),
])
def test_invalid_values_name_the_field(field, value, match):
    hf = copy.deepcopy(tiny_hf_config())
    hf[field] = value
    with pytest.raises(ValueError, match=match):
        GptOssConfig.from_hf(hf)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        GptOssConfig.preset("gpt-oss-7b")
