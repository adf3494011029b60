"""`generate()` and `decode()`: check the inputs, plan the shapes, run the compiled loop (spec/loop.py).

Shapes are bucketed (prompt length to a multiple of the prefill chunk, cache and output length to
multiples of `LENGTH_BUCKET`), so calls with similar sizes reuse one compiled executable.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import parallel
from eagle3_jax.checks import ArgumentError, int_arg, is_int
from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.spec import adaptive, loop, memory, metrics, sampling
from eagle3_jax.spec import cost_table as cost_table_lib
from eagle3_jax.spec.state import Plan
from eagle3_jax.spec.tree import PROPOSALS, max_nodes

PREFILL_CHUNK = 256  # unit of the automatic prefill chunk (tokens)
PREFILL_TOKENS = 2048  # tokens over the batch an automatic prefill chunk holds at most (at least PREFILL_CHUNK a row)
LENGTH_BUCKET = 256
EOS_BUCKET = 8  # eos ids are padded to a multiple of this


@dataclasses.dataclass
class Output:
    """What `generate` and `decode` return. tokens: per prompt, the generated ids (prompt excluded, eos
    included); metrics: a dict (see each function). trace (trace=True; else None): jax.Array int32
    [prompts, steps] on the device, steps = metrics["steps"]: trace[i, s] is the number of tokens prompt
    i's row committed at step s (accepted drafts + the bonus token, after the eos and budget cuts; at
    least 1), -1 once the row was done; each row sums to len(tokens[i]) - 1 (the first token comes from
    the prefill). trace_option (decode(depth="auto", trace=True); else None): jax.Array int32 [steps],
    the option each step ran, an index into metrics["auto"]["options"]."""
    tokens: list[list[int]]
    metrics: dict
    trace: jax.Array | None = None
    trace_option: jax.Array | None = None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _temperature(t) -> float:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"temperature: expected a number, got {t!r}")
    if not (np.isfinite(t) and t >= 0):
        raise ValueError(f"temperature: must be finite and >= 0, got {t}")
    return float(t)


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """prompts as lists of Python ints; raises on anything but a non-empty list of non-empty
    token-id lists (integers: not floats or bools) inside [0, vocab_size)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    # rows of numpy / jax arrays as Python lists (their 0-d elements as Python scalars)
    rows = [np.asarray(p).tolist() if hasattr(p, "__array__") else p for p in prompts]
    if any(is_int(p) for p in rows):
        raise ArgumentError("prompts: expected a list of token-id lists, got a flat list of ids (pass one "
                            "prompt as [ids])")
    out = []
    for i, p in enumerate(rows):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
            raise ArgumentError(f"prompts[{i}]: expected a list of token ids, got {type(p).__name__}")
        p = list(p)
        if not p:
            raise ValueError(f"prompts[{i}]: empty prompt")
        odd = [t for t in p if not is_int(t)]
        if odd:
            raise ArgumentError(f"prompts[{i}]: token ids must be integers, got {odd[0]!r}")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}]: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def prefill_chunk_for(batch: int, longest: int) -> int:
    """The automatic prefill chunk (prefill_chunk=None): the fewest chunks of at most PREFILL_TOKENS
    tokens over the batch (at least PREFILL_CHUNK a row), the longest prompt split evenly between them
    and rounded up to a multiple of PREFILL_CHUNK. The MoE runs more efficiently on more tokens a call:
    prefill times by chunk size: docs/perf/end_to_end.md."""
    cap = max(PREFILL_CHUNK, PREFILL_TOKENS // batch // PREFILL_CHUNK * PREFILL_CHUNK)
    n = -(-longest // cap)
    return _round_up(-(-longest // n), PREFILL_CHUNK)


def plan_lengths(config, prompts, max_new_tokens: int, chunk: int | None, max_cache_len: int | None,
                 slack: int = 0):
    """(padded prompt length, cache slots, output slots, prefill chunk); chunk None: `prefill_chunk_for`.

    Positions: the longest prompt + max_new_tokens must fit max_position_embeddings. Cache: it holds
    those tokens plus `slack` scratch slots (a speculative step writes past the length) and the prompt
    padded to whole chunks (prefill writes whole chunks), rounded up to LENGTH_BUCKET, or at most
    max_cache_len slots where given (the automatic chunk then shrinks to fit if it must). Raises if
    any of these does not fit."""
    max_new_tokens = int_arg("max_new_tokens", max_new_tokens, 1)
    chunk = int_arg("prefill_chunk", chunk, 1, optional=True)
    max_cache_len = int_arg("max_cache_len", max_cache_len, 1, optional=True)
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens
    if need > config.max_position_embeddings:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {need} does not fit "
                         f"max_position_embeddings={config.max_position_embeddings}")
    if max_cache_len is not None and need + slack > max_cache_len:
        extra = f" + {slack} speculative scratch slots" if slack else ""
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens}{extra} = {need + slack} "
                         f"does not fit max_cache_len={max_cache_len}")
    cap = max_cache_len or float("inf")
    auto = chunk is None
    chunk = prefill_chunk_for(len(prompts), longest) if auto else chunk
    if auto and _round_up(longest, chunk) > cap:  # the same number of chunks, not rounded to PREFILL_CHUNK
        chunk = -(-longest // -(-longest // chunk))
    padded = _round_up(longest, chunk)
    if padded > cap:
        raise ValueError(f"prefill_chunk={chunk} pads the {longest}-token prompt to {padded} cache slots, more "
                         f"than max_cache_len={max_cache_len}; pass a prefill_chunk that divides the prompt "
                         f"more closely, or None")
    cache_len = min(max(_round_up(need + slack, LENGTH_BUCKET), padded), cap)
    return padded, cache_len, _round_up(max_new_tokens, LENGTH_BUCKET), chunk


def pad_prompts(prompts, padded_len: int, pad_id: int = 0):
    arr = np.full((len(prompts), padded_len), pad_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
    return arr, np.array([len(p) for p in prompts], np.int32)


def _eos_array(cfg, eos_ids):
    """int32 [multiple of EOS_BUCKET]: the eos ids (the config's for None), padded with -1 (matches no
    token), so calls with different numbers of eos ids share one executable."""
    eos = cfg.eos_token_ids if eos_ids is None else eos_ids
    if is_int(eos) or isinstance(eos, (str, bytes)) or not hasattr(eos, "__iter__"):
        raise ArgumentError(f"eos_ids: expected a sequence of token ids (e.g. [{eos!r}]) or None, got {eos!r}")
    eos = list(eos)
    odd = [t for t in eos if not is_int(t)]
    if odd:
        raise ArgumentError(f"eos_ids: token ids must be integers, got {odd[0]!r}")
    bad = [t for t in eos if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"eos_ids: {eos} has ids outside the vocabulary [0, {cfg.vocab_size})")
    out = np.full(_round_up(max(len(eos), 1), EOS_BUCKET), -1, np.int32)
    out[:len(eos)] = eos
    return out


def _prepare(cfg, prompts, max_new_tokens, temperature, eos_ids, seed, max_cache_len, prefill_chunk, slack=0,
             filters=(None, None, None)):
    """Checks and pads the inputs of `generate` / `decode`: (executable arguments after the model
    state, static lengths). filters: (top_k, top_p, min_p), checked always, dropped at temperature 0."""
    prompts = validate_prompts(prompts, cfg.vocab_size)
    temperature = _temperature(temperature)
    filters = sampling.check_filters(*filters)
    filters = None if temperature == 0 else filters  # greedy: the argmax, which every filter keeps
    seed = int_arg("seed", seed, -(1 << 63))
    eos = _eos_array(cfg, eos_ids)
    padded, cache_len, out_len, chunk = plan_lengths(cfg, prompts, max_new_tokens, prefill_chunk, max_cache_len,
                                                     slack)
    tokens, lengths = pad_prompts(prompts, padded)
    args = (tokens, lengths, np.int32(max_new_tokens), eos, np.float32(max(temperature, 1e-6)), jax.random.key(seed),
            filters)
    return prompts, args, dict(cache_len=cache_len, out_len=out_len, chunk=chunk, greedy=temperature == 0)


def run_context(models, ctx: parallel.RunContext | None) -> parallel.RunContext:
    """ctx, checked against the mesh the parameters of models = (target, draft or None) are on (all on
    one mesh or none: `parallel.mesh_of` raises otherwise), or `parallel.context_for(target)` for None."""
    mesh = parallel.mesh_of(models)
    if ctx is None:  # `parallel.context_for(target)`, from the mesh found above (mesh_of walks every parameter)
        return parallel.context(mesh, hidden=models[0].config.hidden_size)
    if not isinstance(ctx, parallel.RunContext):
        raise ArgumentError(f"ctx: expected a parallel.RunContext (parallel.context_for(target, kernels=...)), "
                            f"got {type(ctx).__name__}")
    mesh = None if mesh is None or mesh.size == 1 else mesh
    if ctx.mesh != mesh:
        raise ValueError(f"ctx: its mesh {ctx.mesh} is not the one the parameters are on ({mesh}); make it with "
                         "parallel.context_for(target, ...)")
    return ctx


def _free(devices, limit: int | None, mesh) -> tuple[int | None, str]:
    """(bytes free a device, where the figure comes from): `limit` where given, else the allocator's
    figures of `devices` (None on a device without them: CPU); on a mesh over several processes the
    fewest over them (spec/memory.py)."""
    free = limit if limit is not None else memory.free_bytes(devices)
    if mesh is not None and mesh.is_multi_process:
        free = memory.fewest_over_processes(free)
    return free, "memory_limit" if limit is not None else "the allocator's bytes_limit - bytes_in_use"


def _run(models, prompts, args, plan: Plan, ctx: parallel.RunContext, memory_limit: int | None):
    """Compiles (once per plan, run context and shapes) and runs the loop: (per-prompt token lists,
    Counters, throughput metrics, extras: "trace" [prompts, steps], "auto" (the loop's AutoState) and
    "trace_option" [steps] where the plan has them). On ctx's mesh the host arguments go onto it: prompts and lengths
    split over "data", the batch padded to a multiple of it with empty prompts (rows that start done
    and are dropped from the outputs), the rest replicated. Before compiling and again before running,
    the state and then the compiled program are checked against the free memory (spec/memory.py). A
    device error after which the fused all-reduce has a failure record (`parallel.failure_report`)
    becomes a RuntimeError naming the reduction, the device and the missing peer."""
    graphdef, state = nnx.split(models)
    mesh = ctx.mesh
    B = len(prompts)
    if mesh is not None:
        tokens, lengths, *rest = args
        pad = -B % mesh.shape["data"]  # rows the data axis lacks: empty prompts, done from the start
        tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), tokens.dtype)])
        lengths = np.concatenate([lengths, np.zeros((pad,), lengths.dtype)])
        args = (parallel.put_rows(tokens, mesh), parallel.put_rows(lengths, mesh), *parallel.replicate(rest, mesh))
    devices = memory.run_devices(mesh, state)
    free, source = _free(devices, memory_limit, mesh)
    if free is not None:
        memory.check_state(models, plan, B, free, mesh, source)
    host_bytes = sum(a.nbytes for a in args if isinstance(a, np.ndarray))  # copied to the device by the call
    args = (state, *args)
    exe, compile_s = loop.compiled(plan, graphdef, ctx, *args)
    free, source = _free(devices, memory_limit, mesh)
    if free is not None:
        memory.check_program(exe, models, plan, B, free, mesh, source, host_bytes)
    t0 = time.perf_counter()
    try:
        out, n_out, steps, counters, *extras = jax.block_until_ready(exe(ctx, *args))
    except jax.errors.JaxRuntimeError as e:  # a fused all-reduce that gave up on a peer says which one
        report = parallel.failure_report()
        if report is None:
            raise
        raise RuntimeError(f"{report} (the device's error: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
                           ) from e
    seconds = time.perf_counter() - t0
    out, n_out, steps = np.asarray(out)[:B], np.asarray(n_out)[:B], int(steps)
    toks = [out[b, :n_out[b]].tolist() for b in range(B)]
    extras = extras[0] if extras else {}
    if "trace" in extras:  # on the device, the padding rows and the steps not run dropped
        extras["trace"] = extras["trace"][:B, :steps]
    if "auto" in extras and extras["auto"].chosen is not None:
        extras["trace_option"] = extras["auto"].chosen[:steps]
    return toks, counters, metrics.throughput(steps, int(n_out.sum()), seconds, compile_s), extras


