"""Which implementation runs, for a platform and shapes: the one place that decides.

The models and the ops' dispatchers ask these functions; each returns a name. `platform` defaults
to the default backend. Kernels have no gradients: `forward` and training run float32 models, which
take the references. A `KernelPolicy` (the run context's `kernels`) forces any answer by its field
of the same name (`KernelPolicy(attention="reference")`); its `interpret` runs Pallas kernels in
the interpreter (CPU tests), `moe_config` sets the MXFP4 expert kernel's tiling.

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
| `moe_grouped(x, packed)` | "kernel" | MXFP4 experts, bf16, glue kernels or policy.interpret; else "scan" |
| `router_top_k(rows)` | "rank" | rows <= RANK_TOP_K_ROWS; else "sort" |
| `tp_reduce(x, rows, devices, mailbox)` | "kernel" | a Mailbox, glue kernels, H % 64, rows x peers <= 64; else psum |
| `tp_pick(rows, devices, mailbox)` | "kernel" | a Mailbox, rows x peers <= 64, any dtype; else psum |
| `rows_matmul(x, w)` | "kernel" | one bf16 row on a GPU, w.size <= ROWS_MATMUL_MAX_ELEMENTS; else "xla" |
| `compiler_options()` | LOOP_GRAPHS | GPU, XLA_FLAGS without command buffers; else {} |
| `spec_ops()` | "kernel" | GPU or policy.interpret; else "reference" (tree_mask, accept, kv_rewind) |
Why these thresholds: docs/perf/.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from eagle3_jax.pallas import allreduce, attention_mosaic, gemv, util
from eagle3_jax.pallas import moe as moe_kernel

MAX_HEAD_DIM = 256  # head_dim the attention kernels take
MOSAIC_MIN_CACHE = 4096  # cache slots from which full layers take the Mosaic GPU kernel (with Nq >= 2)
MOE_KERNEL_MAX_TOKENS = moe_kernel.MAX_TOKENS  # every decode and verify size: 64
GATHER_MAX_PAIRS = 64  # (token, expert) pairs up to which the jnp MoE gathers each pair's weights
TP_KERNEL_ROW_PEERS = 64  # rows x peers up to which the one-shot sum beat XLA's (reduce_norm_h100x4.json)
DENSE_MAX_EXPERTS_PER_TOPK = 4  # E <= 4 k: every expert on every token costs at most 4x the selected FLOPs
ROWS_MATMUL_MAX_ELEMENTS = 8_000_000  # a device's q|k|v and o at 2 and 4 devices (2.9-7.4M) measured faster
# at one row (kernels_gemv_nk_h200.json); one device's whole q|k|v and o (11.8M and up) keep XLA's GEMV
RANK_TOP_K_ROWS = 64  # router rows up to which the jnp top k counts ranks (one fusion) instead of sorting
MOE_PATHS = ("kernel", "gathered", "grouped", "dense")


CHOICES = {  # KernelPolicy field -> the names its question answers
    "attention": ("mosaic", "triton", "reference"),
    "target_attention": ("rope_kernel", "plain"),
    "norm": ("kernel", "reference"),
    "moe": MOE_PATHS,
    "moe_grouped": ("kernel", "scan"),
    "router_top_k": ("rank", "sort"),
    "rows_matmul": ("kernel", "xla"),
    "tp_reduce": ("kernel", "reference"),
    "tp_pick": ("kernel", "reference"),
    "spec_ops": ("kernel", "reference"),
}


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Which implementation each op runs: None (the default) lets this module choose by platform and
    shape; a name (one of `CHOICES[field]`) forces it, e.g. `KernelPolicy(attention="reference")` to
    A/B a kernel against its reference. interpret: Pallas kernels run in the interpreter (on a CPU;
    with a forced "kernel" this runs the GPU's path there). moe_config: the MXFP4 expert kernel's
    `pallas.moe.MoeConfig` (None: `moe.config_for` the experts' size). Immutable and hashable: a
    compiled program is keyed on it."""
    attention: str | None = None
    target_attention: str | None = None
    norm: str | None = None
    moe: str | None = None
    moe_grouped: str | None = None
    router_top_k: str | None = None
    rows_matmul: str | None = None
    tp_reduce: str | None = None
    tp_pick: str | None = None
    spec_ops: str | None = None
    interpret: bool = False
    moe_config: moe_kernel.MoeConfig | None = None

    def __post_init__(self):
        for name, names in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in names:
                raise ValueError(f"KernelPolicy: {name}={value!r}, expected None (automatic) or one of {names}")
        if not isinstance(self.interpret, bool):
            raise ValueError(f"KernelPolicy: interpret={self.interpret!r}, expected a bool")
        if self.moe_config is not None and not isinstance(self.moe_config, moe_kernel.MoeConfig):
            raise ValueError(f"KernelPolicy: moe_config of type {type(self.moe_config).__name__}, "
                             "expected a pallas.moe.MoeConfig or None")


