"""Validate the fixtures (tests/hf_fixtures.py) and the float64 numpy reference
(tests/reference_np.py) against Hugging Face transformers' GptOssForCausalLM on CPU, float32.

What transformers (5.x) needs on CPU:
- dense (dequantized, bf16) layout: nothing special; config.json without quantization_config.
- MXFP4 layout (``*_blocks``/``*_scales`` + ``quantization_config: {quant_method: mxfp4}``):
  ``quantization_config=Mxfp4Config(dequantize=True)`` in ``from_pretrained``.  Without it the
  quantizer's ``validate_environment`` raises ImportError (it wants ``accelerate`` and then the
  triton ``kernels`` hub package); with it, ``Mxfp4Dequantize`` runs ``convert_moe_packed_tensors``
  into the plain ``GptOssExperts`` parameters, in the parameter dtype (float32 here, exact).
- Attention is "eager" by default (GptOss has ``_supports_sdpa = False``), which implements sinks.

Meaning of HF ``output_hidden_states`` (utils/output_capturing.py, ``tie_last_hidden_states``):
a tuple of L+1 tensors: [0] = the embedding output (input of layer 0), [i] for 1 <= i < L = the
output of decoder layer i-1, and [L] = ``last_hidden_state`` = the output of the LAST layer AFTER
the final ``model.norm`` (the raw output of the last block is replaced).  reference_forward's
hidden_states[L] is the raw block output (before the norm), so [L] is compared through the norm
and the raw output is captured with a forward hook on the last decoder layer.
"""

import copy
import json
import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # robust to pytest import modes
from hf_fixtures import (  # noqa: E402
    BF16,
    FP4_LUT,
    dense_from_mxfp4,
    dequantize_mxfp4_np,
    expected_shapes,
    random_hf_weights,
    read_hf_checkpoint,
    tiny_hf_config,
    write_hf_checkpoint,
)
from reference_np import (  # noqa: E402
    final_norm,
    reference_forward,
    reference_greedy,
    yarn_inv_freq_and_scale,
)

SEED = 1
B, T = 2, 24
REL_TOL = 1e-4


def _tokens(cfg, seed=SEED, b=B, t=T):
    toks = np.random.default_rng(seed).integers(0, cfg["vocab_size"], (b, t))
    # make sure the special ids (embedding padding_idx = pad_token_id) go through the model too
    if b >= 2 and t >= 18:
        toks[0, 3], toks[1, 5], toks[1, 17] = cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]
    return toks


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _load_hf(path, mxfp4):
    kw = {}
    if mxfp4:
        kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = transformers.GptOssForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw)
    model.eval()
    return model


