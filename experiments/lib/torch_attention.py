"""torch's SDPA and flex_attention on the tree attention bench_attention.py times (GPU only; torch is
imported on first use, so that the script runs where torch is not installed)."""

import numpy as np


def _ancestors(parents, B, Nq):
    """bool [B, Nq, Nq]: node i sees node j (j an ancestor of i or i itself)."""
    anc = np.zeros((B, Nq, Nq), bool)
    for b in range(B):
        for i in range(Nq):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                j = parents[b, j] if j > 0 else -1
    return anc


def _cuda_seconds(torch, f, n_sets, reps=20):
    """Median seconds a call of f(i) (i cycling n_sets inputs) over 5 timings of `reps` calls (CUDA events)."""
    for i in range(3):
        f(i % n_sets)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        t0.record()
        for i in range(reps):
            f(i % n_sets)
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) / 1e3 / reps)
    return float(np.median(times))


def times(B, Nq, L, parents, Hq, Hkv, D, n_sets=4, flex=True) -> dict:
    """{sdpa_s, flex_s} (or *_error): the same tree attention in torch over [B, Hkv, L + Nq, D] caches
    (torch has no sinks, so torch does slightly less work), CUDA events over 20 calls rotating n_sets
    inputs. flex False: flex_attention is not run (it did not compile at Nq=64)."""
    import torch  # an optional dependency: only where torch is compared

    res = _times(torch, B, Nq, L, parents, Hq, Hkv, D, n_sets, flex)
    torch.cuda.empty_cache()  # the inputs are gone with _times's frame
    return res


def _times(torch, B, Nq, L, parents, Hq, Hkv, D, n_sets, flex):
    import torch.nn.functional as F

    dev, S, scale = "cuda", L + Nq, D ** -0.5
    anc = torch.tensor(_ancestors(parents, B, Nq), device=dev)
    sets = [(torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)) for _ in range(n_sets)]
    qs = [torch.randn(B, Hq, Nq, D, device=dev, dtype=torch.bfloat16) for _ in range(n_sets)]
    full = torch.ones(B, 1, Nq, S, dtype=torch.bool, device=dev)
    full[:, 0, :, L:] = anc
    res = {}
    try:
        res["sdpa_s"] = _cuda_seconds(torch, lambda i: F.scaled_dot_product_attention(
            qs[i], sets[i][0], sets[i][1], attn_mask=full, scale=scale, enable_gqa=True), n_sets)
    except Exception as e:  # noqa: BLE001
        res["sdpa_error"] = repr(e)[:300]
    if not flex:
        res["flex_error"] = "not run (flex_attention did not compile at Nq=64 in the issue's measurement)"
        return res
    try:
        res["flex_s"] = _flex_seconds(torch, qs, sets, anc, B, Nq, L, S, scale, n_sets)
    except Exception as e:  # noqa: BLE001
        res["flex_error"] = repr(e)[:300]
    return res


def _flex_seconds(torch, qs, sets, anc, B, Nq, L, S, scale, n_sets):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, qi, kv):
        return (kv < L) | anc[b, qi, (kv - L).clamp(min=0, max=Nq - 1)]

    bm = create_block_mask(mask_mod, B, None, Nq, S, device="cuda")
    return _cuda_seconds(torch, lambda i: flex(qs[i], sets[i][0], sets[i][1], block_mask=bm, scale=scale,
                                               enable_gqa=True), n_sets)
