"""The EAGLE-3 draft (models/eagle3.py) and its HF converter (convert/hf_eagle3.py).

Every variant against the float64 numpy reference (tests/eagle3_reference_np.py) and, where it has
the variant, against SpecForge 0.2.0's `LlamaForCausalLMEagle3` (torch CPU, float32); the cached /
tree-masked decode pieces against the parallel forward; save -> load round trips; aux-layer
conventions; every converter error."""

import json
import os
import subprocess
import sys
import types
import warnings
import zipfile
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from eagle3_reference_np import (
    bf16_round,
    random_draft_weights,
    reference_forward,
    tiny_draft_config,
    to_target_ids,
    write_draft_checkpoint,
)
from flax import nnx
from hf_fixtures import read_safetensors, write_safetensors

from eagle3_jax.convert import frspec, load_eagle3, save_eagle3
from eagle3_jax.convert.hf_eagle3 import config_from_hf
from eagle3_jax.models import eagle3
from eagle3_jax.models.config import PRESETS

TARGET = PRESETS["tiny"]  # vocab 256, hidden 64, 4 layers
B, T, WINDOW = 2, 12, 5
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

# name -> config overrides (tiny_draft_config), writer options, load options, SpecForge has it
VARIANTS = {
    "plain": dict(sf=True),
    "norm_before_fc": dict(cfg=dict(norm_before_fc=True)),
    # nvidia v3 style: flag inside eagle_config, aux ids as hidden-state boundaries (4 = L)
    "norm_before_fc_nvidia": dict(cfg=dict(norm_before_fc=True, flags_in_eagle_config=True, aux_layer_ids=(1, 2, 4))),
    "fc_norm": dict(cfg=dict(fc_norm=True), sf=True),
    "norm_output_false": dict(cfg=dict(norm_output=False), sf=True),
    "norm_before_residual": dict(cfg=dict(norm_before_residual=True)),
    "yarn": dict(cfg=dict(rope_scaling=YARN, max_position_embeddings=512), sf=True),
    "llama3": dict(cfg=dict(rope_scaling=LLAMA3), sf=True),
    "sliding_window": dict(window=WINDOW, sf=True),
    "no_embed": dict(cfg=dict(hidden_size=64), embed=False, sf=True),
    "no_lm_head": dict(cfg=dict(hidden_size=64, draft_vocab_size=None), lm_head=False, sf=True),
    "layers0_prefix": dict(prefix="layers.0.", sf=True),
    "model_prefix": dict(key_prefix="model."),
    "everything": dict(cfg=dict(hidden_size=64, norm_before_fc=True, fc_norm=True, norm_output=False,
                                norm_before_residual=True, rope_scaling=YARN, max_position_embeddings=512),
                       embed=False, window=WINDOW),
}
NEUTRAL = {"norm_before_fc": False, "fc_norm": False, "norm_output": True, "norm_before_residual": False}


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(1 << 30))


def fake_target(seed: int):
    """What load_eagle3 / restrict_head read of a GptOss: config, embed [V, H], lm_head [V, H]."""
    rng = np.random.default_rng(seed)
    V, H = TARGET.vocab_size, TARGET.hidden_size
    return SimpleNamespace(config=TARGET,
                           embed=nnx.Param(jnp.asarray(rng.standard_normal((V, H)), jnp.float32)),
                           lm_head=nnx.Param(jnp.asarray(rng.standard_normal((V, H)) * 2 * H ** -0.5, jnp.float32)))


def make_variant(name: str, tmp_path, seed: int, dtype=np.float32):
    """Writes the variant's checkpoint; returns (config dict, HF weights, checkpoint dir, target, load kwargs)."""
    v = VARIANTS[name]
    cfg = tiny_draft_config(**v.get("cfg", {}))
    w = random_draft_weights(cfg, seed, prefix=v.get("prefix", "midlayer."), embed=v.get("embed", True),
                             lm_head=v.get("lm_head", True))
    if dtype != np.float32:
        w = bf16_round(w)
    path = tmp_path / name
    write_draft_checkpoint(path, cfg, w, dtype, key_prefix=v.get("key_prefix", ""))
    target = fake_target(seed + 1)
    return cfg, w, path, target, dict(target=target, sliding_window=v.get("window"))


def inputs(seed: int, vocab=256, ht=64):
    rng = np.random.default_rng(seed + 2)
    tokens = rng.integers(0, vocab, (B, T))
    # features of 3 target layers, growing in scale as real hidden states do
    feats = rng.standard_normal((B, T, 3 * ht)) * np.repeat([1.0, 2.0, 6.0], ht)
    return tokens, feats.astype(np.float32)


def ref_kwargs(target, w, window):
    return dict(embed=None if "embed_tokens.weight" in w else np.asarray(target.embed[...]),
                lm_head=None if "lm_head.weight" in w else np.asarray(target.lm_head[...]), sliding_window=window)


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


