"""GPT-OSS in Flax NNX (docs/reference.md 2).

Pre-norm residual blocks: `x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x))`, a final RMSNorm and an
untied `lm_head`. On GPUs with bf16 activations the glue between the GEMMs runs as Pallas kernels
(`pallas/select.py` makes every such choice): each MoE output is added to the stream by the next
norm's kernel (pallas/norm.py), q/k/v bias, RoPE and the cache write run inside the attention kernel
(`attention.rope_attention`), and the MoE's norm, router and top k are two kernels
(pallas/moe_route.py). Attention has biases, GQA, one learned sink logit per query head, YaRN RoPE
and a sliding window on the layers `config.layer_types` marks. The MoE routes each token to its
top-k experts (softmax over the selected logits) through an interleaved, clamped SwiGLU; experts
are kept packed as MXFP4 (`Mxfp4Experts`) or dense (`DenseExperts`), both in [out, in] layout.

Entry points (all take the module itself and are traceable under `jax.jit`):
  forward(model, tokens, aux_layer_ids)      full sequence from position 0, no cache
  init_cache(model, batch, max_len)          empty per-layer KV buffers (rings on sliding layers)
  prefill(model, cache, tokens, lengths)     chunked prompt prefill into the cache
  step(model, cache, tokens, positions, lengths, mask)  cached multi-token step (decode / verify)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle3_jax import parallel
from eagle3_jax.checks import int_arg
from eagle3_jax.formats import mxfp4
from eagle3_jax.models import kv_cache as kvc
from eagle3_jax.models import rope
from eagle3_jax.models.config import GptOssConfig
from eagle3_jax.models.layers import F32, keep_position, normal, over_chunks, rows_dot, shape_of
from eagle3_jax.pallas import gemv, moe_route, select
from eagle3_jax.pallas import moe as moe_kernel
from eagle3_jax.pallas import norm as norm_kernel
from eagle3_jax.pallas.attention import rope_attention

GROUP_TILE = 64  # smallest rows of a scan tile of the grouped path (`group_tile`)


def group_tile(pairs: int, num_experts: int, kernel: bool = False) -> int:
    """Rows of a grouped-path tile: twice the mean pairs an expert, as a power of two, so that most
    experts fit one tile; within [GROUP_TILE, 256] for the scan (each tile dequantizes its expert),
    within [16, 128] for the Pallas kernels (the tile sizes measured: docs/perf/moe.md)."""
    lo, hi = (16, 128) if kernel else (GROUP_TILE, 256)
    return min(hi, max(lo, 1 << max(0, (2 * pairs // num_experts - 1).bit_length())))


def top_k_by_rank(x, k: int):
    """lax.top_k over the last axis (equal values: lower index first) for short rows: an entry's rank
    is the number of entries that beat it, and rank r < k goes to output r. [..., n] -> (values [..., k],
    indices int32 [..., k]). O(n^2) compares per row, one GPU fusion where lax.top_k runs a sort."""
    n = x.shape[-1]
    i = jnp.arange(n)
    xi, xj = x[..., :, None], x[..., None, :]
    rank = ((xj > xi) | ((xj == xi) & (i < i[:, None]))).sum(-1)  # [..., n]
    pick = rank[..., None, :] == jnp.arange(k)[:, None]  # [..., k, n]
    return (jnp.sum(jnp.where(pick, x[..., None, :], 0), -1).astype(x.dtype),
            jnp.sum(jnp.where(pick, i, 0), -1).astype(jnp.int32))


class RMSNorm(nnx.Module):
    """`x * rsqrt(mean(x^2) + eps) * scale` computed in float32, cast back to x.dtype. scale: f32 [dim]."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), F32))
        self.eps = eps

    def __call__(self, x):
        t = x.astype(F32)
        t = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + self.eps) * self.scale[...]
        return t.astype(x.dtype)

    def add(self, x, residual, ctx: parallel.RunContext = parallel.ONE_DEVICE):
        """(s, norm(s)) with s = x + residual rounded to x.dtype (residual None: s = x); x [B, ...].
        One Pallas kernel where `select.norm` says so (pallas/norm.py), where XLA runs up to three;
        under ctx's mesh each device runs it on its rows (XLA would gather a custom call's rows)."""
        if select.norm(x, policy=ctx.kernels) == "kernel":
            run = functools.partial(norm_kernel.add_rms_norm, eps=self.eps, interpret=ctx.kernels.interpret)
            rows = parallel.BATCH
            return ctx.local(run, (rows, P(), rows), (rows, rows))(x, self.scale[...], residual)
        s = x if residual is None else x + residual.astype(x.dtype)
        return s, self(s)


def qkv_rope(qkv, bias, cos, sin, num_heads, num_kv_heads, head_dim):
    """Fused projection [B, T, (Hq + 2 Hkv) * D] before its bias (bias [(Hq + 2 Hkv) * D] or None) ->
    q [B, T, Hq, D] and k [B, T, Hkv, D] biased and rotated, v [B, T, Hkv, D] biased. q and k rotate as
    one array, and the bias is added here rather than on the GEMM's output, where XLA on GPUs gives
    cuBLAS a bias epilogue that costs a copy kernel of its own (docs/perf/glue.md)."""
    B, T, _ = qkv.shape
    n = (num_heads + num_kv_heads) * head_dim
    qk, v = qkv[..., :n], qkv[..., n:]
    if bias is not None:
        qk, v = qk + bias[:n], v + bias[n:]
    qk = rope.apply(qk.reshape(B, T, num_heads + num_kv_heads, head_dim), cos, sin)
    return qk[:, :, :num_heads], qk[:, :, num_heads:], v.reshape(B, T, num_kv_heads, head_dim)


def qkv_order(num_heads: int, num_kv_heads: int, head_dim: int, blocks: int) -> np.ndarray:
    """Column order of the fused q|k|v axis in `blocks` head-aligned blocks: int [(Hq + 2 Hkv) * D],
    entry i the q|k|v-order column that column i holds. Block m (the m-th of `blocks` equal
    contiguous ranges) holds q heads m·Hq/blocks.., then k and v heads m·Hkv/blocks..: one device's
    heads when "model" splits the columns into `blocks` (blocks = 1: q|k|v, the identity)."""
    D, hq, hkv = head_dim, num_heads // blocks, num_kv_heads // blocks
    nq, nk = num_heads * D, num_kv_heads * D
    return np.concatenate([np.arange(start, start + n) for m in range(blocks) for start, n in
                           ((m * hq * D, hq * D), (nq + m * hkv * D, hkv * D), (nq + nk + m * hkv * D, hkv * D))])


