"""This library's GPT-OSS against transformers' GptOssForCausalLM (torch CPU, float32) on the same
HF checkpoint: logits, aux features and cached greedy generation past the sliding window."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import dense_from_mxfp4, random_hf_weights, tiny_hf_config, write_hf_checkpoint

from eagle3_jax.convert import load_gpt_oss
from eagle3_jax.models import gpt_oss
from eagle3_jax.spec import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("experts,shards", [("mxfp4", 2), ("dense", 1)])
def test_matches_transformers(tmp_path, experts, shards):
    cfg = tiny_hf_config()
    w = random_hf_weights(cfg, seed=np.random.randint(1 << 20))
    if experts == "dense":
        w = dense_from_mxfp4(w)
    write_hf_checkpoint(tmp_path, cfg, w, num_shards=shards)
    kw = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if experts == "mxfp4" else {}
    hf = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, **kw).eval()
    ours = load_gpt_oss(tmp_path, dtype=jnp.float32)

    tokens = np.random.default_rng().integers(0, 128, (2, 21))
    with torch.no_grad():
        r = hf(torch.as_tensor(tokens), output_hidden_states=True)
    want = r.logits.numpy().astype(np.float64)
    # jitted: compiles in a fraction of the eager op-by-op time (eager forward: tests/test_gpt_oss.py)
    logits, feats = nnx.jit(gpt_oss.forward, static_argnames="aux_layer_ids")(ours, tokens, aux_layer_ids=(0, 1, 2))
    assert np.abs(np.asarray(logits) - want).max() / np.abs(want).max() < 1e-3
    np.testing.assert_array_equal(np.argmax(logits, -1), want.argmax(-1))
    # transformers' hidden_states[k + 1] is the output of block k (for k < L - 1)
    hs = np.concatenate([r.hidden_states[k + 1].numpy() for k in (0, 1, 2)], -1)
    assert np.abs(np.asarray(feats) - hs).max() / np.abs(hs).max() < 1e-3

    prompt = tokens[0, :5].tolist()
    with torch.no_grad():
        ids = torch.as_tensor([prompt])  # an explicit mask: without one, transformers masks every id 0 as padding
        g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
    assert generate(ours, [prompt], 14, eos_ids=(), prefill_chunk=4).tokens[0] == g[0, 5:].tolist()