# ------------------------------------------------------------------------------------------------
# parity: float64 reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_matches_reference(tmp_path, name):
    seed = fresh_seed()
    cfg, w, path, target, kw = make_variant(name, tmp_path, seed)
    draft = load_eagle3(path, target.config, dtype=jnp.float32, **kw)
    tokens, feats = inputs(seed)
    got = np.asarray(eagle3.forward(draft, tokens, feats))
    want, _ = reference_forward(cfg, w, tokens, feats, **ref_kwargs(target, w, kw["sliding_window"]))
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-3, (name, seed)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=f"{name} seed {seed}")
    # draft-space top-1 mapped to target ids
    _, ids = eagle3.top_k(draft, jnp.asarray(got), 1)
    np.testing.assert_array_equal(np.asarray(ids)[..., 0], to_target_ids(w, want.argmax(-1)))

    if name in ("no_embed", "everything"):
        assert draft.embed is target.embed  # shared, not copied
    if name == "no_lm_head":
        assert draft.lm_head is target.lm_head and draft.config.draft_vocab_size == TARGET.vocab_size

    # the variant must matter: the same weights without it give clearly different logits
    if any(cfg.get(k, (cfg["eagle_config"]).get(k, d)) != d for k, d in NEUTRAL.items()) or \
            cfg.get("rope_scaling") or kw["sliding_window"]:
        plain = {k: v for k, v in cfg.items() if k not in NEUTRAL}
        plain["eagle_config"] = {k: v for k, v in cfg["eagle_config"].items() if k not in NEUTRAL}
        plain["rope_scaling"] = None
        off, _ = reference_forward(plain, w, tokens, feats, **{**ref_kwargs(target, w, None)})
        assert rel_err(off, want) > 0.02, name


def test_forward_rejects_wrong_feature_width(tmp_path):
    seed = fresh_seed()
    _, _, path, target, kw = make_variant("plain", tmp_path, seed)
    draft = load_eagle3(path, target.config, dtype=jnp.float32, **kw)
    tokens, feats = inputs(seed)
    with pytest.raises(ValueError, match="3 \\* target_hidden_size"):
        eagle3.forward(draft, tokens, feats[..., :-1])


# ------------------------------------------------------------------------------------------------
# parity: SpecForge 0.2.0
# ------------------------------------------------------------------------------------------------
SPECFORGE = "specforge==0.2.0"
SF_FILE = "specforge/modeling/draft/llama3_eagle.py"
SF_MODULE = "specforge.modeling.draft.llama3_eagle"


