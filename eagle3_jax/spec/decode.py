"""`generate()`: the baseline, one jitted call of chunked prefill + a `lax.while_loop` of decode steps.

Shapes are bucketed (prompt length to a multiple of the prefill chunk, cache and output length to
multiples of `LENGTH_BUCKET`), so calls with similar sizes reuse one compiled executable.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.models import gpt_oss

PREFILL_CHUNK = 256
LENGTH_BUCKET = 256


@dataclasses.dataclass
class Output:
    tokens: list[list[int]]  # per prompt: generated ids, prompt excluded, eos included
    metrics: dict


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompts[{i}]: empty prompt")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}]: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        out.append(p)
    return out


def plan_lengths(config, prompts, max_new_tokens: int, chunk: int, max_cache_len: int | None):
    """(padded prompt length, cache slots, output slots); raises if a prompt plus its budget does not fit."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens
    limit = config.max_position_embeddings if max_cache_len is None else max_cache_len
    if need > limit:
        what = "max_cache_len" if max_cache_len is not None else "max_position_embeddings"
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {need} does not fit "
                         f"{what}={limit}")
    return _round_up(longest, chunk), _round_up(need, LENGTH_BUCKET), _round_up(max_new_tokens, LENGTH_BUCKET)


def pad_prompts(prompts, padded_len: int, pad_id: int = 0):
    arr = np.full((len(prompts), padded_len), pad_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
    return arr, np.array([len(p) for p in prompts], np.int32)


def sample(logits, key, temperature, greedy: bool):
    """logits f32 [B, V] -> int32 [B]: argmax when greedy, else a draw from softmax(logits / T)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _generate_loop(graphdef, state, tokens, prompt_lengths, budget, eos_ids, temperature, key, *,
                   cache_len: int, out_len: int, chunk: int, greedy: bool):
    model = nnx.merge(graphdef, state)
    B = tokens.shape[0]
    cache = gpt_oss.init_cache(model, B, cache_len)
    with jax.named_scope("prefill"):
        cache, h_last = gpt_oss.prefill(model, cache, tokens, prompt_lengths, chunk=chunk)
    first = sample(gpt_oss.logits(model, h_last), jax.random.fold_in(key, 0), temperature, greedy)

    def finished(tok, n_out):
        return jnp.isin(tok, eos_ids) | (n_out >= budget)

    out = jnp.zeros((B, out_len), jnp.int32).at[:, 0].set(first)
    n_out = jnp.ones((B,), jnp.int32)
    init = dict(cache=cache, tok=first, lengths=prompt_lengths, out=out, n_out=n_out,
                done=finished(first, n_out), steps=jnp.zeros((), jnp.int32))

    def body(s):
        active = ~s["done"]
        with jax.named_scope("decode_step"):
            lg, _, cache = gpt_oss.step(model, s["cache"], s["tok"][:, None], s["lengths"][:, None], s["lengths"])
        tok = sample(lg[:, 0], jax.random.fold_in(key, s["steps"] + 1), temperature, greedy)
        tok = jnp.where(active, tok, s["tok"])
        out = s["out"].at[jnp.arange(B), jnp.where(active, s["n_out"], out_len)].set(tok, mode="drop")
        n_out = s["n_out"] + active
        return dict(cache=cache, tok=tok, lengths=s["lengths"] + active, out=out, n_out=n_out,
                    done=s["done"] | finished(tok, n_out), steps=s["steps"] + 1)

    final = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), body, init)
    return final["out"], final["n_out"], final["steps"]


_COMPILED: dict = {}


def compiled(fn, static: dict, graphdef, *args):
    """Compile `fn(graphdef, *args, **static)` once per (graphdef, static values, argument shapes and
    dtypes) and reuse the executable, which takes `*args`.

    Returns (executable, seconds spent compiling now: 0.0 on reuse)."""
    spec = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), args)
    key = (fn, graphdef, tuple(sorted(static.items())), str(jax.tree.structure(args)), str(spec))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    exe = jax.jit(fn, static_argnums=0, static_argnames=tuple(static)).lower(graphdef, *args, **static).compile()
    _COMPILED[key] = exe
    return exe, time.perf_counter() - t0


def generate(target: gpt_oss.GptOss, prompts, max_new_tokens: int, temperature: float = 0.0,
             eos_ids: Sequence[int] | None = None, seed: int = 0, *, max_cache_len: int | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> Output:
    """Baseline autoregressive generation (greedy at temperature 0, else sampling), batched and ragged.

    prompts: list of token-id lists (any lengths). eos_ids default to the config's; a slot stops at
    its first eos (included in its output) or after `max_new_tokens`.
    """
    cfg = target.config
    prompts = validate_prompts(prompts, cfg.vocab_size)
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    eos = np.array(cfg.eos_token_ids if eos_ids is None else list(eos_ids), np.int32).reshape(-1)
    if eos.size and (eos.min() < 0 or eos.max() >= cfg.vocab_size):
        raise ValueError(f"eos_ids: {eos.tolist()} has ids outside the vocabulary [0, {cfg.vocab_size})")
    if eos.size == 0:
        eos = np.array([-1], np.int32)
    padded, cache_len, out_len = plan_lengths(cfg, prompts, max_new_tokens, prefill_chunk, max_cache_len)
    tokens, lengths = pad_prompts(prompts, padded)
    graphdef, state = nnx.split(target)
    args = (state, tokens, lengths, np.int32(max_new_tokens), eos, np.float32(max(temperature, 1e-6)),
            jax.random.key(seed))
    static = dict(cache_len=cache_len, out_len=out_len, chunk=prefill_chunk, greedy=temperature == 0)
    exe, compile_s = compiled(_generate_loop, static, graphdef, *args)
    t0 = time.perf_counter()
    out, n_out, steps = jax.block_until_ready(exe(*args))
    seconds = time.perf_counter() - t0
    out, n_out = np.asarray(out), np.asarray(n_out)
    toks = [out[b, :n_out[b]].tolist() for b in range(len(prompts))]
    total = int(n_out.sum())
    return Output(toks, dict(steps=int(steps), generated_tokens=total, seconds=seconds, compile_seconds=compile_s,
                             tokens_per_second=total / seconds if seconds > 0 else float("inf")))