def generate(target: gpt_oss.GptOss, prompts, max_new_tokens: int, temperature: float = 0.0,
             eos_ids: Sequence[int] | None = None, seed: int = 0, *, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, max_cache_len: int | None = None,
             prefill_chunk: int | None = None, ctx: parallel.RunContext | None = None,
             memory_limit: int | None = None, trace: bool = False) -> Output:
    """Baseline autoregressive generation (greedy at temperature 0, else sampling), batched and ragged.

    top_k (an integer >= 1), top_p (in (0, 1]), min_p (in [0, 1]): sampling filters, None for off
    (spec/sampling.py): a token is drawn from softmax(logits / T) renormalised over the tokens that
    top_k keeps (all tied with the k-th largest logit), of those the likeliest ones that hold top_p
    of their mass (all tied at the edge; top_p = 1: all), and whose probability is at least min_p
    times the largest, as transformers and vLLM filter (top_k, then top_p; min_p commutes). Ignored
    at temperature 0, as vLLM does (greedy takes the argmax, which every filter keeps). Their values
    are arguments of the compiled program (no recompiling); whether any is given is not.
    prompts: list of token-id lists (any lengths). eos_ids: None takes the config's eos ids
    (`config.eos_token_ids`; [] for none); a slot stops at its first eos (included in its output) or
    after `max_new_tokens`. ctx: how the program runs (`parallel.RunContext`: mesh, kernel policy,
    compiler options); None: `parallel.context_for(target)`, the parameters' mesh, automatic kernels.
    prefill_chunk: tokens a row per prefill step (prompts are padded to a multiple of it); None:
    `prefill_chunk_for`. max_cache_len: the most KV-cache slots a row (None: the prompt + budget
    rounded up to LENGTH_BUCKET). memory_limit: bytes a device may take for the call (its state,
    temporaries and outputs; the parameters already there not counted); None: what the allocator
    reports free (`jax.Device.memory_stats()`: bytes_limit - bytes_in_use, the fewest over the mesh's
    devices of this process), and no check on devices that report nothing (CPU). A batch x context
    that does not fit raises ValueError before compiling (its state: the KV caches, spec/memory.py)
    or after compiling and before running (the program's buffers), with the bytes needed and free a
    device and the largest batch that fits. Wrong types raise `ArgumentError` (a ValueError and a
    TypeError), wrong values ValueError. trace: also return `Output.trace` (each step commits one
    token a row here); its buffer, int32 [B, out_len], is written on the device with no host round trip.
    """
    if not isinstance(target, gpt_oss.GptOss):
        raise ArgumentError(f"target: expected a gpt_oss.GptOss, got {type(target).__name__}")
    memory_limit = int_arg("memory_limit", memory_limit, 0, optional=True)
    prompts, args, static = _prepare(target.config, prompts, max_new_tokens, temperature, eos_ids, seed,
                                     max_cache_len, prefill_chunk, filters=(top_k, top_p, min_p))
    ctx = run_context((target, None), ctx)
    toks, _, m, extras = _run((target, None), prompts, args, Plan(**static, trace=_flag("trace", trace)), ctx,
                              memory_limit)
    return Output(toks, m, trace=extras.get("trace"))


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def _check_pair(target, draft):
    if not (isinstance(target, gpt_oss.GptOss) and isinstance(draft, eagle3.Eagle3)):
        raise ArgumentError(f"decode(target, draft, ...): expected a gpt_oss.GptOss and an eagle3.Eagle3, got "
                            f"{type(target).__name__} and {type(draft).__name__}")
    if jnp.dtype(target.dtype) != jnp.dtype(draft.dtype):
        raise ArgumentError(f"decode(target, draft, ...): the target is {jnp.dtype(target.dtype).name} and the draft "
                            f"{jnp.dtype(draft.dtype).name}; a pair runs in one dtype (load_eagle3(..., target=target) "
                            "follows the target's)")
    tc, dc = target.config, draft.config
    problems = []
    if dc.vocab_size != tc.vocab_size:
        problems.append(f"draft vocab_size {dc.vocab_size} != target vocab_size {tc.vocab_size}")
    if dc.target_hidden_size != tc.hidden_size:
        problems.append(f"draft target_hidden_size {dc.target_hidden_size} != target hidden_size {tc.hidden_size}")
    if dc.target_num_layers != tc.num_hidden_layers:
        problems.append(f"draft was made for a {dc.target_num_layers}-layer target, this one has "
                        f"{tc.num_hidden_layers}")
    if dc.hidden_size != draft.embed[...].shape[1]:
        problems.append("draft embedding width does not match its hidden_size")
    if problems:
        raise ValueError("draft incompatible with the target: " + "; ".join(problems))


