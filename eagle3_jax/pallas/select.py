"""Which implementation runs, for a platform and shapes: the one place that decides.

The model code (`models/gpt_oss.py`) and the ops' dispatchers ask these functions; each returns a
name. `platform` defaults to the default backend (`util.on_gpu`). Kernels have no gradients:
`forward` and training run float32 models, which take the references.

| question | answer | when |
|---|---|---|
| `glue_kernels(x)` | True | bf16 activations on a GPU: the target's norm, routing, q/k/v glue |
| `attention(q, k_cache, window)` | "mosaic" | GPU, `mosaic_fits` (full layer, bf16), S >= MOSAIC_MIN_CACHE, Nq >= 2 |
| (draft; target without glue) | "triton" | GPU, a non-empty cache, head_dim <= MAX_HEAD_DIM |
| | "reference" | otherwise (no GPU; no cache: `forward`, training) |
| `target_attention(x, k_cache)` | "rope_kernel" | glue kernels, a non-empty bf16 cache, head_dim <= MAX_HEAD_DIM |
| | "plain" | otherwise: `qkv_rope`, the cache write, then `attention` |
| `norm(x)` | "kernel" | glue kernels (`norm.add_rms_norm`); else "reference" |
| `moe(x, ...)` | "kernel" | MXFP4 experts, glue kernels, tokens <= MOE_KERNEL_MAX_TOKENS |
| | "gathered" | tokens * top_k <= GATHER_MAX_PAIRS, but not for packed experts that "dense" takes |
| | "dense" | experts <= DENSE_MAX_EXPERTS_PER_TOPK * top_k (small models) |
| | "grouped" | otherwise |
| `moe_grouped(x, packed, interpret)` | "kernel" | MXFP4 experts, bf16, glue kernels or interpret; else "scan" |
| `router_top_k(rows)` | "rank" | rows <= RANK_TOP_K_ROWS; else "sort" |
| `tp_reduce(x, rows, devices, mailbox)` | "kernel" | a Mailbox, glue kernels, H % 64, rows x peers <= 64 |
| | "reference" | otherwise: `lax.psum`, then the add and the norm in jnp |
| `tp_pick(rows, devices, mailbox)` | "kernel" | a Mailbox, rows x peers <= 64, any dtype |
| | "reference" | otherwise: `lax.psum` of each device's (maximum, index) |
| `rows_matmul(x, w)` | "kernel" | one bf16 row on a GPU, w.size <= ROWS_MATMUL_MAX_ELEMENTS; else "xla" |
| `compiler_options()` | LOOP_GRAPHS | GPU, XLA_FLAGS without command buffers; else {} |
| `spec_op(interpret)` | "kernel" | GPU or interpret=True; else "reference" (tree_mask, accept, kv_rewind) |

Why these thresholds: docs/perf/ (attention.md, moe.md, glue.md).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from eagle3_jax.pallas import allreduce, attention_mosaic, moe, util

MAX_HEAD_DIM = 256  # head_dim the attention kernels take
MOSAIC_MIN_CACHE = 4096  # cache slots from which full layers take the Mosaic GPU kernel (with Nq >= 2)
MOE_KERNEL_MAX_TOKENS = moe.MAX_TOKENS  # every decode and verify size: 64
GATHER_MAX_PAIRS = 64  # (token, expert) pairs up to which the jnp MoE gathers each pair's weights
TP_KERNEL_ROW_PEERS = 64  # rows x peers up to which the one-shot sum beat XLA's (reduce_norm_h100x4.json)
DENSE_MAX_EXPERTS_PER_TOPK = 4  # E <= 4 k: every expert on every token costs at most 4x the selected FLOPs
ROWS_MATMUL_MAX_ELEMENTS = 8_000_000  # a device's q|k|v and o at 2 and 4 devices (2.9-7.4M) measured faster
# at one row (kernels_gemv_nk_h200.json); one device's whole q|k|v and o (11.8M and up) keep XLA's GEMV
RANK_TOP_K_ROWS = 64  # router rows up to which the jnp top k counts ranks (one fusion) instead of sorting
MOE_PATHS = ("kernel", "gathered", "grouped", "dense")


LOOP_GRAPHS = {  # XLA options: every loop a CUDA graph, its condition read on the GPU (docs/perf/multi_gpu.md)
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES,CONDITIONAL,WHILE",
    "xla_gpu_graph_min_graph_size": 1,
}


def compiler_options(platform: str | None = None) -> dict:
    """XLA options decode's and generate's programs compile with: LOOP_GRAPHS on GPUs (one process or
    several), none elsewhere, and none where XLA_FLAGS already sets command buffers (the user's
    choice stands). 4 H100s, gpt-oss-120b, B=1: tp 1 2.84 -> 2.71 ms a token, tp 4 2.50 -> 2.00
    (tp_decode_b1_pick_h100x4.json against tp_decode_b1_pick_graphs_h100x4.json, one machine). On 4
    H200s, four processes a GPU under them gave one process's generate tokens in bf16; decode's
    bf16 near-tie there parted or not by machine, in one process as in four
    (decode_bf16_parting_h200x4.json)."""
    if not _gpu(platform) or "xla_gpu_enable_command_buffer" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return dict(LOOP_GRAPHS)


def _gpu(platform: str | None) -> bool:
    return util.on_gpu() if platform is None else platform == "gpu"


def glue_kernels(x, platform: str | None = None) -> bool:
    """Whether the target's glue runs as Pallas kernels: bf16 activations x on a GPU."""
    return x.dtype == jnp.bfloat16 and _gpu(platform)