def device_proj(x, w, ctx: parallel.RunContext, out_dtype=None, bias=None, bias_on=None):
    """x [R, K] @ w.T, w [N, K] (+ bias [N] where bias_on, a bool scalar; None: always) -> [R, N] in
    out_dtype (default: jnp.dot's), products and the bias summed in f32: a device's share of a
    projection inside shard_map over ctx's mesh. Where `select.rows_matmul` says so (one bf16 row of
    a small enough share on a GPU) through `gemv.rows_matmul`, the rest through `layers.rows_dot`."""
    if select.rows_matmul(x, w, policy=ctx.kernels) == "kernel":
        return gemv.rows_matmul(x, w, bias, bias_on, out_dtype=out_dtype or x.dtype, interpret=ctx.kernels.interpret)
    y = rows_dot(x, w, out_first=True, devices=ctx.model_size, preferred_element_type=out_dtype)
    if bias is None:
        return y
    on = True if bias_on is None else bias_on
    return (y.astype(F32) + jnp.where(on, bias.astype(F32), 0.0)).astype(y.dtype)


class Attention(nnx.Module):
    """Weights in [out, in] layout, as HF stores them: wqkv [(Hq + 2 Hkv) * D, H] (q, k, v rows one
    after the other), wo [H, Hq*D]; biases bqkv, bo; sinks f32 [Hq]. Each output's weights are
    contiguous, which a one-row product of a device's share streams fastest (`pallas/gemv.py`; faster
    than [in, out]: docs/perf/multi_gpu.md). q, k and v share one matrix so that a single token is one GEMM
    (apart, k and v's [2880, 512] became slower multiply + reduce fusions: docs/perf/glue.md);
    one row goes through the projections as two (`layers.rows_dot`), or under a mesh, as a device's
    share, through `device_proj`.
    qkv_blocks: the rows of wqkv and bqkv in `qkv_order(..., qkv_blocks)`: 1 (q|k|v) on one
    device; a model placed on a mesh (`parallel.shard` and the loaders with mesh=) holds them in
    model-size head-aligned blocks, so that each device's rows are its own heads' q, k and v."""

    def __init__(self, cfg: GptOssConfig, layer: int, dtype, rngs: nnx.Rngs):
        H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.window = cfg.window(layer)
        self.qkv_blocks = 1
        self.num_heads, self.num_kv_heads, self.head_dim = Hq, Hkv, D
        bias = (lambda n: nnx.Param(normal(rngs, (n,), 0.02, dtype))) if cfg.attention_bias else (lambda n: None)
        self.wqkv = nnx.Param(normal(rngs, ((Hq + 2 * Hkv) * D, H), H ** -0.5, dtype))
        self.wo = nnx.Param(normal(rngs, (H, Hq * D), (Hq * D) ** -0.5, dtype))
        self.bqkv, self.bo = bias((Hq + 2 * Hkv) * D), bias(H)
        self.sinks = nnx.Param(normal(rngs, (Hq,), 1.0, F32))

    def _proj(self, x, w, b, ctx: parallel.RunContext):
        y = rows_dot(x, w[...], out_first=True, devices=ctx.model_size)
        return y if b is None else y + b[...]

    def __call__(self, x, cos, sin, k_cache, v_cache, lengths, positions, mask, *, ctx: parallel.RunContext,
                 ring=False, n_write=None, partial=False):
        """x [B, T, H] -> (out [B, T, H], k_cache, v_cache with the new tokens' K/V written at positions
        lengths .. lengths + T - 1; caches of length 0 (no cache) are returned as they are).
        ring: the caches are this sliding layer's ring (models/kv_cache.py). n_write int32 [B] (prefill
        chunks): on a ring, only the first n_write[b] tokens are written, after attention has read it.
        Under ctx's mesh each device attends with its rows and heads (`RunContext.local`): its block of
        the projection's outputs is its heads' q, k and v (qkv_blocks = the "model" size), and
        o_proj's row-parallel GEMM sums the heads (XLA's all-reduce); with partial=True (under a mesh)
        out is each device's o_proj of its heads instead, f32 [M, B * T, H] (`parallel.reduce_add_norm` sums
        them; o_proj's bias on the first device's)."""
        B, T, _ = x.shape
        bqkv = None if self.bqkv is None else self.bqkv[...]
        kernel = select.target_attention(x, k_cache, policy=ctx.kernels) == "rope_kernel"
        attend = functools.partial(self._attend, kernel=kernel, ring=ring, policy=ctx.kernels)
        if ctx.mesh is None:
            qkv = rows_dot(x, self.wqkv[...], out_first=True)
            if self.qkv_blocks > 1:  # a model placed on a mesh, run without it: back to q|k|v order
                qkv, bqkv = self.qkv_columns(qkv), None if bqkv is None else self.qkv_columns(bqkv)
            o, k_cache, v_cache = attend(qkv, bqkv, self.sinks[...], cos, sin, k_cache, v_cache, lengths, positions,
                                         mask, n_write, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        else:
            M = ctx.model_size
            if self.qkv_blocks != M:
                raise ValueError(f"Attention: wqkv rows in {self.qkv_blocks} head-aligned blocks under a mesh whose "
                                 f'"model" axis has {M} devices; place the model with parallel.shard(model, mesh)')
            attend = functools.partial(attend, num_heads=self.num_heads // M, num_kv_heads=self.num_kv_heads // M)

            def project_attend(x, wqkv, *rest):  # a device's heads: its rows of wqkv, then attention
                qkv = device_proj(x.reshape(-1, x.shape[-1]), wqkv, ctx)
                return attend(qkv.reshape(*x.shape[:-1], -1), *rest)

            rows, heads, model = parallel.BATCH, parallel.BATCH_HEADS, parallel.MODEL
            o, k_cache, v_cache = ctx.local(
                project_attend, (rows, P(model, None), P(model), P(model), rows, rows, heads, heads, rows, rows, rows,
                                 rows),
                (P(parallel.DATA, None, model), heads, heads),
            )(x, self.wqkv[...], bqkv, self.sinks[...], cos, sin, k_cache, v_cache, lengths, positions, mask, n_write)
            if partial:
                return self._partial_proj(o, ctx), k_cache, v_cache
        return self._proj(o.reshape(B, T, -1), self.wo, self.bo, ctx), k_cache, v_cache

    def _partial_proj(self, o, ctx: parallel.RunContext):
        """o [B, T, Hq, D] (heads over "model") -> f32 [M, B * T, H]: each device's heads through its
        columns of wo, the bias on device 0's."""
        def body(o, wo, *bo):
            first = jax.lax.axis_index(parallel.MODEL) == 0
            return device_proj(o.reshape(-1, wo.shape[1]), wo, ctx, F32, *bo, bias_on=first)[None]

        bo = () if self.bo is None else (self.bo[...],)
        specs = (P(parallel.DATA, None, parallel.MODEL), P(None, parallel.MODEL)) + (P(),) * len(bo)
        return ctx.local(body, specs, parallel.PARTIALS)(o, self.wo[...], *bo)

    def qkv_columns(self, a, blocks: int = 1, axis: int = -1):
        """a with (Hq + 2 Hkv) * D entries along `axis` (q|k|v activations and bqkv: the last; wqkv:
        0) in this module's order -> the same in `qkv_order(..., blocks)` (default: q|k|v)."""
        if blocks == self.qkv_blocks:
            return a
        return jnp.take(a, self.qkv_reorder(blocks), axis=axis)

    def qkv_reorder(self, blocks: int) -> np.ndarray:
        """Indices taking columns in this module's order to `qkv_order(..., blocks)`: new = a[..., idx]."""
        order = qkv_order(self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_blocks)
        return np.argsort(order)[qkv_order(self.num_heads, self.num_kv_heads, self.head_dim, blocks)]

    def _attend(self, qkv, bqkv, sinks, cos, sin, k_cache, v_cache, lengths, positions, mask, n_write, *,
                num_heads, num_kv_heads, kernel, ring, policy):
        """The attention of `__call__` after the projection, over num_heads / num_kv_heads heads (all,
        or one device's): qkv [B, T, (num_heads + 2 num_kv_heads) * D] -> (o [B, T, num_heads, D],
        k_cache, v_cache). kernel: the fused rope + write + attention kernel where select says so;
        policy: the run's kernel policy."""
        kw = dict(window=self.window, scale=self.head_dim ** -0.5, ring=ring)
        if kernel and not (ring and n_write is not None):
            # bias, RoPE, the cache write and attention in one kernel
            return rope_attention(qkv, bqkv, cos, sin, k_cache, v_cache, lengths, positions, mask, sinks,
                                  num_heads=num_heads, num_kv_heads=num_kv_heads, interpret=policy.interpret, **kw)
        q, k, v = qkv_rope(qkv, bqkv, cos, sin, num_heads, num_kv_heads, self.head_dim)
        return kvc.attend(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, n_write, policy=policy, **kw)


class Mxfp4Experts(nnx.Module):
    """Packed experts exactly as the HF checkpoint stores them ([out, in] rows, blocks along in):
    gate_up_blocks u8 [E, 2I, H/32, 16], gate_up_scales u8 [E, 2I, H/32], gate_up_bias [E, 2I],
    down_blocks u8 [E, H, I/32, 16], down_scales u8 [E, H, I/32], down_bias [E, H]."""

    def __init__(self, cfg: GptOssConfig, dtype, rngs: nnx.Rngs):
        E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype

        def packed(rows, fan_in):
            g = fan_in // mxfp4.BLOCK
            blocks = jax.random.bits(rngs.params(), (E, rows, g, 16), jnp.uint8)
            s = mxfp4.random_scale_byte(fan_in)
            scales = jax.random.randint(rngs.params(), (E, rows, g), s - 1, s + 2).astype(jnp.uint8)
            return nnx.Param(blocks), nnx.Param(scales)

        self.gate_up_blocks, self.gate_up_scales = packed(2 * I, H)
        self.gate_up_bias = nnx.Param(normal(rngs, (E, 2 * I), 0.02, dtype))
        self.down_blocks, self.down_scales = packed(H, I)
        self.down_bias = nnx.Param(normal(rngs, (E, H), 0.02, dtype))

    def weights(self, e):
        """Expert ids int [...] -> (w1 [..., 2I, H], b1 [..., 2I], w2 [..., H, I], b2 [..., H]), dequantized."""
        w1 = mxfp4.dequantize(self.gate_up_blocks[...][e], self.gate_up_scales[...][e], self.dtype)
        w2 = mxfp4.dequantize(self.down_blocks[...][e], self.down_scales[...][e], self.dtype)
        return w1, self.gate_up_bias[...][e], w2, self.down_bias[...][e]


class DenseExperts(nnx.Module):
    """Unquantized experts in [out, in] layout: gate_up [E, 2I, H] (interleaved rows), down [E, H, I]."""

    def __init__(self, cfg: GptOssConfig, dtype, rngs: nnx.Rngs):
        E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up = nnx.Param(normal(rngs, (E, 2 * I, H), H ** -0.5, dtype))
        self.gate_up_bias = nnx.Param(normal(rngs, (E, 2 * I), 0.02, dtype))
        self.down = nnx.Param(normal(rngs, (E, H, I), I ** -0.5, dtype))
        self.down_bias = nnx.Param(normal(rngs, (E, H), 0.02, dtype))

    def weights(self, e):
        return self.gate_up[...][e], self.gate_up_bias[...][e], self.down[...][e], self.down_bias[...][e]


class MoE(nnx.Module):
    """Router (f32 logits, top-k, softmax over the selected) and the experts' clamped SwiGLU.
    expert_split: how a mesh's "model" axis splits the experts (`parallel.EXPERT_SPLITS`,
    `parallel.expert_partition`): set
    by `parallel.shard` and the loaders; "tensor" arrays hold I padded to what the mesh divides."""

    def __init__(self, cfg: GptOssConfig, dtype, rngs: nnx.Rngs):
        H, E = cfg.hidden_size, cfg.num_local_experts
        self.top_k, self.limit, self.alpha = cfg.num_experts_per_tok, cfg.swiglu_limit, cfg.swiglu_alpha
        self.router_w = nnx.Param(normal(rngs, (H, E), H ** -0.5, dtype))
        self.router_b = nnx.Param(normal(rngs, (E,), 0.1, dtype))
        self.path: str | None = None  # see __call__; set it (e.g. "dense" for training) to fix the path
        self.expert_split = "expert"
        cls = Mxfp4Experts if cfg.experts_format == "mxfp4" else DenseExperts
        self.experts = cls(cfg, dtype, rngs)

    def route(self, x, ctx: parallel.RunContext = parallel.ONE_DEVICE):
        """x [N, H] -> (expert ids int32 [N, k], combine weights f32 [N, k]).

        One token goes through the router as two rows (`rows_dot`). The top k by rank counting or by
        lax.top_k's sort as `select.router_top_k` says."""
        N = x.shape[0]
        logits = rows_dot(x, self.router_w[...], devices=ctx.model_size, preferred_element_type=F32)
        logits = logits + self.router_b[...].astype(F32)
        rank = select.router_top_k(N, policy=ctx.kernels) == "rank"
        top, ids = top_k_by_rank(logits, self.top_k) if rank else jax.lax.top_k(logits, self.top_k)
        return ids, jax.nn.softmax(top, axis=-1)

    def _swiglu(self, h):
        gate = jnp.minimum(h[..., ::2], self.limit)
        lin = jnp.clip(h[..., 1::2], -self.limit, self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (lin + 1)

    def _ffn(self, x, w1, b1, w2, b2, in_spec):
        """One expert (or one per row) on x; `in_spec` is the einsum spec of (x, w) -> out."""
        h = jnp.einsum(in_spec, x, w1, preferred_element_type=F32) + b1.astype(F32)
        act = self._swiglu(h).astype(x.dtype)
        return jnp.einsum(in_spec, act, w2, preferred_element_type=F32) + b2.astype(F32)

    PATHS = select.MOE_PATHS

    def __call__(self, x, path: str | None = None, norm: RMSNorm | None = None, dtype=None, partial=False, *,
                 ctx: parallel.RunContext = parallel.ONE_DEVICE):
        """x [..., H] -> [..., H] in `dtype` (default x.dtype); with `norm`, the experts see norm(x).
        partial=True (under ctx's mesh): each "model" device's sum over the experts it holds instead,
        f32 [M, N, H] (N = x's rows; `parallel.reduce_add_norm` sums them).
        `path` (else the module's `path` attribute, else ctx.kernels.moe, else chosen by size):
        "kernel" the Pallas kernels
        (GPU, MXFP4, bf16; few tokens: the norm, router and top k in pallas/moe_route.py, the experts
        in pallas/moe.py), "gathered" each
        (token, expert) pair's weights, "grouped" tokens grouped into expert tiles, "dense" every
        expert on every token (training: batched, differentiable; compute grows with E / k). By size:
        `select.moe` (the kernel where it applies, else gathered up to select.GATHER_MAX_PAIRS pairs
        but for packed experts of a small model, else dense for few experts, else grouped)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if partial:
            return self._on_shards(x, path, norm, ctx, partial=True)
        if ctx.mesh is None:
            out = self._run(x, path, norm, ctx)
        else:
            out = self._on_shards(x, path, norm, ctx)
        return out.astype(dtype or x.dtype).reshape(shape)

    def _run(self, x, path, norm, ctx: parallel.RunContext, first_expert=None, down_bias_on=None):
        """x [N, H] -> f32 [N, H] through the experts this module holds: all of them, or (first_expert
        int32, under a mesh) those numbered first_expert .. first_expert + held - 1, the other pairs
        adding nothing. down_bias_on (a bool scalar; None: True): whether down's bias is added (split
        "tensor": on one device); where it is False the kernel skips the bias and the other paths zero
        it in this (merged, local) module."""
        path = path or self.path or self._path_for(x, ctx)
        if path not in self.PATHS:
            raise ValueError(f"MoE path: {path!r} not in {self.PATHS}")
        if path == "kernel":
            return self._kernel(x, norm, ctx, first_expert, down_bias_on)
        if down_bias_on is not None:
            bias = self.experts.down_bias
            bias.set_value(jnp.where(down_bias_on, bias.get_value(), jnp.zeros((), bias.get_value().dtype)))
        x = x if norm is None else norm(x)
        ids, w = self.route(x, ctx)
        if first_expert is not None:
            ids, held = self._held(ids, first_expert)
            if path == "grouped":  # pairs not held get no tile
                ids = jnp.where(held, ids, -1)
            else:  # a held expert's weights, weight 0
                ids, w = jnp.clip(ids, 0, self.num_held - 1), jnp.where(held, w, 0.0)
        if path == "gathered":
            return self._gathered(x, ids, w)
        if path == "grouped":
            return self._grouped(x, ids, w, ctx.kernels)
        return self._dense(x, ids, w)

    @property
    def num_held(self) -> int:
        """Experts this module's arrays hold (all of them, or one device's share under shard_map)."""
        return self.experts.gate_up_bias.shape[0]

    def _held(self, ids, first_expert):
        """Global expert ids -> (ids among the held experts, whether each is held)."""
        ids = ids - first_expert
        return ids, (ids >= 0) & (ids < self.num_held)

    def _on_shards(self, x, path, norm, ctx: parallel.RunContext, partial=False):
        """The experts over ctx's mesh (`RunContext.local`): each device routes its rows (router
        replicated) and, split "expert", runs the pairs of the experts it holds (E / model of them,
        numbered from its index times that) or, split "tensor", every pair on its share of each
        expert's units (down's bias on the first device); the partial outputs are summed over
        "model": f32 [N, H]; partial: not summed, f32 [M, N, H] (P("model", "data"))."""
        graphdef, state = nnx.split(self)
        norm_def, norm_state = nnx.split(norm) if norm is not None else (None, None)
        split = self.expert_split

        def spec(p, _):
            keys = [getattr(k, "key", None) for k in p]
            return parallel.expert_partition(keys[1], split) if keys[0] == "experts" else P()

        held = self.num_held // ctx.model_size

        def body(state, norm_state, x):
            local = nnx.merge(graphdef, state)
            n = None if norm_def is None else nnx.merge(norm_def, norm_state)
            me = jax.lax.axis_index(parallel.MODEL)
            if split == "tensor":
                out = local._run(x, path, n, ctx, down_bias_on=me == 0)
            else:
                out = local._run(x, path, n, ctx, me * held)
            return out[None] if partial else jax.lax.psum(out, parallel.MODEL)

        specs = jax.tree_util.tree_map_with_path(spec, state)
        out_spec = parallel.PARTIALS if partial else parallel.BATCH
        return ctx.local(body, (specs, P(), parallel.BATCH), out_spec)(state, norm_state, x)

    def _path_for(self, x, ctx: parallel.RunContext):
        """The path `select.moe` picks for x [N, H] under ctx's kernel policy."""
        return select.moe(x, num_experts=self.router_w.shape[1], top_k=self.top_k,
                          packed=isinstance(self.experts, Mxfp4Experts), policy=ctx.kernels)

    def _dense(self, x, ids, w):
        """Every expert on every token, combined with the top-k weights (zero elsewhere). f32 [N, H]."""
        (N, H), E = x.shape, self.num_held
        # add, not set: under expert parallelism pairs not held are clipped onto a held expert, weight 0
        combine = jnp.zeros((N, E), F32).at[jnp.arange(N)[:, None], ids].add(w)
        y = self._ffn(jnp.broadcast_to(x[:, None], (N, E, H)), *self.experts.weights(jnp.arange(E)), "neh,eoh->neo")
        return jnp.einsum("neo,ne->no", y, combine)

    def _kernel(self, x, norm, ctx: parallel.RunContext, first_expert=None, down_bias_on=None):
        """Few tokens on a GPU: norm, router and top k in two kernels (pallas/moe_route.py), then each
        (token, expert) pair's packed expert weights streamed from HBM or, for experts shared by tokens,
        mostly from L2 (pallas/moe.py); pairs of experts not held (first_expert: `_run`) get id -1, which
        the kernel skips; down_bias_on: `_run`'s. f32 [N, H]."""
        scale, eps = (None, 0.0) if norm is None else (norm.scale[...], norm.eps)
        interpret = ctx.kernels.interpret
        x, xq, ids, w = moe_route.route(x, scale, self.router_w[...], self.router_b[...], eps=eps, k=self.top_k,
                                        interpret=interpret)
        if first_expert is not None:
            ids, held = self._held(ids, first_expert)
            ids = jnp.where(held, ids, -1)
        ex = self.experts
        return moe_kernel.mxfp4_moe(x, ids, w, ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
                                    ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...],
                                    limit=float(self.limit), alpha=float(self.alpha), xq=xq,
                                    down_bias_on=down_bias_on, config=ctx.kernels.moe_config, interpret=interpret)

    def _gathered(self, x, ids, w):
        """Few tokens: read each (token, expert) pair's weights. Returns f32 [N, H]."""
        w1, b1, w2, b2 = self.experts.weights(ids)  # [N, k, ...]
        y = self._ffn(jnp.broadcast_to(x[:, None], ids.shape + x.shape[-1:]), w1, b1, w2, b2, "nkh,nkoh->nko")
        return jnp.einsum("nko,nk->no", y, w)

    def _grouped(self, x, ids, w, policy: select.KernelPolicy = select.AUTO):
        """Many tokens: sort (token, expert) pairs by expert into tiles of tm rows, each tile holding one
        expert's tokens, so that each tile reads its expert once (tm: `group_tile`). Where
        `select.moe_grouped` says so under `policy` (packed MXFP4 experts, bf16 activations, a GPU or
        policy.interpret) through pallas.moe.mxfp4_moe_grouped: every tile at once, decoded in
        registers, on the tensor cores; otherwise ("scan") a scan over the tiles dequantizes each
        tile's expert and skips empty tiles. No per-token copy of expert weights. Pairs with a
        negative id (expert parallel: an expert held elsewhere) get no tile and add nothing. Returns
        f32 [N, H]."""
        N, H = x.shape
        E, P = self.num_held, ids.size
        ex = self.experts
        fits = isinstance(ex, Mxfp4Experts) and x.dtype == jnp.bfloat16
        kernel = select.moe_grouped(x, isinstance(ex, Mxfp4Experts), policy=policy) == "kernel"
        if kernel and not fits:
            raise ValueError(f"MoE grouped kernels: need packed MXFP4 experts and bf16 activations, got "
                             f"{type(ex).__name__} and {x.dtype}")
        tm = group_tile(P, E, kernel)
        num_tiles = -(-P // tm) + E  # >= sum_e ceil(count_e / tm)
        flat_e = jnp.where(ids < 0, E, ids).reshape(-1)  # skipped pairs: bucket E, sorted last, no tiles
        order = jnp.argsort(flat_e, stable=True)
        sorted_e = flat_e[order]
        counts = jnp.bincount(flat_e, length=E + 1)[:E]
        tiles_e = -(-counts // tm)
        tile_end = jnp.cumsum(tiles_e)
        first_tile = tile_end - tiles_e
        first_pair = jnp.cumsum(counts) - counts
        held_e = jnp.minimum(sorted_e, E - 1)
        dest = jnp.where(sorted_e < E, first_tile[held_e] * tm + jnp.arange(P) - first_pair[held_e], num_tiles * tm)
        rows = jnp.full((num_tiles * tm,), N, jnp.int32).at[dest].set((order // self.top_k).astype(jnp.int32),
                                                                       mode="drop")
        row_w = jnp.zeros((num_tiles * tm,), F32).at[dest].set(w.reshape(-1)[order], mode="drop")
        tile = jnp.arange(num_tiles)
        tile_expert = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), E - 1)
        x_pad = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])
        if kernel:
            y = moe_kernel.mxfp4_moe_grouped(
                x_pad[rows].reshape(num_tiles, tm, H), tile_expert.astype(jnp.int32), tile_end[-1],
                row_w.reshape(num_tiles, tm), ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
                ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...], limit=float(self.limit),
                alpha=float(self.alpha), interpret=policy.interpret)
            pos = jnp.zeros((P,), jnp.int32).at[order].set(dest.astype(jnp.int32))  # pair -> its tile row
            y = jnp.concatenate([y.reshape(num_tiles * tm, H), jnp.zeros((1, H), y.dtype)])  # skipped pairs: 0
            return y[pos.reshape(ids.shape)].sum(axis=1)

        def body(out, xs):
            r, rw, e, live = xs

            def run(out):
                y = self._ffn(x_pad[r], *self.experts.weights(e), "th,oh->to")
                return out.at[r].add(y * rw[:, None])

            return jax.lax.cond(live, run, lambda o: o, out), None

        out, _ = jax.lax.scan(body, jnp.zeros((N + 1, H), F32),
                              (rows.reshape(num_tiles, tm), row_w.reshape(num_tiles, tm), tile_expert,
                               tile < tile_end[-1]))
        return out[:N]