AUTO = KernelPolicy()  # every choice made here, by platform and shape


LOOP_GRAPHS = {  # XLA options: every loop a CUDA graph, its condition read on the GPU (docs/perf/multi_gpu.md)
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES,CONDITIONAL,WHILE",
    "xla_gpu_graph_min_graph_size": 1,
}


def compiler_options(platform: str | None = None) -> dict:
    """XLA options decode's and generate's programs compile with: LOOP_GRAPHS on GPUs (one process or
    several), none elsewhere, and none where XLA_FLAGS already sets command buffers (the user's
    choice stands). Why: docs/perf/multi_gpu.md."""
    if not _gpu(platform) or "xla_gpu_enable_command_buffer" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return dict(LOOP_GRAPHS)


def _gpu(platform: str | None) -> bool:
    return util.on_gpu() if platform is None else platform == "gpu"


def glue_kernels(x, platform: str | None = None) -> bool:
    """Whether the target's glue runs as Pallas kernels: bf16 activations x on a GPU."""
    return x.dtype == jnp.bfloat16 and _gpu(platform)


def attention(q, k_cache, window, platform: str | None = None, *, ring: bool = False,
              policy: KernelPolicy = AUTO) -> str:
    """q [B, Nq, Hq, D], k_cache [B, Hkv, S, D] (ring: a sliding layer's ring) -> "mosaic", "triton" or
    "reference"."""
    if policy.attention:
        return policy.attention
    if not (_gpu(platform) and q.shape[-1] <= MAX_HEAD_DIM and k_cache.shape[2] > 0):
        return "reference"
    if (not ring and attention_mosaic.mosaic_fits(q, k_cache, window) and k_cache.shape[2] >= MOSAIC_MIN_CACHE
            and q.shape[1] >= 2):
        return "mosaic"
    return "triton"


def target_attention(x, k_cache, platform: str | None = None, *, policy: KernelPolicy = AUTO) -> str:
    """x [B, T, H] (the layer's input), k_cache [B, Hkv, S, D] -> "rope_kernel" or "plain" (forced
    "rope_kernel" still takes "plain" without a cache: there is nothing to write)."""
    if policy.target_attention:
        return policy.target_attention if k_cache.shape[2] else "plain"
    if (k_cache.shape[2] and glue_kernels(x, platform) and k_cache.dtype == jnp.bfloat16
            and k_cache.shape[-1] <= MAX_HEAD_DIM):
        return "rope_kernel"
    return "plain"


def rows_matmul(x, w, platform: str | None = None, *, policy: KernelPolicy = AUTO) -> str:
    """x [R, K] @ w.T, w [N, K] (a device's q|k|v or o_proj under tensor parallelism): "kernel"
    (`gemv.rows_matmul`) or "xla" (`layers.rows_dot`). Forced "kernel" still takes "xla" past the
    kernel's `gemv.MAX_ROWS` rows."""
    if policy.rows_matmul:
        return policy.rows_matmul if x.shape[0] <= gemv.MAX_ROWS else "xla"
    if x.shape[0] == 1 and glue_kernels(x, platform) and w.size <= ROWS_MATMUL_MAX_ELEMENTS:
        return "kernel"
    return "xla"


def norm(x, platform: str | None = None, *, policy: KernelPolicy = AUTO) -> str:
    """The residual add + RMSNorm: "kernel" or "reference"."""
    if policy.norm:
        return policy.norm
    return "kernel" if glue_kernels(x, platform) else "reference"


def moe(x, *, num_experts: int, top_k: int, packed: bool, platform: str | None = None,
        policy: KernelPolicy = AUTO) -> str:
    """x [N, H] through a MoE of num_experts experts (packed: MXFP4) -> one of MOE_PATHS."""
    if policy.moe:
        return policy.moe
    tokens = x.shape[0]
    if packed and glue_kernels(x, platform) and tokens <= MOE_KERNEL_MAX_TOKENS:
        return "kernel"
    dense = num_experts <= DENSE_MAX_EXPERTS_PER_TOPK * top_k
    # packed experts: "gathered" gathers and decodes a copy of its expert a pair, "dense" decodes each once
    if tokens * top_k <= GATHER_MAX_PAIRS and not (packed and dense):
        return "gathered"
    return "dense" if dense else "grouped"


