"""Byte roofline of decode and speculative steps (docs/reference.md 4): the fewest bytes a step must read.

A target pass over T tokens per sequence (batch B, committed context C) reads every dense weight
once, the packed bytes of each distinct routed expert once per layer, the lm_head once, and each
sequence's K/V (full layers: C positions; sliding layers: at most the window). Distinct experts
are the expectation under uniform top-k routing of B*T tokens unless measured counts are given.
The draft reads its weights once per forward and its one layer's K/V.

On a (data D, model M) mesh (`eagle3_jax.parallel`: bench.py --mesh) each function gives the bytes
the busiest device reads: B/D of the rows; the attention projections, lm_head and K/V heads split M
ways; the experts of the device holding the most of a layer's routed experts (expert parallel: each
holds E/M; `busiest_experts`, the expectation under uniform routing: at B=1 2.74 of a token's 4
experts at M = 2, 2.11 at M = 4); the router, norms, biases and the draft whole.
"""

from __future__ import annotations

import math

from jax.sharding import AbstractMesh

from eagle3_jax import parallel
from eagle3_jax.models.config import Eagle3Config, GptOssConfig

BF16 = 2
# gpt-oss-120b's published EAGLE-3 tau at 3 draft tokens (vLLM 2.29, SGLang 2.68, the seeds' 3.22: docs/reference.md 7),
# at which the benchmarks project speedups
PUBLISHED_TAU = (2.29, 2.68, 3.22)


def expert_bytes(c: GptOssConfig) -> float:
    """Packed MXFP4 bytes of one expert: nibbles + scales + bf16 biases (dense: bf16 weights)."""
    H, units = c.hidden_size, c.intermediate_size
    n = 2 * units * H + H * units
    per_weight = 0.5 + 1 / 32 if c.experts_format == "mxfp4" else BF16
    return n * per_weight + (2 * units + H) * BF16


def expected_distinct(c: GptOssConfig, tokens: int) -> float:
    """Expected distinct experts per layer when `tokens` tokens each pick k of E uniformly."""
    E, k = c.num_local_experts, c.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def busiest_experts(c: GptOssConfig, distinct: float, model: int) -> float:
    """Expected experts held by the device holding the most, when `distinct` of the E experts (a
    uniformly random set) are routed and each of `model` devices holds E/model of them: E[max over
    devices]. P(max <= m) is the share of sets with at most m in every device's group (the x^d
    coefficient of (sum_{i<=m} C(E/model, i) x^i)^model over C(E, d)); a fractional `distinct`
    interpolates between its neighbours. model 1: `distinct`."""
    E = c.num_local_experts
    if model == 1:
        return distinct

    def exact(d: int) -> float:
        size, total, mean = E // model, math.comb(E, d), 0.0
        for m in range(size):  # E[max] = sum over m of P(max > m)
            poly = [1]
            for _ in range(model):
                poly = [sum(poly[j - i] * math.comb(size, i) for i in range(min(m, size, j) + 1) if j - i < len(poly))
                        for j in range(min(len(poly) + m, d + 1))]
            mean += 1 - (poly[d] if d < len(poly) else 0) / total
        return mean

    lo = math.floor(distinct)
    return exact(lo) if lo == distinct else exact(lo) + (distinct - lo) * (exact(lo + 1) - exact(lo))


def target_bytes(c: GptOssConfig, batch: int, tokens: int, context: int, distinct_experts=None, *, data: int = 1,
                 model: int = 1, experts: str | None = None) -> dict:
    """Bytes of one target pass: dict of parts and 'total' (on a mesh: one device's, module docstring).
    experts: the experts' split over "model" (None: parallel.EXPERTS; "expert": the busiest device's
    whole experts; "tensor": 1/model of every routed expert, its units padded as
    parallel.expert_units pads them)."""
    H, D, Hq, Hkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    L = c.num_hidden_layers
    rows = batch / data
    attn_w = (H * Hq * D * 2 + 2 * H * Hkv * D) * BF16 / model + ((Hq + 2 * Hkv) * D + H) * BF16 + Hq * BF16 / model
    router = (H + 1) * c.num_local_experts * BF16
    d = expected_distinct(c, rows * tokens) if distinct_experts is None else distinct_experts
    kv_pos = sum(min(context, c.sliding_window) if c.is_sliding(i) else context for i in range(L))
    if (parallel.EXPERTS if experts is None else experts) == "tensor":
        units = parallel.expert_units(c, AbstractMesh((data, model), ("data", "model")), "tensor")
        expert = L * d * expert_bytes(c.replace(intermediate_size=units)) / model
    else:
        expert = L * busiest_experts(c, d, model) * expert_bytes(c)
    parts = dict(attention_weights=L * (attn_w + router + 2 * H * 4), experts=expert,
                 lm_head=c.vocab_size * H * BF16 / model, kv_read=rows * kv_pos * 2 * Hkv * D * BF16 / model,
                 kv_write=rows * tokens * L * 2 * Hkv * D * BF16 / model)
    parts["total"] = sum(parts.values())
    return parts


def draft_bytes(d: Eagle3Config, batch: int, context: int, *, data: int = 1) -> float:
    """Bytes of one draft forward (any few tokens): weights once plus the layer's K/V (on a mesh: one
    device's; the draft's weights are whole on each)."""
    H, D, Hq, Hkv, mlp = d.hidden_size, d.head_dim, d.num_attention_heads, d.num_key_value_heads, d.intermediate_size
    w = (3 * d.target_hidden_size * H + 2 * H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * mlp
         + (d.draft_vocab_size * H if d.own_lm_head else d.vocab_size * H)) * BF16
    kv = batch / data * min(context, d.sliding_window or context) * 2 * Hkv * D * BF16
    return w + kv


def step_bytes(c: GptOssConfig, d: Eagle3Config, batch: int, context: int, depth: int, num_nodes: int,
               distinct_experts=None, *, data: int = 1, model: int = 1, experts: str | None = None) -> dict:
    """One speculative step: `depth` draft forwards, the verify of num_nodes tokens, one extend
    (experts: as in `target_bytes`)."""
    verify = target_bytes(c, batch, num_nodes, context, distinct_experts, data=data, model=model,
                          experts=experts)["total"]
    one = draft_bytes(d, batch, context, data=data)
    return dict(draft=depth * one, verify=verify, extend=one, total=(depth + 1) * one + verify)