def attention(q, k_cache, window, platform: str | None = None, *, ring: bool = False) -> str:
    """q [B, Nq, Hq, D], k_cache [B, Hkv, S, D] (ring: a sliding layer's ring) -> "mosaic", "triton" or
    "reference"."""
    if not (_gpu(platform) and q.shape[-1] <= MAX_HEAD_DIM and k_cache.shape[2] > 0):
        return "reference"
    if (not ring and attention_mosaic.mosaic_fits(q, k_cache, window) and k_cache.shape[2] >= MOSAIC_MIN_CACHE
            and q.shape[1] >= 2):
        return "mosaic"
    return "triton"


def target_attention(x, k_cache, platform: str | None = None) -> str:
    """x [B, T, H] (the layer's input), k_cache [B, Hkv, S, D] -> "rope_kernel" or "plain"."""
    if (k_cache.shape[2] and glue_kernels(x, platform) and k_cache.dtype == jnp.bfloat16
            and k_cache.shape[-1] <= MAX_HEAD_DIM):
        return "rope_kernel"
    return "plain"


def rows_matmul(x, w, platform: str | None = None) -> str:
    """x [R, K] @ w.T, w [N, K] (a device's q|k|v or o_proj under tensor parallelism): "kernel"
    (`gemv.rows_matmul`) or "xla" (`layers.rows_dot`)."""
    if x.shape[0] == 1 and glue_kernels(x, platform) and w.size <= ROWS_MATMUL_MAX_ELEMENTS:
        return "kernel"
    return "xla"


def norm(x, platform: str | None = None) -> str:
    """The residual add + RMSNorm: "kernel" or "reference"."""
    return "kernel" if glue_kernels(x, platform) else "reference"


def moe(x, *, num_experts: int, top_k: int, packed: bool, platform: str | None = None) -> str:
    """x [N, H] through a MoE of num_experts experts (packed: MXFP4) -> one of MOE_PATHS."""
    tokens = x.shape[0]
    if packed and glue_kernels(x, platform) and tokens <= MOE_KERNEL_MAX_TOKENS:
        return "kernel"
    dense = num_experts <= DENSE_MAX_EXPERTS_PER_TOPK * top_k
    # packed experts: "gathered" gathers and decodes a copy of its expert a pair, "dense" decodes each once
    if tokens * top_k <= GATHER_MAX_PAIRS and not (packed and dense):
        return "gathered"
    return "dense" if dense else "grouped"


def moe_grouped(x, packed: bool, interpret: bool = False, platform: str | None = None) -> str:
    """The grouped MoE path's tiles: "kernel" (`moe.mxfp4_moe_grouped`) or "scan" (XLA, a tile at a time)."""
    if packed and x.dtype == jnp.bfloat16 and (interpret or glue_kernels(x, platform)):
        return "kernel"
    return "scan"


def router_top_k(rows: int) -> str:
    """The jnp router's top k: "rank" (`gpt_oss.top_k_by_rank`) or "sort" (`lax.top_k`)."""
    return "rank" if rows <= RANK_TOP_K_ROWS else "sort"


def spec_op(interpret: bool | None = None, platform: str | None = None) -> str:
    """tree_mask, accept and kv_rewind: "kernel" on a GPU or with interpret=True (the Pallas
    interpreter), "reference" otherwise (interpret=False forces it)."""
    return "kernel" if interpret or (interpret is None and _gpu(platform)) else "reference"


def tp_kernel(hidden: int, platform: str | None = None) -> bool:
    """Whether the one-shot kernel of pallas/allreduce.py can sum rows of `hidden` here: a GPU and
    hidden % 64 == 0 (`parallel.mailbox` makes a Mailbox only then, and only for model groups whose
    GPUs share memory: one process, or one process a GPU on one host)."""
    return _gpu(platform) and hidden % allreduce.LANES == 0


def tp_reduce(x, rows: int, devices: int, mailbox, platform: str | None = None) -> str:
    """How a decode-sized step sums a sublayer's partial outputs over `devices` ("model") with the
    residual add and the norm after it (x: the residual stream [..., H]; rows: this device's rows):
    "kernel" (the one-shot kernel of pallas/allreduce.py: `tp_kernel`, bf16, the program's Mailbox)
    or "reference". The kernel sends every row to every peer, each element with a flag: on 4 H100s
    it beat XLA's all-reduce + add + norm up to 64 rows on 2 devices and 16 rows on 4, and lost at
    64 rows on 4 (`TP_KERNEL_ROW_PEERS`; experiments/results/reduce_norm_h100x4.json); so on 4 H200s
    with loops as CUDA graphs (16.6 against 18.4 us at 16 rows, 42.1 against 25.5 at 64:
    reduce_norm_parts_h200x4.json)."""
    ok = glue_kernels(x, platform) and tp_kernel(x.shape[-1], platform) and _tp_fits(rows, devices, mailbox)
    return "kernel" if ok else "reference"


def tp_pick(rows: int, devices: int, mailbox, platform: str | None = None) -> str:
    """How a step's greedy pick or draw over a vocabulary split over `devices` ("model") exchanges
    each device's (maximum, index) for `rows` rows a device: "kernel" (the one-shot kernel's sum,
    exact for any activation dtype: `tp_kernel`, the program's Mailbox) or "reference" (lax.psum)."""
    ok = mailbox is not None and tp_kernel(allreduce.row_width(mailbox), platform) and _tp_fits(rows, devices, mailbox)
    return "kernel" if ok else "reference"


def _tp_fits(rows: int, devices: int, mailbox) -> bool:
    """Whether the one-shot kernel takes `rows` rows a device over `devices` with this Mailbox."""
    return mailbox is not None and rows <= allreduce.MAX_ROWS and rows * (devices - 1) <= TP_KERNEL_ROW_PEERS