def moe_grouped(x, packed: bool, platform: str | None = None, *, policy: KernelPolicy = AUTO) -> str:
    """The grouped MoE path's tiles: "kernel" (`pallas.moe.mxfp4_moe_grouped`, packed experts and bf16 only)
    or "scan" (XLA, a tile at a time)."""
    if policy.moe_grouped:
        return policy.moe_grouped
    if packed and x.dtype == jnp.bfloat16 and (policy.interpret or glue_kernels(x, platform)):
        return "kernel"
    return "scan"


def router_top_k(rows: int, *, policy: KernelPolicy = AUTO) -> str:
    """The jnp router's top k: "rank" (`gpt_oss.top_k_by_rank`) or "sort" (`lax.top_k`)."""
    if policy.router_top_k:
        return policy.router_top_k
    return "rank" if rows <= RANK_TOP_K_ROWS else "sort"


def spec_ops(platform: str | None = None, *, policy: KernelPolicy = AUTO) -> str:
    """tree_mask, accept and kv_rewind: "kernel" on a GPU or with policy.interpret (the Pallas
    interpreter), "reference" otherwise."""
    if policy.spec_ops:
        return policy.spec_ops
    return "kernel" if policy.interpret or _gpu(platform) else "reference"


def tp_kernel(hidden: int, platform: str | None = None) -> bool:
    """Whether the one-shot kernel of pallas/allreduce.py can sum rows of `hidden` here: a GPU and
    hidden % 64 == 0 (`parallel.context` makes a Mailbox only then, and only for model groups whose
    GPUs share memory: one process, or one process a GPU on one host)."""
    return _gpu(platform) and hidden % allreduce.LANES == 0


def tp_reduce(x, rows: int, devices: int, mailbox, platform: str | None = None, *,
              policy: KernelPolicy = AUTO) -> str:
    """How a decode-sized step sums a sublayer's partial outputs over `devices` ("model") with the
    residual add and the norm after it (x: the residual stream [..., H]; rows: this device's rows):
    "kernel" (the one-shot kernel of pallas/allreduce.py: `tp_kernel`, bf16, the run's Mailbox) or
    "reference" (lax.psum). The kernel sends every row to every peer: it wins up to
    `TP_KERNEL_ROW_PEERS` rows x peers. Forced "kernel" still needs a Mailbox and `allreduce.MAX_ROWS`."""
    if policy.tp_reduce:
        return "kernel" if policy.tp_reduce == "kernel" and _tp_takes(rows, mailbox) else "reference"
    ok = glue_kernels(x, platform) and tp_kernel(x.shape[-1], platform) and _tp_fits(rows, devices, mailbox)
    return "kernel" if ok else "reference"


def tp_pick(rows: int, devices: int, mailbox, platform: str | None = None, *, policy: KernelPolicy = AUTO) -> str:
    """How a step's greedy pick or draw over a vocabulary split over `devices` ("model") exchanges
    each device's (maximum, index) for `rows` rows a device: "kernel" (the one-shot kernel's sum,
    exact for any activation dtype: `tp_kernel`, the run's Mailbox) or "reference" (lax.psum).
    Forced "kernel" still needs a Mailbox and `allreduce.MAX_ROWS`."""
    if policy.tp_pick:
        return "kernel" if policy.tp_pick == "kernel" and _tp_takes(rows, mailbox) else "reference"
    ok = mailbox is not None and tp_kernel(allreduce.row_width(mailbox), platform) and _tp_fits(rows, devices, mailbox)
    return "kernel" if ok else "reference"


def _tp_takes(rows: int, mailbox) -> bool:
    """Whether the one-shot kernel can run at all: a Mailbox and at most allreduce.MAX_ROWS rows."""
    return mailbox is not None and rows <= allreduce.MAX_ROWS


def _tp_fits(rows: int, devices: int, mailbox) -> bool:
    """Whether the one-shot kernel takes `rows` rows a device over `devices` with this Mailbox."""
    return _tp_takes(rows, mailbox) and rows * (devices - 1) <= TP_KERNEL_ROW_PEERS
