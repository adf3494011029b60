"""Timing the library's own speculative step and its named parts (eagle3_jax/spec/step.py), and the
baseline step (the same `step` drafting nothing).

Every timing runs its work in one jitted `fori_loop` over a `DecodeState` carried (donated, updated
in place) as decode's `while_loop` does, parameters passed as arguments, and takes off the cost of
the call itself (`loop_time`). Parts: draft (`propose`: tree + mask), verify (`verify` + `choose`:
the target over the N nodes and its pick at every node), accept (`accept` + `path_tokens`), rewind
(trees only), extend (the draft over the accepted tokens). Caches hold noise; the context stays at
`ctx` committed tokens. Verify runs over the step's own sequence of trees, recorded beforehand, so
that its MoE routing is the step's.

Memory: a timing holds one state (its caches once) beside the parameters. A loop takes over the
carry it is given (donated, not copied), each timing builds its own state after the previous one is
gone, the caches are filled with noise in place, and every array a timed function reads goes in as
an argument (`compile_call` refuses a large closed-over array, which XLA would copy into the
program as a constant). `loop_time` and `time_step` report each executable's buffer sizes
(`timing.program_memory`); `state_bytes` is a state's size without building it.
"""

import contextlib
import dataclasses
import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import convert, parallel
from eagle3_jax.models import Eagle3Config, eagle3, gpt_oss, shards
from eagle3_jax.pallas import select
from eagle3_jax.spec import loop as spec_loop
from eagle3_jax.spec import step as spec_step
from eagle3_jax.spec.metrics import Counters
from eagle3_jax.spec.state import DecodeState, Plan

from . import cli, timing


SHAPE_FORMAT = ("chainK or treeDxKnN (a chain of K drafts; a tree of depth D, topk K, N nodes incl. the root), "
                "e.g. chain3, tree3x4n8")


def parse_shape(s):
    """'chain3' or 'tree3x4n8' (depth x topk, n nodes incl. the root) -> dict(depth, topk, num_nodes).
    Anything else raises ValueError naming SHAPE_FORMAT."""
    m = re.fullmatch(r"chain([1-9]\d*)|tree([1-9]\d*)x([1-9]\d*)n([1-9]\d*)", s)
    if m is None:
        raise ValueError(f"draft shape {s!r}: expected {SHAPE_FORMAT}")
    if m[1]:
        return dict(depth=int(m[1]), topk=1, num_nodes=int(m[1]) + 1)
    return dict(depth=int(m[2]), topk=int(m[3]), num_nodes=int(m[4]))


def decode_kwargs(s):
    """A draft shape string -> decode's keyword arguments (num_spec_tokens, topk, num_draft_tokens)."""
    p = parse_shape(s)
    return dict(num_spec_tokens=p["depth"], topk=p["topk"], num_draft_tokens=p["num_nodes"])


def median_seconds(run, repeats):
    """The median of `metrics["seconds"]` (the call's run time, compile excluded) over `repeats` calls
    of run() (a generate or decode call)."""
    return statistics.median(run().metrics["seconds"] for _ in range(repeats))


def validate_shape_flags(*names, empty: bool = False):
    """Parse the shapes of these flags (lists of shapes, or one shape) when flags are parsed: a bad
    one, or an empty list unless `empty` (where it means "none"), stops the script there."""
    def parse(shapes):
        if not empty and not isinstance(shapes, str) and not shapes:
            raise ValueError("expected at least one draft shape")
        for s in [shapes] if isinstance(shapes, str) else shapes:
            parse_shape(s)

    for name in names:
        cli.check_with(name, parse)


MAX_CAPTURED_BYTES = 1 << 20  # a larger array closed over by a timed function is refused (`compile_call`)


class WithMailbox:
    """A compiled call whose first argument, the mesh's all-reduce Mailbox, it passes itself; other
    attributes are the executable's."""

    def __init__(self, exe, mailbox):
        self.exe, self.mailbox = exe, mailbox

    def __call__(self, *args):
        return self.exe(self.mailbox, *args)

    def __getattr__(self, name):
        return getattr(self.exe, name)


_XLA_REDUCTION = []  # non-empty inside `xla_reduction()`