def decode(target: gpt_oss.GptOss, draft: eagle3.Eagle3, prompts, max_new_tokens: int,
           num_spec_tokens: int | None = None, branching: int | None = None, num_draft_tokens: int | None = None,
           temperature: float = 0.0, eos_ids: Sequence[int] | None = None, seed: int = 0, *,
           top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
           proposal: str = "deterministic", max_cache_len: int | None = None, prefill_chunk: int | None = None,
           ctx: parallel.RunContext | None = None, memory_limit: int | None = None, topk: int | None = None,
           depth: int | str | None = None, cost_table=None, trace: bool = False) -> Output:
    """EAGLE-3 speculative decoding; lossless against `generate` (greedy: token for token; sampling:
    the same law, filters included).

    num_spec_tokens: draft depth (None: 3); depth: None or an integer (the same as num_spec_tokens: a
    fixed depth; both given must agree) or "auto": each step chooses, on the device, the number of
    drafts d in 0 .. num_spec_tokens (0: a plain target step) and, for a tree, the configured tree,
    whichever maximises the expected committed tokens a second from each slot's running acceptance
    and a table of step times (spec/adaptive.py). cost_table (depth="auto" only): None, the table
    shipped for the parameters' device kind (spec/cost_table.py); a path to a table file; or its
    contents as a dict (one table without "model" is taken as it is). The choice reads earlier steps
    only, so the output is exact as with a fixed depth. trace: also return `Output.trace` (and with
    depth="auto" `Output.trace_option`), written on the device with no host round trip.
    branching: children per expanded node (None: 1, a chain; `topk`
    is its old name, deprecated); num_draft_tokens: tree nodes N including the root (default:
    num_spec_tokens + 1 for a chain; required <= 1 + branching + (depth - 1) * branching^2 for a
    tree); top_k, top_p, min_p (the sampling filters), prefill_chunk, max_cache_len, eos_ids, ctx and
    memory_limit as in `generate` (the cache also holds num_draft_tokens + num_spec_tokens + 1 scratch
    slots; the state also holds the draft's cache). Output as `generate`, with
    acceptance metrics: mean_accept_length (tau: tokens committed per slot-step, the bonus token
    counted), accept_rate (accepted drafts per slot-step over the most a step can accept,
    min(num_spec_tokens, num_draft_tokens - 1)), accept_rate_per_position, accept_length_histogram,
    frac_steps_ge2, slot_steps, and the proposal. depth="auto" adds depth ("auto"), depth_histogram
    (steps by option name: chain<d>, tree<depth>x<branching>n<nodes>), auto (per option: steps,
    slot-steps, predicted and realised committed tokens a slot-step; predicted_seconds: the table's
    seconds summed over the steps run; the table's origin) and takes accept_rate over the drafts the
    chosen options verified, accept_rate_per_position over the slot-steps that verified that position.

    proposal (spec/tree.py, spec/step.py): "deterministic" drafts the draft's `branching` likeliest
    children and, at temperature > 0, verifies them as given against one draw per node from the
    target's filtered distribution (exact); "sample" (temperature > 0 only) draws each node's
    children i.i.d. from the draft at the decoding temperature under the same filters and verifies
    them by recursive rejection with the draft's filtered probabilities (exact).
    """
    _check_pair(target, draft)
    num_spec_tokens, auto = _depth(num_spec_tokens, depth)
    trace = _flag("trace", trace)
    if cost_table is not None and not auto:
        raise ArgumentError("cost_table: only depth='auto' reads a table of step times; pass depth='auto'")
    if not isinstance(proposal, str) or proposal not in PROPOSALS:
        raise ArgumentError(f"proposal: {proposal!r}, expected one of {list(PROPOSALS)}")
    if proposal == "sample" and _temperature(temperature) == 0:
        raise ArgumentError("proposal: 'sample' draws drafts at the decoding temperature, which is 0 here; use "
                            "proposal='deterministic' for greedy decoding (allowed: "
                            f"{list(PROPOSALS)} at temperature > 0, 'deterministic' at 0)")
    if topk is not None:
        if branching is not None:
            raise ArgumentError(f"branching={branching!r} and topk={topk!r}: topk is the deprecated name of "
                                "branching (children per tree node); pass branching only")
        warnings.warn("decode(topk=...) is deprecated: pass branching= (children per tree node); top_k= is the "
                      "sampling filter", DeprecationWarning, stacklevel=2)
        branching = topk
    branching = int_arg("branching", 1 if branching is None else branching, 1)
    num_draft_tokens = int_arg("num_draft_tokens", num_draft_tokens, 2, optional=True)
    memory_limit = int_arg("memory_limit", memory_limit, 0, optional=True)
    if branching > draft.config.draft_vocab_size:
        raise ValueError(f"branching: {branching} > draft vocabulary size {draft.config.draft_vocab_size}")
    most = max_nodes(num_spec_tokens, branching)
    if num_draft_tokens is None:
        num_draft_tokens = num_spec_tokens + 1 if branching == 1 else min(most, 2 * num_spec_tokens + 2)
    if not 2 <= num_draft_tokens <= most:
        raise ValueError(f"num_draft_tokens: {num_draft_tokens} outside [2, {most}] for depth {num_spec_tokens}, "
                         f"branching {branching}")
    options = cost_table_lib.auto_options(num_spec_tokens, branching, num_draft_tokens) if auto else ()
    shape = dict(depth=num_spec_tokens, branching=branching, num_nodes=num_draft_tokens, auto=options)
    slack = Plan(0, 0, 0, True, **shape).slack  # verify writes N slots, extend depth + 1 past the length
    prompts, args, static = _prepare(target.config, prompts, max_new_tokens, temperature, eos_ids, seed,
                                     max_cache_len, prefill_chunk, slack, (top_k, top_p, min_p))
    plan = Plan(**static, **shape, feature_ids=tuple(draft.config.feature_layers), proposal=proposal, trace=trace)
    ctx = run_context((target, draft), ctx)
    if auto:
        data = 1 if ctx.mesh is None else ctx.mesh.shape["data"]
        device = memory.run_devices(ctx.mesh, nnx.state(target))[0]
        table, origin = cost_table_lib.resolve(cost_table, device, target.config, draft.config, target.dtype,
                                               proposal, plan.greedy, options, _round_up(len(prompts), data))
        args = (*args, table)
    toks, counters, m, extras = _run((target, draft), prompts, args, plan, ctx, memory_limit)
    m.update(metrics.acceptance(counters, num_spec_tokens, num_draft_tokens), num_spec_tokens=num_spec_tokens,
             branching=branching, num_draft_tokens=num_draft_tokens, proposal=proposal)
    if auto:
        names = [cost_table_lib.option_name(o) for o in options]
        m.update(adaptive.summary(extras["auto"], options, names, counters.hist), depth="auto")
        m["auto"]["table"] = origin
    return Output(toks, m, trace=extras.get("trace"), trace_option=extras.get("trace_option"))


def _depth(num_spec_tokens, depth) -> tuple[int, bool]:
    """(the draft depth, or the most drafts for "auto"; whether depth is "auto") from decode's arguments."""
    if depth is None or isinstance(depth, str):
        if depth not in (None, "auto"):
            raise ArgumentError(f"depth: expected an integer >= 1, 'auto' or None, got {depth!r}")
        return int_arg("num_spec_tokens", 3 if num_spec_tokens is None else num_spec_tokens, 1), depth == "auto"
    depth = int_arg("depth", depth, 1)
    if num_spec_tokens is not None and int_arg("num_spec_tokens", num_spec_tokens, 1) != depth:
        raise ArgumentError(f"depth={depth} and num_spec_tokens={num_spec_tokens}: an integer depth is the number "
                            "of drafts, num_spec_tokens; give one of them (or depth='auto', up to num_spec_tokens)")
    return depth, False