class Block(nnx.Module):
    def __init__(self, cfg: GptOssConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, dtype, rngs)

    def __call__(self, x, h, cos, sin, k_cache, v_cache, lengths, positions, mask, *, ctx: parallel.RunContext,
                 **cache_kw):
        """x: the residual stream [B, T, H], h = input_layernorm(x) (run_layers fuses it with the
        previous block's residual add). Returns (x + attention, the MoE's f32 output, not yet added
        to the stream, k_cache, v_cache). The attention residual add stays an XLA fusion: at one
        token it is also the reduce of o_proj's split-K GEMM (what was tried instead: docs/perf/glue.md)."""
        a, k_cache, v_cache = self.self_attn(h, cos, sin, k_cache, v_cache, lengths, positions, mask, ctx=ctx,
                                             **cache_kw)
        x = x + a
        return x, self.mlp(x, norm=self.post_attention_layernorm, dtype=F32, ctx=ctx), k_cache, v_cache

    def reduced(self, x, h, next_norm: RMSNorm, cos, sin, k_cache, v_cache, lengths, positions, mask, *,
                ctx: parallel.RunContext, **cache_kw):
        """The block where `ctx.reduces_fused(x)`: each sublayer's partial outputs summed over "model"
        with the residual add and the norm after it (`parallel.reduce_add_norm`: two calls a block, the MoE
        routing the normalized stream). Returns (x after the block, next_norm of it, k_cache, v_cache)."""
        a, k_cache, v_cache = self.self_attn(h, cos, sin, k_cache, v_cache, lengths, positions, mask, ctx=ctx,
                                             partial=True, **cache_kw)
        x, h = parallel.reduce_add_norm(ctx, a, x, self.post_attention_layernorm)
        x, h = parallel.reduce_add_norm(ctx, self.mlp(h, partial=True, ctx=ctx), x, next_norm)
        return x, h, k_cache, v_cache