@contextlib.contextmanager
def xla_reduction():
    """Calls compiled inside this sum over "model" with XLA's all-reduce even where the fused kernel
    would run (no Mailbox). For searches that expect out-of-memory failures (capacity.py): a program
    that fails on one device after another has started its fused kernels would leave them waiting on
    their peers (pallas/allreduce.py), a hang instead of an error."""
    _XLA_REDUCTION.append(True)
    try:
        yield
    finally:
        _XLA_REDUCTION.pop()


def program_mailbox(graphdef, params):
    """The Mailbox decode's programs pass to the one-shot all-reduce kernel for these models
    (`parallel.mailbox` of their mesh and the GptOss target's hidden size), or None (one device, no
    GptOss among them, inside `xla_reduction`, or no kernel: see parallel.mailbox)."""
    mesh = spec_loop.loop_mesh(params)
    if mesh is None or _XLA_REDUCTION:
        return None
    models = nnx.merge(graphdef, params)
    target = next((m for m in (models if isinstance(models, tuple) else (models,)) if isinstance(m, gpt_oss.GptOss)),
                  None)
    return None if target is None else parallel.mailbox(mesh, target.config.hidden_size)


def compile_call(fn, *args, donate_argnums=(), mailbox=None, options=None):
    """`jax.jit(fn, donate_argnums=...)` traced, lowered and compiled for `args` with XLA options
    `options` (None: those decode's programs take, `select.compiler_options`; {}: XLA's defaults): the
    executable (call it with arguments of the same shapes; donated ones are deleted for the caller).
    A function that closes over an array (jax or numpy) of more than MAX_CAPTURED_BYTES raises
    RuntimeError naming its shapes: XLA would copy it into the program as a constant (host and device
    memory beside the array itself); pass it as an argument instead. A first argument (the
    parameters) on a mesh of several devices: traced `on_mesh` as decode's loop is (the models'
    kernels on local shards).
    mailbox (`program_mailbox`): fn is traced under `shards.mailbox_context` with the Mailbox as a
    first argument of the program, which the returned `WithMailbox` passes itself."""
    if mailbox is not None:  # traced as decode's programs are: the Mailbox an argument (spec/loop.py)
        donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        return WithMailbox(compile_call(lambda m, *a: _with_mailbox(fn, m, *a), mailbox, *args,
                                        donate_argnums=tuple(1 + i for i in donate), options=options), mailbox)
    with spec_loop.on_mesh(spec_loop.loop_mesh(args[0]) if args else None):
        traced = jax.jit(fn, donate_argnums=donate_argnums).trace(*args)
    big = [c for c in traced.jaxpr.consts if getattr(c, "nbytes", 0) > MAX_CAPTURED_BYTES]
    if big:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} closes over arrays "
                           f"{', '.join(f'{c.dtype}{list(c.shape)}' for c in big)} "
                           f"({sum(c.nbytes for c in big)} bytes): pass them as arguments")
    return traced.lower().compile(compiler_options=select.compiler_options() if options is None else options)


def _with_mailbox(fn, mailbox, *args):
    with shards.mailbox_context(mailbox):
        return fn(*args)


def distinct_leaves(tree):
    """`tree` with every array that appears more than once (the same object at several leaves, e.g. one
    zero shared by counters) replaced by copies after its first use, so the whole tree can be donated
    (a buffer may be donated once per call). Other leaves are kept as they are."""
    seen = set()

    def one(a):
        if id(a) in seen:
            return jnp.copy(a)
        seen.add(id(a))
        return a

    return jax.tree.map(one, tree)