def _load_specforge_module(wheel: str, torch):
    """Executes only llama3_eagle.py from the wheel, its package imports stubbed."""
    src = zipfile.ZipFile(wheel).read(SF_FILE).decode()

    def module(name, package=False, **attrs):
        m = types.ModuleType(name)
        if package:
            m.__path__ = []
        m.__dict__.update(attrs)
        return m

    class Eagle3DraftModel(torch.nn.Module):  # the real base is a PreTrainedModel with loaders we don't need
        def __init__(self, config):
            super().__init__()

        def post_init(self):
            pass

    def register_draft(cls=None, **_):
        return cls if cls is not None else (lambda c: c)

    nothing = lambda *a, **k: None  # noqa: E731
    stubs = {
        "specforge": module("specforge", True), "specforge.modeling": module("specforge.modeling", True),
        "specforge.modeling.draft": module("specforge.modeling.draft", True),
        "specforge.utils": module("specforge.utils", print_with_rank=nothing),
        "specforge.distributed": module("specforge.distributed", get_sp_ring_group=nothing,
                                        get_sp_ulysses_group=nothing),
        "specforge.modeling.draft.flex_attention": module(
            "specforge.modeling.draft.flex_attention", compile_friendly_create_block_mask=nothing,
            compile_friendly_flex_attention=nothing, generate_eagle3_mask=nothing),
        "specforge.modeling.draft.base": module("specforge.modeling.draft.base", Eagle3DraftModel=Eagle3DraftModel),
        "specforge.modeling.draft.registry": module("specforge.modeling.draft.registry", register_draft=register_draft),
    }
    mod = module(SF_MODULE, __package__="specforge.modeling.draft", __file__=SF_FILE)
    stubs[SF_MODULE] = mod
    saved = {k: sys.modules.get(k) for k in stubs}
    try:
        sys.modules.update(stubs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flash_attn is not found"
            exec(compile(src, SF_FILE, "exec"), mod.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


@pytest.fixture(scope="module")
def specforge(request, tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    store = getattr(request.config, "cache", None)  # pytest's cache dir, kept between runs
    cache = store.mkdir("specforge-0.2.0") if store is not None else tmp_path_factory.mktemp("specforge")
    wheels = [f for f in os.listdir(cache) if f.endswith(".whl")]
    if not wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SPECFORGE,
                            "-d", str(cache), "-q"], capture_output=True, text=True)
        wheels = [f for f in os.listdir(cache) if f.endswith(".whl")]
        if r.returncode or not wheels:
            pytest.skip(f"could not download {SPECFORGE}: {r.stderr.strip()[-300:]}")
    return _load_specforge_module(os.path.join(cache, wheels[0]), torch), torch, transformers


def specforge_logits(sf, cfg, w, target, tokens, feats, window):
    mod, torch, transformers = sf
    hf = {k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config")}
    if hf["draft_vocab_size"] is None:
        hf["draft_vocab_size"] = hf["vocab_size"]  # nvidia: the target's head is the head
    lc = transformers.LlamaConfig(**hf)
    lc._attn_implementation = "eager"
    state = {k.replace("layers.0.", "midlayer."): torch.as_tensor(np.asarray(v)) for k, v in w.items()}
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = torch.as_tensor(np.array(target.embed[...]))
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = torch.as_tensor(np.array(target.lm_head[...]))
    dyn = torch._dynamo.config.disable
    torch._dynamo.config.disable = True  # SpecForge decorates rope and RMSNorm with torch.compile
    try:
        model = mod.LlamaForCausalLMEagle3(lc).eval()
        model.load_state_dict(state, strict="d2t" in state)
        pos = torch.arange(T)
        see = pos[None, :] <= pos[:, None]
        if window is not None:
            see &= pos[None, :] > pos[:, None] - window
        mask = torch.where(see, 0.0, torch.finfo(torch.float32).min)[None, None].expand(B, 1, T, T)
        with torch.no_grad():
            g = model.project_hidden_states(torch.as_tensor(feats))
            e = model.embed_input_ids(torch.as_tensor(tokens))
            h = model.backbone(e, g, cache_hidden=None, attention_mask=mask, position_ids=pos[None].expand(B, T))
            return model.compute_logits(h).numpy()
    finally:
        torch._dynamo.config.disable = dyn


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.get("sf")])
def test_forward_matches_specforge(tmp_path, specforge, name):
    seed = fresh_seed()
    cfg, w, path, target, kw = make_variant(name, tmp_path, seed)
    draft = load_eagle3(path, target.config, dtype=jnp.float32, **kw)
    tokens, feats = inputs(seed)
    want = specforge_logits(specforge, cfg, w, target, tokens, feats, kw["sliding_window"]).astype(np.float64)
    got = np.asarray(eagle3.forward(draft, tokens, feats))
    assert rel_err(got, want) < 1e-3, (name, seed)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=f"{name} seed {seed}")
    ref, _ = reference_forward(cfg, w, tokens, feats, **ref_kwargs(target, w, kw["sliding_window"]))
    assert rel_err(want, ref) < 1e-4, (name, seed)  # SpecForge and the float64 reference agree too


# ------------------------------------------------------------------------------------------------
# decode-side pieces: cached chunks and tree masks against the parallel forward
# ------------------------------------------------------------------------------------------------
layer = nnx.jit(eagle3.layer)  # eager op-by-op dispatch of the cached layer compiles far more slowly
DECODE_CFG = dict(rope_scaling=YARN, max_position_embeddings=512, norm_before_residual=True)


def _decode_draft(tmp_path, seed, window=4):
    cfg = tiny_draft_config(**DECODE_CFG)
    w = random_draft_weights(cfg, seed)
    write_draft_checkpoint(tmp_path / "d", cfg, w)
    return cfg, w, load_eagle3(tmp_path / "d", TARGET, dtype=jnp.float32, sliding_window=window)


def test_layer_in_cached_chunks_equals_forward(tmp_path):
    seed = fresh_seed()
    cfg, w, draft = _decode_draft(tmp_path, seed)
    tokens, feats = inputs(seed)
    g = eagle3.project(draft, jnp.asarray(feats))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h_full, _ = layer(draft, jnp.asarray(tokens, jnp.int32), g, pos, jnp.zeros((B,), jnp.int32), None, None)
    _, h_ref = reference_forward(cfg, w, tokens, feats, sliding_window=4)
    assert rel_err(h_full, h_ref) < 1e-4, seed

    T1, T2 = 7, 5
    start = np.array([T1, T1 - 2])  # sequence 1 commits only T1 - 2 of the first chunk
    cache = eagle3.init_cache(draft, B, 32)
    h1, cache = layer(draft, jnp.asarray(tokens[:, :T1], jnp.int32), g[:, :T1], pos[:, :T1],
                             jnp.zeros((B,), jnp.int32), None, cache)
    idx = start[:, None] + np.arange(T2)
    tok2 = np.take_along_axis(tokens, idx, 1)
    g2 = jnp.take_along_axis(g, jnp.asarray(idx)[..., None], 1)
    h2, cache = layer(draft, jnp.asarray(tok2, jnp.int32), g2, jnp.asarray(idx, jnp.int32),
                             jnp.asarray(start, jnp.int32), None, cache)
    h_full = np.asarray(h_full)
    np.testing.assert_allclose(np.asarray(h1), h_full[:, :T1], rtol=1e-5, atol=1e-5 * np.abs(h_full).max())
    np.testing.assert_allclose(np.asarray(h2), np.take_along_axis(h_full, idx[..., None], 1), rtol=1e-5,
                               atol=1e-5 * np.abs(h_full).max())
    # the cache holds the committed K/V where the next step reads them
    assert cache.k[0].shape == (B, cfg["num_key_value_heads"], 32, cfg["head_dim"])


