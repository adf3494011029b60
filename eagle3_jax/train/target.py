"""Next-token pretraining of a small GPT-OSS (the same `GptOss` module as gpt-oss-120b), and its
conversion to the shipped form (bf16, MXFP4 experts).

Training keeps every weight in float32 with dense experts and runs the MoE's "dense" path (each
expert on each token, weighted by the top-k routing: the same function, batched and
differentiable). `to_mxfp4` then packs the experts exactly as the HF checkpoints store them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from eagle3_jax.formats import mxfp4
from eagle3_jax.models import gpt_oss
from eagle3_jax.models.config import GptOssConfig, RopeConfig


def small_config(vocab_size: int, eos_id: int = 0, **overrides) -> GptOssConfig:
    """The trained pair's target: 6 layers alternating sliding (window 128) and full attention,
    8 experts with top-4, sinks, GQA 2:1, YaRN (factor 4 over 1024 positions); about 12M weights."""
    cfg = dict(vocab_size=vocab_size, hidden_size=256, intermediate_size=256, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
               num_experts_per_tok=4, sliding_window=128, max_position_embeddings=4096,
               rope=RopeConfig(factor=4.0, original_max_position_embeddings=1024, truncate=True),
               eos_token_ids=(eos_id,), pad_token_id=eos_id, bos_token_id=None, experts_format="dense")
    cfg.update(overrides)
    return GptOssConfig(**cfg)


def new_model(config: GptOssConfig, seed: int = 0) -> gpt_oss.GptOss:
    """A float32, dense-expert model for training, its MoE layers fixed to the "dense" path."""
    model = gpt_oss.GptOss(config.replace(experts_format="dense"), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    set_moe_path(model, "dense")
    return model


def set_moe_path(model: gpt_oss.GptOss, path: str | None) -> None:
    for block in model.layers:
        block.mlp.path = path


def lm_loss(model: gpt_oss.GptOss, batch: dict):
    """batch["tokens"] int32 [B, T + 1] -> (mean next-token cross-entropy in nats, {"accuracy"})."""
    tokens = batch["tokens"]
    if np.ndim(tokens) != 2 or np.shape(tokens)[1] < 2:
        raise ValueError(f'batch["tokens"]: expected [B, T + 1] with T >= 1, got shape {list(np.shape(tokens))}')
    logits, _ = gpt_oss.forward(model, tokens[:, :-1])
    labels = tokens[:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def to_mxfp4(model: gpt_oss.GptOss, dtype=jnp.bfloat16) -> gpt_oss.GptOss:
    """The trained dense model as a packed one: experts quantized to MXFP4 (`mxfp4.quantize`),
    other matrices cast to `dtype`, norms and sinks kept float32 (MoE path chosen by size again)."""
    cfg = model.config.replace(experts_format="mxfp4")
    packed = nnx.eval_shape(lambda: gpt_oss.GptOss(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    trained = dict(nnx.to_flat_state(nnx.state(model)))
    for path, var in nnx.to_flat_state(nnx.state(packed)):
        if path in trained:  # everything but the packed blocks and scales
            var.set_value(jnp.asarray(trained[path].get_value(), var.get_value().dtype))
    for i, block in enumerate(model.layers):
        ex, out = block.mlp.experts, packed.layers[i].mlp.experts
        for name in ("gate_up", "down"):
            blocks, scales = mxfp4.quantize(np.asarray(jax.device_get(getattr(ex, name)[...]), np.float32))
            getattr(out, name + "_blocks").set_value(jnp.asarray(blocks))
            getattr(out, name + "_scales").set_value(jnp.asarray(scales))
    return packed