def loop_time(graphdef, params, fn, carry, iters, profile=False, repeats=3, *, args=(), memory=None):
    """Seconds per iteration of `carry = fn(models, carry, *args)` run in one jitted fori_loop (parameters
    and `args` passed as arguments), without the call's own cost:
    (best time of a call of n iterations - best time of a call of none) / n, n = `iters`, raised
    4x at a time (to at most 64 * iters) until the call takes at least twice the empty one. The trip
    count is an argument, so every call shares one executable. The call's own cost is host work that
    does not overlap the device's: handing over the ~550 parameter arrays of gpt-oss-120b takes about
    a millisecond (on CPU: 0.8-1.8 ms, against 13-50 us for a call with one array); divided by 8
    iterations it had added 0.27-0.36 ms to each baseline and step figure of bench.py on the H200, and
    0.21 ms of the accept part's 0.23. The loop compiles as decode's programs do
    (`select.compiler_options`: on a GPU one CUDA graph reading its trip count on the device; under
    XLA's defaults the host reads the condition each iteration, about 3 us of device time). Callers
    keep the context fixed across iterations, so any n sees the same work.

    The loop takes ownership of `carry`: its arrays are donated to the first call (deleted for the
    caller, who builds a new carry for anything else) and updated in place after, so the loop holds
    one copy of the caches. `args` (arrays fn reads and does not change) are not donated. A timed
    function must take every array as an argument (`compile_call` refuses a large closed-over one).
    With `memory` (a dict), fills it with "program": `timing.program_memory` of the loop's executable
    (its argument, output, alias, temp and peak bytes), "device": `timing.memory_stats()` after
    its first call (the carry and parameters live; None on CPU) and "collectives": the collective
    operations an iteration makes (`timing.collectives`; zeros on one device).
    With `profile`, also the device kernel seconds per iteration by kernel family
    (`timing.kernel_group`, plus "launches": kernels per iteration; `iters` iterations); else {}.
    The profile runs the same loop compiled with XLA's default options where the timed one has others:
    the profiler does not see the kernels inside a loop's CUDA graph (61 of 361 a gpt-oss-120b token on
    an H100, tp_decode_b1_pick_graphs_h100x4.json), so the families are those of the loop launched
    under JAX's defaults, whose times per kernel may differ (a reduction waits on its peers longer)."""
    def run(params, c, n, a):
        m = nnx.merge(graphdef, params)
        return jax.lax.fori_loop(0, n, lambda i, c: fn(m, c, *a), c)

    args, carry = tuple(args), distinct_leaves(carry)
    compiled = compile_call(run, params, carry, jnp.int32(iters), args, donate_argnums=1,
                            mailbox=program_mailbox(graphdef, params))
    box = [carry]
    del carry  # the first call donates the caller's arrays; the loop owns them from here

    def call(n, exe=compiled):
        box[0] = exe(params, box[0], jnp.int32(n), args)
        return box[0]

    def best_of(n):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(call(n))
            best = min(best, time.perf_counter() - t0)
        return best

    jax.block_until_ready(call(iters))  # warm
    if memory is not None:
        memory.update(program=timing.program_memory(compiled), device=timing.memory_stats(),
                      collectives=timing.collectives(compiled))
    empty, n = best_of(0), iters
    full = best_of(n)
    while full < 2 * empty and n < 64 * iters:
        n *= 4
        full = best_of(n)
    groups = {}
    if profile:
        plain = compiled
        if select.compiler_options():  # a loop graph hides its kernels from the profiler
            plain = compile_call(run, params, box[0], jnp.int32(iters), args, donate_argnums=1,
                                 mailbox=program_mailbox(graphdef, params), options={})
            jax.block_until_ready(call(iters, plain))  # warm
        recs = timing.kernel_records(lambda: call(iters, plain), repeats=1)
        for name, _, dur in recs:
            g = timing.kernel_group(name)
            groups[g] = groups.get(g, 0.0) + dur * 1e-9 / iters
        if recs:
            groups["launches"] = len(recs) / iters
    return (full - empty) / n, groups