def _hf_run(model, toks):
    """(logits, hidden_states tuple, raw output of the last decoder layer), float64 numpy."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = model(torch.tensor(toks, dtype=torch.long), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    hs = [h.double().numpy() for h in out.hidden_states]
    return out.logits.double().numpy(), hs, captured["last"].double().numpy()


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


@pytest.fixture(scope="module")
def weights(cfg):
    return random_hf_weights(cfg, SEED)


@pytest.fixture(scope="module", params=["mxfp4", "dense"])
def hf_case(request, cfg, weights, tmp_path_factory):
    """(layout, weights of that layout, loaded HF model); the two layouts hold the same values."""
    mxfp4 = request.param == "mxfp4"
    w = weights if mxfp4 else dense_from_mxfp4(weights)
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(path, cfg, w, num_shards=1 if mxfp4 else 3)
    return request.param, w, _load_hf(path, mxfp4)


@pytest.fixture(scope="module")
def ref_out(cfg, weights):
    toks = _tokens(cfg)
    router = []
    logits, hs = reference_forward(cfg, weights, toks, router_logits=router)
    return toks, logits, hs, router


# --------------------------------------------------------------------------------------------
# config / fixtures
# --------------------------------------------------------------------------------------------
def test_config_is_read_by_transformers(cfg):
    assert "rope_scaling" in cfg and "rope_parameters" not in cfg  # HF-shipped spelling
    c = transformers.GptOssConfig(**copy.deepcopy(cfg))  # (HF mutates the rope dict: copy)
    # transformers 5.x stores RoPE under `rope_parameters` (rope_scaling is a deprecated alias
    # property); the config.json `rope_scaling` dict is moved there, `rope_theta` merged in.
    rp = c.rope_parameters
    assert rp["rope_type"] == "yarn" and rp["factor"] == 4.0 and rp["truncate"] is False
    assert rp["original_max_position_embeddings"] == 256 and rp["rope_theta"] == 150000.0
    assert rp["beta_fast"] == 32.0 and rp["beta_slow"] == 1.0
    assert c.max_position_embeddings == 4 * 256
    assert c.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (c.sliding_window, c.head_dim, c.num_local_experts, c.num_experts_per_tok) == (8, 16, 8, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.intermediate_size) == (4, 2, 64, 64)
    assert c.attention_bias is True and c.tie_word_embeddings is False and c.swiglu_limit == 7.0
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert tiny_hf_config(quantization_config=None).get("quantization_config") is None
    # YaRN correction range strictly inside (0, head_dim/2 - 1): no clamping ambiguity, and the
    # ramp really blends the two frequency sets.
    d, theta = cfg["head_dim"], cfg["rope_theta"]
    low = d / 2 * math.log(256 / (32 * 2 * math.pi)) / math.log(theta)
    high = d / 2 * math.log(256 / (1 * 2 * math.pi)) / math.log(theta)
    assert 0 < low < high < d / 2 - 1
    assert T > cfg["sliding_window"]


def test_weights_shapes_dtypes_and_magnitudes(cfg, weights):
    shapes = expected_shapes(cfg, mxfp4=True)
    assert set(weights) == set(shapes)
    for k, v in weights.items():
        assert v.shape == shapes[k], k
        if k.endswith(("_blocks", "_scales")):
            assert v.dtype == np.uint8, k
        elif "layernorm" in k or k == "model.norm.weight":
            assert v.dtype == np.float32, k
        else:
            assert v.dtype == BF16, k
        if k.endswith(("bias", "sinks")):
            assert (v.astype(np.float32) != 0).mean() > 0.95, k
    dense = dense_from_mxfp4(weights)
    dshapes = expected_shapes(cfg, mxfp4=False)
    assert set(dense) == set(dshapes) and all(dense[k].shape == dshapes[k] for k in dense)
    assert all(dense[k].dtype == BF16 for k in dense if k.endswith(("gate_up_proj", "down_proj")))
    # dequantized expert weights have std ~ 1/sqrt(fan_in) (within a factor ~2)
    gu = dense["model.layers.0.mlp.experts.gate_up_proj"].astype(np.float64)
    assert 0.5 / 8 < gu.std() < 2.5 / 8
    bf = random_hf_weights(cfg, SEED, norm_dtype="bfloat16")
    assert bf["model.norm.weight"].dtype == BF16
    assert random_hf_weights(cfg, SEED, mxfp4=False).keys() == dense.keys()


@pytest.mark.parametrize("num_shards", [1, 3])
def test_checkpoint_roundtrip(tmp_path, cfg, weights, num_shards):
    safetensors = pytest.importorskip("safetensors")
    files = write_hf_checkpoint(tmp_path, cfg, weights, num_shards=num_shards)
    for f in files:
        assert (tmp_path / f).exists()
    cfg2, w2 = read_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    assert w2.keys() == weights.keys()
    for k in weights:
        assert w2[k].dtype == weights[k].dtype and np.array_equal(
            w2[k].view(np.uint8), weights[k].view(np.uint8)), k
    if num_shards > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(weights)
        assert sorted(set(index["weight_map"].values())) == [
            f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in weights.values())
    # the files are standard: safetensors' own reader sees BF16 / U8 / F32 and the same bytes
    st_files = [f for f in files if f.endswith(".safetensors")]
    seen = {}
    for f in st_files:
        with safetensors.safe_open(str(tmp_path / f), framework="pt") as sf:
            for k in sf.keys():
                seen[k] = sf.get_tensor(k)
    assert seen["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert seen["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert seen["model.norm.weight"].dtype == torch.float32
    k = "model.layers.1.self_attn.q_proj.weight"
    assert np.array_equal(seen[k].float().numpy(), weights[k].astype(np.float32))
    # dense layout drops the mxfp4 quantization_config from config.json
    d = tmp_path / "dense"
    write_hf_checkpoint(d, cfg, dense_from_mxfp4(weights))
    assert "quantization_config" not in json.loads((d / "config.json").read_text())


# --------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------
def test_dequantize_small_hand_example():
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x21  # low nibble 1 (+0.5) -> element 0, high nibble 2 (+1.0) -> element 1
    blocks[0, 0, 15] = 0xF9  # low 9 (-0.5) -> element 30, high 15 (-6) -> element 31
    out = dequantize_mxfp4_np(blocks, np.array([[128]], np.uint8))  # x 2^(128-127) = 2
    assert out.shape == (1, 32)
    assert out[0, 0] == 1.0 and out[0, 1] == 2.0 and out[0, 30] == -1.0 and out[0, 31] == -12.0
    assert np.all(out[0, 2:30] == 0)
    assert list(FP4_LUT) == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    E, rows, G = 3, 40, 5
    blocks = rng.integers(0, 256, (E, rows, G, 16), dtype=np.uint8)
    scales = rng.integers(90, 160, (E, rows, G), dtype=np.uint8)
    ours = dequantize_mxfp4_np(blocks, scales)  # [E, rows, G*32] (torch [out, in])
    theirs = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).double().numpy()
    assert theirs.shape == (E, G * 32, rows)  # HF returns the x @ W layout [E, in, out]
    np.testing.assert_array_equal(np.swapaxes(ours, 1, 2), theirs)
    assert np.abs(ours).max() > 0


def test_hf_loaded_experts_equal_dense_from_mxfp4(hf_case, cfg, weights):
    layout, w, model = hf_case
    dense = dense_from_mxfp4(weights)
    for i in range(cfg["num_hidden_layers"]):
        ex = model.model.layers[i].mlp.experts
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            got = getattr(ex, name).detach().double().numpy()
            want = dense[f"model.layers.{i}.mlp.experts.{name}"].astype(np.float64)
            np.testing.assert_array_equal(got, want, err_msg=f"{layout} layer {i} {name}")


# --------------------------------------------------------------------------------------------
# forward vs transformers
# --------------------------------------------------------------------------------------------
def test_fixture_is_not_near_ties(cfg, ref_out):
    """Guard: routing and top-1 are decided by margins far above float32 error, so agreement
    with HF below is meaningful and robust (a different seed could need re-checking)."""
    toks, logits, hs, router = ref_out
    k = cfg["num_experts_per_tok"]
    for r in router:
        s = np.sort(r, axis=-1)[..., ::-1]
        assert (s[..., k - 1] - s[..., k]).min() > 1e-3
    s = np.sort(logits, axis=-1)
    assert (s[..., -1] - s[..., -2]).min() > 1e-3
    # the experts used differ across tokens (top-k is not degenerate)
    used = {tuple(sorted(np.argsort(-r[b, t])[:k])) for r in router for b in range(B) for t in range(T)}
    assert len(used) > 20


def test_forward_matches_transformers(hf_case, cfg, ref_out):
    layout, w, model = hf_case
    toks, ref_logits, ref_hs, _ = ref_out
    if layout == "dense":  # the reference on the dense layout is the same computation
        lg2, _ = reference_forward(cfg, w, toks)
        assert _rel(lg2, ref_logits) < 1e-12
    logits, hs, last_raw = _hf_run(model, toks)
    assert logits.shape == (B, T, cfg["vocab_size"])
    err = _rel(logits, ref_logits)
    assert err < REL_TOL, f"{layout}: logits rel err {err}"
    np.testing.assert_array_equal(logits.argmax(-1), ref_logits.argmax(-1))

    L = cfg["num_hidden_layers"]
    assert len(hs) == L + 1 == len(ref_hs)
    for i in range(L):  # [0] embeddings, [i] output of block i-1
        assert _rel(hs[i], ref_hs[i]) < REL_TOL, f"{layout}: hidden_states[{i}]"
    # HF's last entry is AFTER the final norm; the raw last block output is the hook's
    assert _rel(hs[L], final_norm(cfg, w, ref_hs[L])) < REL_TOL
    assert _rel(last_raw, ref_hs[L]) < REL_TOL
    assert _rel(hs[L], ref_hs[L]) > 0.1  # i.e. it really is a different quantity


def test_reference_features_are_exercised(cfg, weights, ref_out):
    """Each feature visibly changes the output, so matching HF (previous test) checks it."""
    toks, ref_logits, _, _ = ref_out

    def variant(cfg_over=None, w_over=None):
        c = copy.deepcopy(cfg)
        c.update(cfg_over or {})
        w = dict(weights)
        w.update(w_over or {})
        return _rel(reference_forward(c, w, toks)[0], ref_logits)

    L = cfg["num_hidden_layers"]
    # sliding window (T > window): all-full attention differs
    assert variant({"layer_types": ["full_attention"] * L}) > 1e-2
    # YaRN vs plain RoPE with the same theta
    assert variant({"rope_scaling": {"rope_type": "default"}}) > 1e-2
    # YaRN concentration alone (inv_freq unchanged)
    rs = dict(cfg["rope_scaling"], attention_factor=1.0)
    assert variant({"rope_scaling": rs}) > 1e-2
    # swiglu clamp is active for some tokens
    assert variant({"swiglu_limit": 1e9}) > 1e-2
    # sinks matter
    nq = cfg["num_attention_heads"]
    assert variant(w_over={f"model.layers.{i}.self_attn.sinks": np.full(nq, -1e9) for i in range(L)}) > 1e-2
    # top-4 vs top-2 routing
    assert variant({"num_experts_per_tok": 2}) > 1e-2
    # the RoPE tables are really YaRN-blended: some dims kept, some interpolated, some mixed
    inv, scale = yarn_inv_freq_and_scale(cfg)
    base = 1.0 / cfg["rope_theta"] ** (np.arange(0, cfg["head_dim"], 2) / cfg["head_dim"])
    ratio = inv / base
    assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 0.25)
    assert np.any((ratio > 0.26) & (ratio < 0.99))
    assert np.isclose(scale, 0.1 * math.log(4.0) + 1.0)


def test_reference_batch_rows_independent(cfg, weights, ref_out):
    toks, ref_logits, _, _ = ref_out
    lg1, _ = reference_forward(cfg, weights, toks[1:2])
    assert _rel(lg1[0], ref_logits[1]) < 1e-12
    lg_short, _ = reference_forward(cfg, weights, toks[:, :10])  # causal: prefix unaffected
    assert _rel(lg_short, ref_logits[:, :10]) < 1e-12


def test_yarn_negative_low_is_clamped_like_transformers(tmp_path):
    """original_max_position_embeddings 32 with head_dim 16: low = -1.23 < 0.  HF clamps it to 0
    (``max(low, 0)``; docs/reference.md section 2 gives the formula unclamped, OpenAI's reference asserts
    ``0 < low``).  The reference follows HF; this only matters for tiny configs."""
    c = tiny_hf_config(rope_scaling={"original_max_position_embeddings": 32}, quantization_config=None)
    w = random_hf_weights(c, 3, mxfp4=False)
    write_hf_checkpoint(tmp_path, c, w)
    model = _load_hf(tmp_path, mxfp4=False)
    inv, scale = yarn_inv_freq_and_scale(c)
    np.testing.assert_allclose(model.model.rotary_emb.inv_freq.double().numpy(), inv, rtol=1e-6)
    assert np.isclose(model.model.rotary_emb.attention_scaling, scale)
    toks = _tokens(c, seed=4)
    logits, _, _ = _hf_run(model, toks)
    assert _rel(logits, reference_forward(c, w, toks)[0]) < REL_TOL


def test_greedy_matches_transformers_generate(cfg, weights, tmp_path):
    """reference_greedy (full re-forward) vs HF generate (KV cache, incl. sliding-window cache):
    the generated length passes the sliding window.  Dense layout (same values as MXFP4)."""
    w = dense_from_mxfp4(weights)
    write_hf_checkpoint(tmp_path, cfg, w)
    model = _load_hf(tmp_path, mxfp4=False)
    prompt = [int(t) for t in _tokens(cfg, seed=7, b=1, t=6)[0]]
    n = 14
    ours = reference_greedy(cfg, w, prompt, n)
    assert len(ours) == n
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.eos_token_id = None  # do not stop early; pure argmax
    gen_cfg.pad_token_id = cfg["pad_token_id"]
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: without one, transformers masks pad ids in the prompt
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg, max_new_tokens=n,
                             do_sample=False)
    theirs = out[0, len(prompt):].tolist()
    assert theirs == ours
    assert len(set(ours)) > 1  # not a degenerate constant continuation