class GptOss(nnx.Module):
    """embed [V, H], layers, norm, lm_head [V, H] (rows = vocab, like the HF weight)."""

    def __init__(self, config: GptOssConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        V, H = config.vocab_size, config.hidden_size
        self.config, self.dtype = config, dtype
        self.embed = nnx.Param(normal(rngs, (V, H), 1.0, dtype))
        self.layers = nnx.List([Block(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nnx.Param(normal(rngs, (V, H), H ** -0.5, dtype))


# -- input checks (public entry points; shapes always, values only of concrete, untraced inputs) --------

def check_tokens(tokens, vocab_size: int, name: str = "tokens"):
    """Token ids [B, T] (B, T >= 1, integer dtype; concrete ids inside [0, vocab_size)) -> int32 array.
    Raises ValueError naming `name`: out-of-range ids would otherwise be clamped by the embedding
    gather and float ids truncated, both silently."""
    if not hasattr(tokens, "dtype"):
        tokens = np.asarray(tokens)
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ValueError(f"{name}: expected token ids of shape [B, T] with B, T >= 1, got shape {shape_of(tokens)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name}: expected integer token ids, got dtype {tokens.dtype}")
    if not isinstance(tokens, jax.core.Tracer):
        t = np.asarray(tokens)
        bad = np.flatnonzero((t < 0) | (t >= vocab_size))
        if bad.size:
            raise ValueError(f"{name}: token id {t.reshape(-1)[bad[0]]} outside the vocabulary [0, {vocab_size})")
    return jnp.asarray(tokens, jnp.int32)


def check_step_inputs(tokens, positions, lengths, mask, cache_batch: int | None, cache_len: int | None,
                      what: str = "step"):
    """Shape checks shared by the cached entry points (gpt_oss.step, eagle3.layer): tokens, positions
    [B, T], lengths [B], mask [B, T, ceil(T/32)] or None, a cache of batch B holding >= T slots."""
    B, T = tokens.shape
    if shape_of(positions) != [B, T]:
        raise ValueError(f"{what}: positions shape {shape_of(positions)}, expected [B, T] = {[B, T]} like tokens")
    if shape_of(lengths) != [B]:
        raise ValueError(f"{what}: lengths shape {shape_of(lengths)}, expected [B] = {[B]}")
    if mask is not None and shape_of(mask) != [B, T, -(-T // 32)]:
        raise ValueError(f"{what}: mask shape {shape_of(mask)}, expected packed [B, T, ceil(T/32)] = "
                         f"{[B, T, -(-T // 32)]}")
    if cache_batch is not None and cache_batch != B:
        raise ValueError(f"{what}: cache batch {cache_batch}, tokens batch {B}")
    if cache_len is not None and T > cache_len:
        raise ValueError(f"{what}: {T} tokens do not fit a cache of {cache_len} slots")
    # np.asarray, not np.max: inside a trace, jnp ops on a concrete (closed-over) array return tracers
    if (cache_len is not None and not isinstance(lengths, jax.core.Tracer)
            and int(np.asarray(lengths).max()) + T > cache_len):
        raise ValueError(f"{what}: lengths {np.asarray(lengths).tolist()} + {T} tokens run past the cache's "
                         f"{cache_len} slots")


def check_step_tokens(T: int, cache: kvc.KVCache, what: str = "step"):
    """A cached step writes its T tokens before reading: at most cache.max_step_tokens of them."""
    if T > cache.max_step_tokens:
        raise ValueError(f"{what}: {T} tokens a step, but the cache's sliding-layer rings take at most "
                         f"max_step_tokens={cache.max_step_tokens}: build it with init_cache(..., max_step_tokens={T})")


# -- functional entry points ---------------------------------------------------------------------

def feature_hidden_index(config: GptOssConfig, aux_layer_ids, convention: str = "output") -> tuple[int, ...]:
    """Indices into the hidden-state list h[0] = embeddings, h[i + 1] = output of block i.

    convention "output" (SGLang / TRT-LLM / EAGLE-3 default): id k is the output of block k.
    convention "input" (vLLM): id k is the input of layer k (k = L: the last block's output).
    """
    L = config.num_hidden_layers
    if convention not in ("output", "input"):
        raise ValueError(f"aux_convention: {convention!r}, expected 'output' or 'input'")
    hi = L - 1 if convention == "output" else L
    out = []
    for k in aux_layer_ids:
        if not 0 <= int_arg("aux_layer_ids", k, 0) <= hi:
            raise ValueError(f"aux_layer_ids: {k} outside [0, {hi}] for {L} layers ({convention} convention)")
        out.append(int(k) + (1 if convention == "output" else 0))
    return tuple(out)


def logits(model: GptOss, h, ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """Final-normed hidden [B, ..., H] -> float32 logits [B, ..., V] (under ctx's mesh split over
    "model": parallel.vocab_logits)."""
    return parallel.vocab_logits(ctx, h, model.lm_head[...])


def run_layers(model: GptOss, tokens, positions, lengths, mask, cache: kvc.KVCache | None,
               feature_ids: tuple[int, ...] = (), n_write=None, ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """The trunk shared by every entry point.

    tokens, positions: int32 [B, T]; lengths int32 [B]: committed cache prefix per sequence; the
    new tokens' K/V are written at positions lengths .. lengths + T - 1. mask: packed [B, T, ceil(T/32)]
    or None (causal). cache None means no prefix (nothing is read or written). n_write int32 [B] or
    None: a prefill chunk's tokens each sequence keeps (ring layers write only those). ctx: the run
    context (mesh, kernels).
    Returns (final-normed hidden [B, T, H], features [B, T, len(ids) * H] or None, new cache).
    """
    cfg = model.config
    B, T = tokens.shape
    inv_freq, scale = rope.inv_freq_and_scale(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    cos, sin = rope.cos_sin(positions, inv_freq, scale)
    hidden = []  # hidden[j]: the input of layer j (j = L: the final norm's input)
    new_k, new_v = [], []
    moe_out = None  # each block's MoE output is added to the stream by the next norm's kernel
    fused = ctx.reduces_fused(tokens)  # or each sum over "model" fused with the add and the next norm
    norms = [block.input_layernorm for block in model.layers] + [model.norm]
    table = model.embed[...]
    if fused:  # the lookup's sum over "model" (exact: one device's row and zeros) with the first norm
        zeros = jnp.zeros((B, T, cfg.hidden_size), table.dtype)
        x, h = parallel.reduce_add_norm(ctx, parallel.vocab_rows(ctx, table, tokens, partial=True), zeros, norms[0])
    else:
        x = parallel.vocab_rows(ctx, table, tokens)
    for i, block in enumerate(model.layers):
        with jax.named_scope(f"layer{i}"):
            if cache is None:
                empty = jnp.zeros((B, cfg.num_key_value_heads, 0, cfg.head_dim), x.dtype)
                kc = vc = empty
            else:
                kc, vc = cache.k[i], cache.v[i]
            if not fused:
                x, h = block.input_layernorm.add(x, moe_out, ctx)
            hidden.append(x)
            kw = dict(ring=cache is not None and cache.rings[i], n_write=n_write, ctx=ctx)
            if fused:
                x, h, kc, vc = block.reduced(x, h, norms[i + 1], cos, sin, kc, vc, lengths, positions, mask, **kw)
            else:
                x, moe_out, kc, vc = block(x, h, cos, sin, kc, vc, lengths, positions, mask, **kw)
            new_k.append(kc)
            new_v.append(vc)
    if not fused:
        x, h = model.norm.add(x, moe_out, ctx)
    hidden.append(x)
    feats = jnp.concatenate([hidden[j] for j in feature_ids], axis=-1) if feature_ids else None
    cache = None if cache is None else cache.replace(k=tuple(new_k), v=tuple(new_v))
    return h, feats, cache


def forward(model: GptOss, tokens, aux_layer_ids=None, *, aux_convention: str = "output",
            ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """Full sequence from position 0 without a cache.

    tokens int32 [B, T] -> (logits f32 [B, T, V], features [B, T, 3H]): the hidden states at
    `aux_layer_ids` (default `config.default_aux_layer_ids()`), concatenated, read with
    `aux_convention` ("output": outputs of those blocks; "input": inputs of those layers). ctx: the
    run context (default one device; training and parity checks run so).
    """
    cfg = model.config
    tokens = check_tokens(tokens, cfg.vocab_size)
    B, T = tokens.shape
    ids = cfg.default_aux_layer_ids() if aux_layer_ids is None else tuple(aux_layer_ids)
    fidx = feature_hidden_index(cfg, ids, aux_convention)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, feats, _ = run_layers(model, tokens, positions, jnp.zeros((B,), jnp.int32), None, None, fidx, ctx=ctx)
    return logits(model, h, ctx), feats


def init_cache(model: GptOss, batch: int, max_len: int, *, max_step_tokens: int = kvc.DEFAULT_STEP_TOKENS
               ) -> kvc.KVCache:
    """Zeroed K/V for positions below max_len: full layers [batch, Hkv, max_len, D], sliding layers a
    ring of min(max_len, window + max_step_tokens) slots (models/kv_cache.py). max_step_tokens: the
    most tokens one `step` writes (decode 1, a verify its nodes)."""
    batch, max_len = int_arg("init_cache: batch", batch, 1), int_arg("init_cache: max_len", max_len, 1)
    max_step_tokens = int_arg("init_cache: max_step_tokens", max_step_tokens, 1)
    cfg = model.config
    windows = [cfg.window(i) for i in range(cfg.num_hidden_layers)]
    return kvc.init(windows, batch, max_len, cfg.num_key_value_heads, cfg.head_dim, model.dtype,
                    max_step_tokens=max_step_tokens)


def step(model: GptOss, cache: kvc.KVCache, tokens, positions, lengths, mask=None, feature_ids=(), *,
         ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """Cached multi-token step (decode: T = 1; verify: T tree nodes with a packed ancestor mask).

    tokens/positions int32 [B, T]; lengths int32 [B] committed prefix; K/V of the T tokens go to
    positions lengths .. lengths + T - 1 (lengths are not advanced here); T <= cache.max_step_tokens.
    ctx: the run context (mesh, kernels; default one device). Returns (logits f32 [B, T, V],
    features or None, cache).
    """
    tokens = check_tokens(tokens, model.config.vocab_size)
    check_step_inputs(tokens, positions, lengths, mask, cache.batch, cache.max_len)
    check_step_tokens(tokens.shape[1], cache)
    positions, lengths = jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32)
    h, feats, cache = run_layers(model, tokens, positions, lengths, mask, cache, feature_ids, ctx=ctx)
    return logits(model, h, ctx), feats, cache


def prefill(model: GptOss, cache: kvc.KVCache, tokens, prompt_lengths, *, chunk: int, feature_ids=(),
            ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """Chunked prefill of right-padded prompts tokens int32 [B, P] (P a multiple of `chunk`).

    Runs ceil(max(prompt_lengths) / chunk) causal chunks (a `fori_loop`, so prompt lengths do not
    recompile); padding writes only scratch slots. Returns (cache, final-normed hidden of each
    prompt's last token [B, H], features [B, P, len(feature_ids) * H] of every position, or None).
    ctx: the run context (mesh, kernels; default one device).
    """
    tokens = check_tokens(tokens, model.config.vocab_size)
    B, P = tokens.shape
    chunk = int_arg("prefill: chunk", chunk, 1)
    if P % chunk:
        raise ValueError(f"prefill: padded prompt length {P} is not a multiple of chunk={chunk}")
    if P > cache.max_len:  # whole chunks are written: a clamped cache write would overwrite the prompt
        raise ValueError(f"prefill: padded prompt length {P} is longer than the cache ({cache.max_len} slots)")
    if cache.batch != B:
        raise ValueError(f"prefill: cache batch {cache.batch}, tokens batch {B}")
    if shape_of(prompt_lengths) != [B]:
        raise ValueError(f"prefill: prompt_lengths shape {shape_of(prompt_lengths)}, expected [B] = {[B]}")
    if not isinstance(prompt_lengths, jax.core.Tracer):
        n = np.asarray(prompt_lengths)
        if n.min() < 1 or n.max() > P:
            raise ValueError(f"prefill: prompt_lengths {n.tolist()} outside [1, {P}] (the padded prompt length)")
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    last = prompt_lengths - 1

    def body(start, carry):
        cache, h_last, feats = carry
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        pos = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        n_write = jnp.clip(prompt_lengths - start, 0, chunk)
        h, f, cache = run_layers(model, toks, pos, jnp.full((B,), start, jnp.int32), None, cache, feature_ids, n_write,
                                 ctx)
        if feature_ids:
            feats = jax.lax.dynamic_update_slice_in_dim(feats, f, start, axis=1)
        return cache, keep_position(h, h_last, last, start), feats

    H = model.config.hidden_size
    feats = jnp.zeros((B, P, len(feature_ids) * H), model.dtype) if feature_ids else None
    return over_chunks(body, prompt_lengths, chunk, (cache, jnp.zeros((B, H), model.dtype), feats))


def random_gpt_oss(config: GptOssConfig, seed: int = 0, dtype=jnp.bfloat16, shardings=None) -> GptOss:
    """Random weights of any size (experts packed when config.experts_format == 'mxfp4'), created
    directly on the device (the host never holds them). Blocks are built one at a time by a
    jitted constructor compiled once per layer type, so gpt-oss-120b builds in seconds; the
    constructors are kept (`_constructor`), so building the same config again compiles nothing.

    shardings: None (the default device), or a function of a variable's "/"-joined path (e.g.
    "layers/0/self_attn/wqkv") returning its jax.sharding.Sharding: each block is then created
    already split (jit's out_shardings), so no device holds more than its shards
    (`convert.random_gpt_oss(..., mesh=)` passes parallel.py's table). The values do not depend
    on `shardings`."""
    key = jax.random.key(seed)
    model = nnx.eval_shape(lambda: GptOss(config, dtype=dtype, rngs=nnx.Rngs(0)))

    def build(state, layer, prefix, k):
        """`state` (abstract) filled from key k: the top (layer None) or a block of `layer`'s kind, each
        variable created where `shardings` puts it."""
        out = None
        if shardings is not None:
            where = lambda p, _: shardings(prefix + "/".join(str(getattr(x, "key", x)) for x in p))
            leaves, treedef = jax.tree.flatten(jax.tree_util.tree_map_with_path(where, nnx.to_pure_dict(state)))
            out = (tuple(leaves), treedef)
        # the key goes as host data: an input every process holds whole
        nnx.replace_by_pure_dict(state, _constructor(config, dtype, layer, out)(np.asarray(jax.random.key_data(k))))
        return state

    state = nnx.state(model)
    nnx.update(model, build(nnx.State({name: state[name] for name in _TOP}), None, "", key))
    for i, kind in enumerate(config.layer_types):
        layer, k = config.layer_types.index(kind), jax.random.fold_in(key, i + 1)
        graphdef, block = nnx.split(model.layers[i])
        model.layers[i] = nnx.merge(graphdef, build(block, layer, f"layers/{i}/", k))
    return model


_TOP = ("embed", "lm_head", "norm")  # the variables outside the blocks


@functools.lru_cache(maxsize=32)
def _constructor(config: GptOssConfig, dtype, layer: int | None, out):
    """jit of key data -> a pure dict: the state of Block(config, layer) or, for layer None, the _TOP
    variables of a one-layer GptOss (its block is drawn, as lm_head comes after it, then dropped by
    XLA). out: None (the default device) or the flattened out_shardings (leaves, treedef). Cached by
    its arguments: one compile a config, dtype, layer kind and placement in a process."""
    def make(kd):
        rngs = nnx.Rngs(jax.random.wrap_key_data(kd))
        if layer is not None:
            return nnx.to_pure_dict(nnx.state(Block(config, layer, dtype, rngs)))
        one = GptOss(config.replace(num_hidden_layers=1, layer_types=config.layer_types[:1]), dtype=dtype, rngs=rngs)
        state = nnx.to_pure_dict(nnx.state(one))
        return {name: state[name] for name in _TOP}

    return jax.jit(make, out_shardings=None if out is None else jax.tree.unflatten(out[1], out[0]))


def param_bytes(model: GptOss) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model))))