def once(graphdef, params, fn, *args, donate=()):
    """fn(models, *args) once, compiled by `compile_call` (arrays go in as arguments). `donate`: indices
    into args whose arrays the call takes over (deleted for the caller); return a donated state from
    fn (updated or not) so that its buffers are reused rather than copied."""
    def call(p, *a):
        return fn(nnx.merge(graphdef, p), *a)

    args = tuple(distinct_leaves(a) if i in donate else a for i, a in enumerate(args))
    return compile_call(call, params, *args, donate_argnums=tuple(1 + i for i in donate),
                        mailbox=program_mailbox(graphdef, params))(params, *args)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _noise(key, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * 0.5).astype(dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _add_in_place(a, b):
    return a + b


def _add_noise(tree, key):
    """Every array leaf of `tree` plus N(0, 0.25) noise drawn from `key` in float32 and cast to its
    dtype, the same values for leaves of one shape: drawn once per shape (a temporary of one leaf's
    size) and added to each leaf in place (the leaf donated)."""
    drawn = {}

    def one(a):
        if (a.shape, a.dtype) not in drawn:
            drawn[a.shape, a.dtype] = _noise(key, a.shape, a.dtype)
        return _add_in_place(a, drawn[a.shape, a.dtype])

    return jax.tree.map(one, tree)


SLIDING = ("ring", "dense")  # sliding layers' caches: rings (the library's) or full-length buffers


def noisy_state(target, draft, B, ctx, plan, sliding="ring"):
    """A `DecodeState` at context `ctx` (caches of plan.cache_len positions filled with noise), no slot
    done, no budget or eos that could end it. The same arrays every call (seed 0). sliding "ring": the
    caches `decode` builds (rings of window + plan.step_tokens slots on sliding layers); "dense":
    sliding layers with full-length buffers too, for comparison. Peak memory: the state's own bytes
    (the caches are filled in place). A target on a mesh of several devices (eagle3_jax.parallel):
    the state is built already laid out as `decode` lays it out (`spec.loop.layout`)."""
    if sliding not in SLIDING:
        raise ValueError(f"sliding: {sliding!r}, expected one of {SLIDING}")
    mesh = spec_loop.loop_mesh(nnx.state(target))
    if mesh is not None and B % mesh.shape["data"]:
        raise ValueError(f"batch {B}: not a multiple of the mesh's data axis ({mesh.shape['data']}), over which "
                         "the timed state's rows are split")
    if mesh is not None:
        return jax.jit(lambda: spec_loop.layout(_noisy_state(target, draft, B, ctx, plan, sliding), mesh))()
    return _noisy_state(target, draft, B, ctx, plan, sliding)


def _noisy_state(target, draft, B, ctx, plan, sliding):
    key = jax.random.key(0)
    step_tokens = plan.step_tokens if sliding == "ring" else plan.cache_len
    return DecodeState(
        target_cache=_add_noise(gpt_oss.init_cache(target, B, plan.cache_len, max_step_tokens=step_tokens), key),
        draft_cache=_add_noise(eagle3.init_cache(draft, B, plan.cache_len, max_step_tokens=step_tokens), key)
        if plan.depth else None,
        lengths=jnp.full((B,), ctx, jnp.int32), root=jnp.arange(B, dtype=jnp.int32) + 7,
        h_root=jax.random.normal(key, (B, draft.config.hidden_size), draft.dtype) if plan.depth else None,
        out=jnp.zeros((B, plan.out_len), jnp.int32), n_out=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
        budget=jnp.int32(2 ** 30), eos_ids=jnp.full((8,), -1, jnp.int32), temperature=jnp.float32(1.0), key=key,
        steps=jnp.zeros((), jnp.int32), counters=Counters.zeros(plan.depth))


def state_bytes(target, draft, B, ctx, plan, sliding="ring", mesh=None):
    """Bytes of `noisy_state(target, draft, B, ctx, plan, sliding)`'s arrays (caches first of all),
    from its shapes alone: nothing is allocated. With `mesh`: the bytes each device holds, laid out
    as `spec.loop.layout` lays the state out (the target's caches over data x model, the draft's
    caches and the per-row fields over data, the rest whole; B a multiple of the data axis)."""
    shapes = jax.eval_shape(lambda: _noisy_state(target, draft, B, ctx, plan, sliding))

    def nbytes(tree):
        return sum(int(np.prod(a.shape)) * getattr(a.dtype, "itemsize", 0) for a in jax.tree.leaves(tree))

    if mesh is None:
        return nbytes(shapes)
    data, model = mesh.shape["data"], mesh.shape["model"]
    split = {"target_cache": data * model, "draft_cache": data, **{f: data for f in spec_loop.PER_ROW}}
    fields = {f.name: getattr(shapes, f.name) for f in dataclasses.fields(shapes)}
    return sum(nbytes(v) // split.get(name, 1) for name, v in fields.items())


def step_plan(draft, shape, ctx, proposal="deterministic"):
    """The `Plan` of a speculative step of `shape` (parse_shape's dict) timed at context `ctx`: room
    for the step's writes past ctx, 8 output columns."""
    depth, topk, N = shape["depth"], shape["topk"], shape["num_nodes"]
    return Plan(cache_len=ctx + 2 * N + depth + 8, out_len=8, chunk=1, greedy=proposal != "sample", depth=depth,
                topk=topk, num_nodes=N, feature_ids=tuple(draft.config.feature_layers), proposal=proposal)


def baseline_plan(ctx):
    """The `Plan` of a baseline (greedy, no draft) step timed at context `ctx`."""
    return Plan(cache_len=ctx + 8, out_len=8, chunk=1, greedy=True)


def same_context(new, old):
    """The state after a step with the context, output count and done mask put back, so that every
    iteration of a timing loop sees the same work."""
    return new.replace(lengths=old.lengths, n_out=old.n_out, done=old.done)


def time_step(target, draft, B, shape, ctx, iters=10, parts=True, profile=False, proposal="deterministic",
              sliding="ring"):
    """Seconds of one speculative step (`eagle3_jax.spec.step.step`) over B sequences at context `ctx`
    (caches filled with noise), and with `parts` each of its parts alone: draft (`propose`), verify
    (`verify` + `choose`), accept (`accept` + `path_tokens`), rewind (trees), extend. Returns a dict:
    batch, context, the shape's keys, proposal, "seconds" {name: seconds per iteration}, "memory"
    {name: loop_time's memory dict}; with `parts` also sum_of_parts and step_over_parts; with
    `profile`, "kernels" {name: device kernel seconds per iteration by kernel family}.
    proposal "deterministic" runs greedy (argmax choices); "sample" draws the drafts at temperature 1
    and its accept part is `accept_sampled` (the target's softmax + `accept_sample`). sliding: the
    caches' layout (`noisy_state`). Every timing gets a fresh state (its loop takes the arrays over),
    built after the previous one is freed: one state is live at a time."""
    topk = shape["topk"]
    sample = proposal == "sample"
    plan = step_plan(draft, shape, ctx, proposal)
    graphdef, params = nnx.split((target, draft))
    times, kernels, memory = {}, {}, {}

    def fresh():
        return noisy_state(target, draft, B, ctx, plan, sliding)

    def timed(name, fn, carry, *args):
        memory[name] = {}
        times[name], kernels[name] = loop_time(graphdef, params, fn, carry, iters, profile, args=args,
                                               memory=memory[name])

    def full(m, st):
        return same_context(spec_step.step(m, st, plan), st)

    timed("step", full, fresh())
    out = dict(batch=B, context=ctx, **shape, proposal=proposal, seconds=times, memory=memory)
    if profile:
        out["kernels"] = kernels
    if not parts:
        return out

    def part_draft(m, st):
        tokens, parents, bits, positions, q = spec_step.propose(m[1], st, plan)
        used = tokens[:, -1] + positions[:, -1] + parents[:, -1] + bits[:, -1, 0].astype(jnp.int32)
        return st.replace(root=used + (0 if q is None else (q[:, 0, 0] > 2).astype(jnp.int32)))

    timed("draft", part_draft, fresh())

    # verify sees the step's own sequence of trees (the MoE kernel's time depends on the routing)
    def step_trees(m, st):
        def body(c, _):
            return full(m, c), spec_step.propose(m[1], c, plan)
        return jax.lax.scan(body, st, None, length=iters)  # (the state, donated and dropped; the trees)

    _, trees = once(graphdef, params, step_trees, fresh(), donate=(0,))
    all_tokens, all_parents, all_mask, all_pos, all_q = trees  # [iters, B, N, ...]
    del trees

    def part_verify(m, c, all_tokens, all_pos, all_mask):  # the target over the N nodes (and its choices)
        i = c["i"] % iters
        logits, feats, tc = spec_step.verify(m[0], c["s"], all_tokens[i], all_pos[i], all_mask[i], plan)
        if sample:
            used = (logits[:, :, 0] > 1e30).sum(-1)
        else:
            used = jnp.sum(spec_step.choose(logits, c["s"].key, c["s"].temperature, plan), -1)
        used = used + (feats[:, 0, 0] > 1e30)  # so that no output is dead code
        return dict(s=c["s"].replace(target_cache=tc), i=c["i"] + 1, used=c["used"] + used)

    timed("verify", part_verify, dict(s=fresh(), i=jnp.int32(0), used=jnp.zeros((B,), jnp.int32)),
          all_tokens, all_pos, all_mask)
    tokens, parents, mask, positions = all_tokens[0], all_parents[0], all_mask[0], all_pos[0]
    q = None if all_q is None else all_q[0]
    del all_tokens, all_parents, all_mask, all_pos, all_q

    def verify_once(m, st, tokens, positions, mask):
        logits, feats, tc = spec_step.verify(m[0], st, tokens, positions, mask, plan)
        return logits, feats, st.replace(target_cache=tc)

    logits, feats, st = once(graphdef, params, verify_once, fresh(), tokens, positions, mask, donate=(0,))
    key, temperature = st.key, st.temperature
    del st
    known = (key, temperature, logits, q, tokens, parents)  # what accept reads

    def accept_once(m, key, temperature, logits, q, tokens, parents):
        if sample:
            return spec_step.accept_sampled(m[1], logits, tokens, parents, q, key, temperature, plan)
        return spec_step.accept(tokens, parents, spec_step.choose(logits, key, temperature, plan), plan)

    def part_accept(m, acc, key, temperature, logits, q, tokens, parents):
        a, path, bonus = accept_once(m, jax.random.fold_in(key, acc[0]), temperature, logits, q, tokens, parents)
        nxt = spec_step.path_tokens(tokens, path, a, bonus)
        return acc + a + path[:, 0] + nxt[:, 0]

    timed("accept", part_accept, jnp.zeros((B,), jnp.int32), *known)
    acc, path, bonus = once(graphdef, params, accept_once, *known)
    nxt = spec_step.path_tokens(tokens, path, acc, bonus)
    del known, logits, q
    if topk > 1:
        def part_rewind(m, st, path, acc):
            return st.replace(target_cache=spec_step.rewind(st.target_cache, st.lengths, path, acc, plan))

        timed("rewind", part_rewind, fresh(), path, acc)

    def part_extend(m, st, nxt, feats, path, acc):
        dc, h = spec_step.extend(m[1], st, nxt, feats, path, acc, plan)
        return st.replace(draft_cache=dc, h_root=st.h_root + h)

    timed("extend", part_extend, fresh(), nxt, feats, path, acc)
    parts = sum(v for k, v in times.items() if k != "step")
    out.update(sum_of_parts=parts, step_over_parts=times["step"] / parts)
    return out


def time_baseline(target, B, ctx, iters=10, memory=None, sliding="ring", kernels=None):
    """Seconds of one baseline decode step (`step` with no draft: one token per sequence, the target's
    argmax, the commit) at context `ctx`, caches laid out as `sliding` says (`noisy_state`). With
    `memory` (a dict): filled as `loop_time` fills it; with `kernels` (a dict): filled with the
    device seconds a step of each kernel family, summed over the devices, and "launches" (kernels a
    step over the devices): `loop_time`'s profile, {} where there is none (CPU)."""
    plan = baseline_plan(ctx)
    graphdef, params = nnx.split((target, None))

    def base(m, st):
        return same_context(spec_step.step(m, st, plan), st)

    t, groups = loop_time(graphdef, params, base, noisy_state(target, None, B, ctx, plan, sliding), iters,
                          profile=kernels is not None, memory=memory)
    if kernels is not None:
        kernels.update(groups)
    return t


def random_pair(tcfg, mesh=None, experts: str | None = None):
    """Random packed target of `tcfg` and a random draft of the published gpt-oss-120b EAGLE-3 shape
    scaled to it (hidden = target hidden, MLP 6x, draft vocab 32000 or the whole vocab if smaller).
    mesh: the target created split over it (`convert.random_gpt_oss`, its experts as `experts`
    says), the draft placed by `parallel.shard`."""
    dcfg = Eagle3Config(
        hidden_size=tcfg.hidden_size, intermediate_size=6 * tcfg.hidden_size,
        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=tcfg.head_dim, vocab_size=tcfg.vocab_size, draft_vocab_size=min(32000, tcfg.vocab_size),
        target_hidden_size=tcfg.hidden_size, aux_layer_ids=tcfg.default_aux_layer_ids(),
        target_num_layers=tcfg.num_hidden_layers, max_position_embeddings=tcfg.max_position_embeddings)
    if mesh is None:
        return gpt_oss.random_gpt_oss(tcfg, seed=0), eagle3.random_eagle3(dcfg, seed=1)
    target = convert.random_gpt_oss(tcfg, seed=0, mesh=mesh, experts=experts)
    return target, parallel.shard(eagle3.random_eagle3(dcfg, seed=1), mesh)