def _pack(visible: np.ndarray) -> np.ndarray:
    """bool [..., N, N] -> uint32 [..., N, ceil(N/32)] (bit j % 32 of word j // 32 = key j)."""
    n = visible.shape[-1]
    words = np.zeros(visible.shape[:-1] + (-(-n // 32),), np.uint32)
    for j in range(n):
        words[..., j // 32] |= visible[..., j].astype(np.uint32) << np.uint32(j % 32)
    return words


def test_tree_step_equals_pathwise_forward(tmp_path):
    seed = fresh_seed()
    rng = np.random.default_rng(seed + 5)
    cfg, w, draft = _decode_draft(tmp_path, seed, window=4)
    H, P = cfg["hidden_size"], 6
    plen = np.array([6, 4])  # committed prefix per sequence (sequence 1's slots 4, 5 are scratch)
    parent = np.array([-1, 0, 0, 1, 1, 2, 4])
    N = parent.size
    depth = np.zeros(N, int)
    anc = np.eye(N, dtype=bool)
    for i in range(1, N):
        depth[i] = depth[parent[i]] + 1
        anc[i] |= anc[parent[i]]
    ptok, pg = rng.integers(0, 256, (B, P)), rng.standard_normal((B, P, H)).astype(np.float32) * 3
    ntok, ng = rng.integers(0, 256, (B, N)), rng.standard_normal((B, N, H)).astype(np.float32) * 3

    cache = eagle3.init_cache(draft, B, 32)
    ppos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    _, cache = layer(draft, jnp.asarray(ptok, jnp.int32), jnp.asarray(pg), ppos, jnp.zeros((B,), jnp.int32),
                            None, cache)
    npos = plen[:, None] + depth[None]
    h_tree, _ = layer(draft, jnp.asarray(ntok, jnp.int32), jnp.asarray(ng), jnp.asarray(npos, jnp.int32),
                             jnp.asarray(plen, jnp.int32), jnp.asarray(_pack(np.broadcast_to(anc, (B, N, N)))), cache)
    h_tree = np.asarray(h_tree)

    # path-wise: one causal sequence prefix + root..node per (sequence, node), padded to one length
    L = P + depth.max() + 1
    stok, sg, rows = np.zeros((B * N, L), int), np.zeros((B * N, L, H), np.float32), []
    for b in range(B):
        for i in range(N):
            path = np.flatnonzero(anc[i])  # ancestors in topological order = root .. i
            n = plen[b] + path.size
            stok[b * N + i, :n] = np.concatenate([ptok[b, :plen[b]], ntok[b, path]])
            sg[b * N + i, :n] = np.concatenate([pg[b, :plen[b]], ng[b, path]])
            rows.append(n - 1)
    spos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B * N, L))
    h_path, _ = layer(draft, jnp.asarray(stok, jnp.int32), jnp.asarray(sg), spos,
                             jnp.zeros((B * N,), jnp.int32), None, None)
    h_path = np.asarray(h_path)[np.arange(B * N), rows].reshape(B, N, H)
    np.testing.assert_allclose(h_tree, h_path, rtol=1e-5, atol=1e-5 * np.abs(h_path).max())

    # and the float64 reference with the same visibility
    vis = np.zeros((B, P + N, P + N), bool)
    vis[:, :P, :P] = np.tril(np.ones((P, P), bool))
    for b in range(B):
        vis[b, P:, :plen[b]] = True
    vis[:, P:, P:] = anc
    pos = np.concatenate([np.broadcast_to(np.arange(P), (B, P)), npos], 1)
    _, h_ref = reference_forward(cfg, w, np.concatenate([ptok, ntok], 1), g=np.concatenate([pg, ng], 1),
                                 positions=pos, visible=vis, sliding_window=4)
    assert rel_err(h_tree, h_ref[:, P:]) < 1e-4, seed
    # the window matters here: without it the nodes see more of the prefix
    _, h_nowin = reference_forward(cfg, w, np.concatenate([ptok, ntok], 1), g=np.concatenate([pg, ng], 1),
                                   positions=pos, visible=vis)
    assert rel_err(h_nowin[:, P:], h_ref[:, P:]) > 1e-2


# ------------------------------------------------------------------------------------------------
# converter: round trips, head restriction, prefixes, aux conventions
# ------------------------------------------------------------------------------------------------
def _flat(module) -> dict:
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}


def _assert_same_params(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=str(k))


@pytest.mark.parametrize("name,dtype", [(n, "float32") for n in VARIANTS] + [("plain", "bfloat16"),
                                                                             ("no_lm_head", "bfloat16")])
def test_save_load_round_trip(tmp_path, name, dtype):
    seed = fresh_seed()
    np_dtype = np.float32 if dtype == "float32" else __import__("ml_dtypes").bfloat16
    cfg, w, path, target, kw = make_variant(name, tmp_path, seed, np_dtype)
    a = load_eagle3(path, target.config, dtype=jnp.dtype(dtype), **kw)
    save_eagle3(a, tmp_path / "out")
    b = load_eagle3(tmp_path / "out", target.config, dtype=jnp.dtype(dtype), **kw)
    assert a.config.feature_layers == b.config.feature_layers
    assert a.config.replace(aux_layer_ids=(0, 0, 0), aux_convention="output") == \
        b.config.replace(aux_layer_ids=(0, 0, 0), aux_convention="output")  # ids may be respelled (see below)
    _assert_same_params(a, b)
    # the loaded parameters are the checkpoint's
    np.testing.assert_array_equal(np.asarray(a.fc[...], np.float32), np.asarray(w["fc.weight"].T, np.float32))
    saved = read_safetensors(str(tmp_path / "out" / "model.safetensors"))
    assert ("embed_tokens.weight" in saved) == ("embed_tokens.weight" in w)
    assert ("lm_head.weight" in saved) == ("d2t" in saved) == ("t2d" in saved) == ("lm_head.weight" in w)
    if "d2t" in w:
        np.testing.assert_array_equal(saved["d2t"], w["d2t"])
        np.testing.assert_array_equal(saved["t2d"], w["t2d"])
        np.testing.assert_array_equal(np.asarray(b.d2t[...]), w["d2t"])
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["num_hidden_layers"] == 1
    assert hf["draft_vocab_size"] == (cfg["draft_vocab_size"])
    if not a.config.own_embed:
        assert b.embed is target.embed
    if not a.config.own_lm_head:
        assert b.lm_head is target.lm_head


def test_save_keeps_the_aux_spelling(tmp_path):
    seed = fresh_seed()
    _, _, path, target, _ = make_variant("fc_norm", tmp_path, seed)
    for i, ids in enumerate([(1, 2, 4), (0, 2, 4)]):
        a = load_eagle3(path, TARGET, aux_layer_ids=ids, aux_convention="input")
        save_eagle3(a, tmp_path / f"out{i}")
        hf = json.loads((tmp_path / f"out{i}" / "config.json").read_text())
        assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(ids)
        assert hf["eagle_config"]["aux_layer_convention"] == "input"
        b = load_eagle3(tmp_path / f"out{i}", TARGET)
        assert b.config == a.config and b.config.feature_layers == ids
        _assert_same_params(a, b)
    out = load_eagle3(path, TARGET, aux_layer_ids=(0, 1, 2))  # output convention: no marker written
    save_eagle3(out, tmp_path / "plain")
    assert "aux_layer_convention" not in json.loads((tmp_path / "plain" / "config.json").read_text())["eagle_config"]


def test_no_lm_head_restricted_to_k_target_rows(tmp_path):
    seed = fresh_seed()
    cfg, w, path, target, kw = make_variant("no_lm_head", tmp_path, seed)
    draft = load_eagle3(path, target.config, dtype=jnp.float32, **kw)
    tokens, feats = inputs(seed)
    full = np.asarray(eagle3.forward(draft, tokens, feats))  # over the target's whole vocabulary
    ids = np.sort(np.random.default_rng(seed).choice(TARGET.vocab_size, 24, replace=False))
    small = frspec.restrict_head(draft, ids, source="target", target=target)
    got = np.asarray(eagle3.forward(small, tokens, feats))
    np.testing.assert_allclose(got, full[..., ids], rtol=1e-5, atol=1e-5 * np.abs(full).max())
    np.testing.assert_array_equal(np.asarray(eagle3.to_target_ids(small, jnp.arange(24))), ids)


def test_aux_conventions():
    def cfg(**kw):
        return config_from_hf(tiny_draft_config(**kw), TARGET)

    c = cfg(aux_layer_ids=(0, 1, 2))
    assert (c.aux_convention, c.feature_layers) == ("output", (1, 2, 3))
    c = cfg(aux_layer_ids=(1, 2, 4))  # 4 = L: only a hidden-state boundary can be L
    assert (c.aux_convention, c.feature_layers) == ("input", (1, 2, 4))
    c = config_from_hf(tiny_draft_config(aux_layer_ids=(0, 1, 2)), TARGET, aux_convention="input")
    assert (c.aux_convention, c.feature_layers) == ("input", (0, 1, 2))  # the explicit argument wins
    c = config_from_hf(tiny_draft_config(aux_layer_ids=(0, 1, 2)), TARGET, aux_layer_ids=(1, 2, 3))
    assert (c.aux_layer_ids, c.feature_layers) == ((1, 2, 3), (2, 3, 4))
    d = tiny_draft_config(aux_layer_ids=(0, 1, 2))
    d["eagle_config"]["aux_layer_convention"] = "input"
    assert config_from_hf(d, TARGET).feature_layers == (0, 1, 2)
    d = tiny_draft_config()
    del d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert config_from_hf(d, TARGET).aux_layer_ids == TARGET.default_aux_layer_ids()
    with pytest.raises(ValueError, match="aux_layer_ids"):
        config_from_hf(tiny_draft_config(aux_layer_ids=(1, 2, 4)), TARGET, aux_convention="output")
    # the variant flags are read from the top level or from eagle_config (nvidia v3)
    assert cfg(norm_before_fc=True, flags_in_eagle_config=True).norm_before_fc
    assert not cfg(norm_output=False).norm_output


def test_load_with_explicit_aux_arguments(tmp_path):
    seed = fresh_seed()
    _, _, path, target, kw = make_variant("plain", tmp_path, seed)
    d = load_eagle3(path, TARGET, aux_layer_ids=(1, 2, 4), aux_convention="input")
    assert d.config.feature_layers == (1, 2, 4)
    assert load_eagle3(path, TARGET).config.feature_layers == (1, 2, 3)


# ------------------------------------------------------------------------------------------------
# converter errors
# ------------------------------------------------------------------------------------------------
def _broken(tmp_path, edit_cfg=None, edit_w=None, **variant):
    cfg = tiny_draft_config(**variant)
    w = random_draft_weights(cfg, fresh_seed())
    if edit_cfg:
        edit_cfg(cfg)
    if edit_w:
        edit_w(w)
    write_draft_checkpoint(tmp_path, cfg, w)
    return tmp_path


def _bad_d2t(w):
    w["d2t"][-1] = 300 - (w["d2t"].size - 1)  # last draft id -> target id 300 >= 256


def _dup_d2t(w):
    w["d2t"][1] = w["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id


def _bad_t2d(w):
    t = w["t2d"]
    on, off = np.flatnonzero(t)[0], np.flatnonzero(~t)[0]
    t[on], t[off] = False, True


ERRORS = {
    "target_hidden_size": (dict(edit_cfg=lambda c: c.update(target_hidden_size=32)), "target_hidden_size 32"),
    "fc_shape": (dict(edit_w=lambda w: w.update({"fc.weight": w["fc.weight"][:, :96]})), "fc.weight: expected shape"),
    "missing_fc": (dict(edit_w=lambda w: w.pop("fc.weight")), "missing tensor fc.weight"),
    "d2t_outside_vocab": (dict(edit_w=_bad_d2t), "outside the target vocabulary"),
    "d2t_duplicate": (dict(edit_w=_dup_d2t), "same target id"),
    "vocab_mismatch": (dict(edit_cfg=lambda c: c.update(vocab_size=300)), "vocab_size 300 does not match"),
    "missing_lm_head": (dict(edit_w=lambda w: [w.pop(k) for k in ("lm_head.weight", "d2t", "t2d")]),
                        "draft_vocab_size is 40 but the checkpoint has no lm_head"),
    "t2d_inconsistent": (dict(edit_w=_bad_t2d), "t2d does not mark"),
    "num_hidden_layers": (dict(edit_cfg=lambda c: c.update(num_hidden_layers=2)), "num_hidden_layers is 2"),
    "not_eagle": (dict(edit_cfg=lambda c: c.update(architectures=["LlamaForCausalLM"])), "not an EAGLE-3 draft"),
    "missing_midlayer": (dict(edit_w=lambda w: w.pop("midlayer.self_attn.q_proj.weight")),
                         "missing tensor midlayer.self_attn.q_proj.weight"),
    "lm_head_shape": (dict(edit_w=lambda w: w.update({"lm_head.weight": w["lm_head.weight"][:-1]})),
                      "lm_head.weight: expected shape"),
    # weights the draft has no place for must not be dropped silently
    "attention_bias": (dict(edit_w=lambda w: w.update({"midlayer.self_attn.q_proj.bias": np.zeros(48, np.float32)})),
                       "no place for: midlayer.self_attn.q_proj.bias"),
    "fc_bias": (dict(edit_w=lambda w: w.update({"fc.bias": np.zeros(48, np.float32)})), "no place for: fc.bias"),
    "two_layers": (dict(edit_w=lambda w: w.update({"layers.1.mlp.up_proj.weight": w["midlayer.mlp.up_proj.weight"]})),
                   "no place for: layers.1.mlp.up_proj.weight"),
    # a 40-token head with no map to target ids: not the identity
    "no_vocab_map": (dict(edit_w=lambda w: [w.pop(k) for k in ("d2t", "t2d")]), "neither d2t nor t2d"),
    "t2d_count": (dict(edit_w=lambda w: [w.pop("d2t"), w["t2d"].__setitem__(np.flatnonzero(~w["t2d"])[0], True)]),
                  "t2d marks 41 target ids for a draft vocabulary of 40"),
    "t2d_not_mask": (dict(edit_w=lambda w: w.update(t2d=w["t2d"].astype(np.int64) * 2)), "0/1 mask"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_converter_errors(tmp_path, case):
    kw, msg = ERRORS[case]
    path = _broken(tmp_path, **kw)
    with pytest.raises(ValueError, match=msg):
        load_eagle3(path, TARGET, dtype=jnp.float32)


def test_sharing_errors(tmp_path):
    # no embed_tokens: the target is needed, and its width must fit the draft
    cfg = tiny_draft_config()  # hidden 48 != the target's 64
    w = random_draft_weights(cfg, 0, embed=False)
    write_draft_checkpoint(tmp_path / "a", cfg, w)
    with pytest.raises(ValueError, match="pass target="):
        load_eagle3(tmp_path / "a", TARGET)
    with pytest.raises(ValueError, match="does not fit its hidden_size 48"):
        load_eagle3(tmp_path / "a", target=fake_target(0))
    with pytest.raises(ValueError, match="pass target_config"):
        load_eagle3(tmp_path / "a")
    os.remove(tmp_path / "a" / "config.json")
    with pytest.raises(ValueError, match="config.json not found"):
        load_eagle3(tmp_path / "a", TARGET)


def test_full_vocab_head_without_draft_vocab_size(tmp_path):
    """An lm_head [V, H] with draft_vocab_size null is the draft's own full-vocab head (not ignored)."""
    cfg = tiny_draft_config(draft_vocab_size=None)
    w = random_draft_weights(cfg, fresh_seed())  # lm_head [256, 48], no d2t
    write_draft_checkpoint(tmp_path, cfg, w)
    d = load_eagle3(tmp_path, TARGET, dtype=jnp.float32)
    assert d.config.own_lm_head and d.config.draft_vocab_size == 256
    np.testing.assert_array_equal(np.asarray(d.lm_head[...]), w["lm_head.weight"])


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm"])
def test_variant_implied_by_its_tensors(tmp_path, flag):
    """input_norm.weight / fc_norm.*.weight switch their variant on where config.json leaves the flag
    out (ignored, they would give tau ~ 1): the forward matches the reference with the variant."""
    seed = fresh_seed()
    cfg = tiny_draft_config(**{flag: True})
    w = random_draft_weights(cfg, seed)
    quiet = {k: v for k, v in cfg.items() if k != flag}
    write_draft_checkpoint(tmp_path, quiet, w)
    d = load_eagle3(tmp_path, TARGET, dtype=jnp.float32)
    assert getattr(d.config, flag)
    tokens, feats = inputs(seed)
    want, _ = reference_forward(cfg, w, tokens, feats)
    assert rel_err(np.asarray(eagle3.forward(d, tokens, feats)), want) < 1e-3


@pytest.mark.parametrize("t2d_dtype", ["bool", "int64", "uint8"])
def test_d2t_derived_from_t2d(tmp_path, t2d_dtype):
    """A draft that ships only t2d (a bool or 0/1 integer mask): draft id i maps to its i-th marked
    target id, which is what d2t says."""
    cfg = tiny_draft_config()
    w = random_draft_weights(cfg, fresh_seed())
    d2t = w.pop("d2t")
    w["t2d"] = w["t2d"].astype(t2d_dtype)
    write_draft_checkpoint(tmp_path, cfg, w)
    d = load_eagle3(tmp_path, TARGET, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(d.d2t[...]), d2t)


def test_draft_vocab_from_the_head(tmp_path):
    """No draft_vocab_size in config.json: the lm_head's rows give it (40 here), d2t maps it."""
    cfg = tiny_draft_config()
    w = random_draft_weights(cfg, fresh_seed())
    write_draft_checkpoint(tmp_path, {k: v for k, v in cfg.items() if k != "draft_vocab_size"}, w)
    d = load_eagle3(tmp_path, TARGET, dtype=jnp.float32)
    assert d.config.own_lm_head and d.config.draft_vocab_size == 40
    np.testing.assert_array_equal(np.asarray(d.d2t[...]), w["d2t"])


def test_tied_head_is_the_drafts_embedding(tmp_path):
    """tie_word_embeddings with the draft's own embed_tokens and no lm_head: the head is that
    embedding over the full vocabulary (transformers' tying), not the target's lm_head."""
    cfg = dict(tiny_draft_config(hidden_size=64, draft_vocab_size=None), tie_word_embeddings=True)
    w = random_draft_weights(cfg, fresh_seed(), lm_head=False)
    write_draft_checkpoint(tmp_path, cfg, w)
    d = load_eagle3(tmp_path, target=fake_target(0), dtype=jnp.float32)
    assert d.config.own_lm_head and d.config.draft_vocab_size == TARGET.vocab_size
    np.testing.assert_array_equal(np.asarray(d.lm_head[...]), w["embed_tokens.weight"])


def test_rotary_buffers_are_not_weights(tmp_path):
    cfg = tiny_draft_config()
    w = random_draft_weights(cfg, fresh_seed())
    w["midlayer.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    write_draft_checkpoint(tmp_path, cfg, w)
    load_eagle3(tmp_path, TARGET, dtype=jnp.float32)


def test_sliding_window_survives_save(tmp_path):
    seed = fresh_seed()
    _, _, path, target, kw = make_variant("sliding_window", tmp_path, seed)
    a = load_eagle3(path, TARGET, dtype=jnp.float32, **kw)
    save_eagle3(a, tmp_path / "out")
    assert load_eagle3(tmp_path / "out", TARGET, dtype=jnp.float32).config.sliding_window == WINDOW
    assert load_eagle3(path, TARGET, dtype=jnp.float32).config.sliding_window is None  # published drafts: full


def test_safetensors_header_shapes_checked(tmp_path):
    cfg = tiny_draft_config()
    w = random_draft_weights(cfg, 0)
    w["midlayer.mlp.up_proj.weight"] = w["midlayer.mlp.up_proj.weight"][:, :-1]
    os.makedirs(tmp_path, exist_ok=True)
    write_safetensors(str(tmp_path / "model.safetensors"), w)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="up_proj.weight: expected shape"):
        load_eagle3(tmp_path, TARGET)


def test_forward_and_layer_reject_bad_shapes(tmp_path):
    # mismatched features / g / positions / cache used to fail deep inside (concatenate, vmap, dot_general)
    # or, for out-of-range or float token ids, not at all
    seed = fresh_seed()
    _, _, path, target, kw = make_variant("plain", tmp_path, seed)
    draft = load_eagle3(path, target.config, dtype=jnp.float32, **kw)
    tokens, feats = inputs(seed)
    V, H = TARGET.vocab_size, draft.config.hidden_size
    for tok, f, msg in ((tokens, feats[:, :-1],
                         r"features: shape \[2, 11, 192\], expected \[B, T, 3 \* target_hidden_size\]"),
                        (tokens, feats[0], r"features: shape \[12, 192\]"),
                        (tokens[0], feats[0], r"next_tokens: expected token ids of shape \[B, T\]"),
                        (tokens + V, feats, "next_tokens: token id .* outside the vocabulary"),
                        (tokens + 0.5, feats, "next_tokens: expected integer token ids")):
        with pytest.raises(ValueError, match=msg):
            eagle3.forward(draft, tok, f)
    with pytest.raises(ValueError,
                       match=r"features: shape \[2, 12, 128\], expected \[..., 3 \* target_hidden_size = 192\]"):
        eagle3.project(draft, feats[..., :128])
    tok = jnp.asarray(tokens, jnp.int32)
    g = jnp.zeros((B, T, H), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    zero = jnp.zeros((B,), jnp.int32)
    for args, msg in (((tok, jnp.asarray(feats), pos, zero, None, None), "g shape .*expected \\[B, T, hidden_size\\]"),
                      ((tok, g, pos[:, :3], zero, None, None), "positions shape"),
                      ((tok, g, pos, zero[:1], None, None), "lengths shape"),
                      ((tok, g, pos, zero, None, eagle3.init_cache(draft, B, 8)), "12 tokens do not fit a cache of 8"),
                      ((tok, g, pos, zero, None, eagle3.init_cache(draft, 3, 16)), "cache batch 3, tokens batch 2")):
        with pytest.raises(ValueError, match=msg):
            eagle3.layer(draft, *args)
    Vd = draft.config.draft_vocab_size
    for k, msg in ((0, "k: must be an integer >= 1, got 0"), (Vd + 1, f"k={Vd + 1} > {Vd}, the draft vocabulary"),
                   (2.0, "k: expected an integer, got 2.0")):
        with pytest.raises(ValueError, match=f"top_k: {msg}"):
            eagle3.top_k(draft, jnp.zeros((B, Vd)), k)
