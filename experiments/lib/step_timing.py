"""Timing the library's own speculative step and its named parts (eagle3_jax/spec/step.py), and the
baseline step (the same `step` drafting nothing), in the run context decode runs them in.

Every timing runs its work in one jitted `fori_loop` over a `DecodeState` carried (donated, updated
in place) as decode's `while_loop` does (the step's state laid out by `spec.loop.layout` each
iteration, as there), the parameters and the run context (`parallel.RunContext`: mesh, kernel
policy, compiler options, the all-reduce's Mailbox) passed as arguments, and takes off the cost of
the call itself (`loop_time`). The state is the one `spec.loop.init_state` makes (its fields,
shapes and layout, read with jax.eval_shape: nothing is prefilled), its caches filled with noise and
its context set to `context` committed tokens, which every iteration keeps. Parts: draft (`propose`:
tree + mask), verify (`verify` + `choose`: the target over the N nodes and its pick at every node),
accept (`accept` + `path_tokens`), rewind (trees only), extend (the draft over the accepted tokens).
Verify runs over the step's own sequence of trees, recorded beforehand, so that its MoE routing is
the step's. A timed function takes the run context as its last argument, as spec/step.py's parts do.

Memory: a timing holds one state (its caches once) beside the parameters. A loop takes over the
carry it is given (donated, not copied), each timing builds its own state after the previous one is
gone, and every array a timed function reads goes in as an argument (`compile_call` refuses a large
closed-over array, which XLA would copy into the program as a constant). `loop_time` and
`time_step` report each executable's buffer sizes (`timing.program_memory`); `state_bytes` is a
state's size without building it.
"""

import collections
import dataclasses
import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from eagle3_jax import convert, parallel
from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss
from eagle3_jax.spec import loop as spec_loop
from eagle3_jax.spec import step as spec_step
from eagle3_jax.spec.state import Plan

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
    """A draft shape string -> decode's keyword arguments (num_spec_tokens, branching, num_draft_tokens)."""
    p = parse_shape(s)
    return dict(num_spec_tokens=p["depth"], branching=p["topk"], num_draft_tokens=p["num_nodes"])


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


# -- the run context --------------------------------------------------------------------------------

REDUCTIONS = ("kernel", "xla")  # how a step sums over "model": see `run_context`


def run_context(target, reduction: str = "kernel", kernels=None) -> parallel.RunContext:
    """The RunContext decode runs `target` in (`parallel.context_for`: its parameters' mesh, the fused
    all-reduce's Mailbox where that mesh gets one, `kernels` (a `select.KernelPolicy`; None:
    automatic), decode's compiler options); reduction "xla": the same without a Mailbox, every sum
    over "model" through XLA's all-reduce. For searches that expect out-of-memory failures
    (capacity.py): a program that fails on one device after another has started its fused kernels
    would leave them waiting on their peers (pallas/allreduce.py), a hang instead of an error."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r}, expected one of {REDUCTIONS}")
    if reduction == "xla":
        return parallel.context(parallel.mesh_of(target), kernels=kernels)
    return parallel.context_for(target, kernels=kernels)


def _default_context(params) -> parallel.RunContext:
    """For timed functions of any parameters: the mesh they are on, no Mailbox, decode's options."""
    return parallel.context(parallel.mesh_of(params))


# -- compiled loops ---------------------------------------------------------------------------------

MAX_CAPTURED_BYTES = 1 << 20  # a larger array closed over by a timed function is refused (`compile_call`)


def compile_call(fn, ctx, *args, donate_argnums=(), options=None):
    """`jax.jit(fn)` traced, lowered and compiled for (ctx, *args) as spec/loop.py compiles decode's
    program: the run context `ctx` an argument (its Mailbox's arrays are the program's inputs), XLA
    options `options` (None: the context's, `RunContext.options`; {}: XLA's defaults). Call the
    executable with (ctx, *args) of the same shapes; `donate_argnums` index `args`, whose arrays are
    then deleted for the caller. A function that closes over an array (jax or numpy) of more than
    MAX_CAPTURED_BYTES raises RuntimeError naming its shapes: XLA would copy it into the program as a
    constant (host and device memory beside the array itself); pass it as an argument instead."""
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    traced = jax.jit(fn, donate_argnums=tuple(1 + i for i in donate)).trace(ctx, *args)
    big = [c for c in traced.jaxpr.consts if getattr(c, "nbytes", 0) > MAX_CAPTURED_BYTES]
    if big:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} closes over arrays "
                           f"{', '.join(f'{c.dtype}{list(c.shape)}' for c in big)} "
                           f"({sum(c.nbytes for c in big)} bytes): pass them as arguments")
    return traced.lower().compile(compiler_options=ctx.options if options is None else options)


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


def loop_time(graphdef, params, fn, carry, iters, profile=False, repeats=3, *, args=(), memory=None, ctx=None,
              runner=None):
    """Seconds per iteration of `carry = fn(models, carry, *args, ctx)` run in one jitted fori_loop
    (parameters, `args` and the run context `ctx` passed as arguments; None: the parameters' mesh, no
    Mailbox), without the call's own cost: (best time of a call of n iterations - best time of a
    call of none) / n, n = `iters`, raised 4x at a time (to at most 64 * iters) until the call takes
    at least twice the empty one. The trip count is an argument, so every call shares one
    executable. The call's own cost is host work that does not overlap the device's: handing over
    the ~550 parameter arrays of gpt-oss-120b takes about a millisecond, which divided by a few
    iterations would weigh on every step figure. The loop compiles with ctx's compiler options, as
    decode's programs do (on a GPU one CUDA graph reading its trip count on the device). Callers
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
    The profile runs the same loop compiled with XLA's default options where ctx has others: the
    profiler does not see the kernels inside a loop's CUDA graph, so the families are those of the
    loop launched under JAX's defaults, whose times per kernel may differ (a reduction waits on its
    peers longer). With `runner` (a dict), its "run" becomes the timed executable as a function
    (carry, n) -> carry after n iterations (the carry donated), for work that needs the loop's states."""
    ctx = _default_context(params) if ctx is None else ctx

    def run(ctx, params, c, n, a):
        m = nnx.merge(graphdef, params)
        return jax.lax.fori_loop(0, n, lambda i, c: fn(m, c, *a, ctx), c)

    args, carry = tuple(args), distinct_leaves(carry)
    compiled = compile_call(run, ctx, params, carry, jnp.int32(iters), args, donate_argnums=1)
    box = [carry]
    del carry  # the first call donates the caller's arrays; the loop owns them from here

    def call(n, exe=compiled):
        box[0] = exe(ctx, params, box[0], jnp.int32(n), args)
        return box[0]

    jax.block_until_ready(call(iters))  # warm
    if runner is not None:
        runner["run"] = lambda c, n: compiled(ctx, params, distinct_leaves(c), jnp.int32(n), args)
    if memory is not None:
        memory.update(program=timing.program_memory(compiled), device=timing.memory_stats(),
                      collectives=timing.collectives(compiled))
    empty, n = _best_of(call, 0, repeats), iters
    full = _best_of(call, n, repeats)
    while full < 2 * empty and n < 64 * iters:
        n *= 4
        full = _best_of(call, n, repeats)
    groups = {}
    if profile:
        plain = compiled
        if ctx.compiler_options:  # a loop graph hides its kernels from the profiler
            plain = compile_call(run, ctx, params, box[0], jnp.int32(iters), args, donate_argnums=1, options={})
            jax.block_until_ready(call(iters, plain))  # warm
        groups = _kernel_groups(lambda: call(iters, plain), iters)
    return (full - empty) / n, groups


def _best_of(call, n, repeats):
    """The fastest of `repeats` blocked calls of call(n), in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call(n))
        best = min(best, time.perf_counter() - t0)
    return best


def _kernel_groups(thunk, iters):
    """Device seconds per iteration by kernel family of one profiled thunk() of `iters` iterations, and
    "launches" (kernels per iteration); {} without device records (CPU)."""
    recs = timing.kernel_records(thunk, repeats=1)
    groups = {}
    for name, _, dur in recs:
        g = timing.kernel_group(name)
        groups[g] = groups.get(g, 0.0) + dur * 1e-9 / iters
    if recs:
        groups["launches"] = len(recs) / iters
    return groups


def once(graphdef, params, fn, *args, donate=(), ctx=None):
    """fn(models, *args, ctx) once, compiled by `compile_call` (arrays go in as arguments; ctx as in
    `loop_time`). `donate`: indices into args whose arrays the call takes over (deleted for the
    caller); return a donated state from fn (updated or not) so that its buffers are reused rather
    than copied."""
    ctx = _default_context(params) if ctx is None else ctx

    def call(ctx, p, *a):
        return fn(nnx.merge(graphdef, p), *a, ctx)

    args = tuple(distinct_leaves(a) if i in donate else a for i, a in enumerate(args))
    return compile_call(call, ctx, params, *args, donate_argnums=tuple(1 + i for i in donate))(ctx, params, *args)


# -- the timed state --------------------------------------------------------------------------------

SLIDING = ("ring", "dense")  # sliding layers' caches: rings (the library's) or full-length buffers
BUDGET = 2 ** 30  # the timed state's token budget: no step ends a slot
EOS_SLOTS = 8  # eos ids of the timed state, all -1: none ends a slot


_SHAPES: collections.OrderedDict = collections.OrderedDict()  # `state_shapes` of the last few models and plans


def state_shapes(target, draft, B, plan, sliding="ring", ctx=parallel.ONE_DEVICE):
    """The `DecodeState` that `spec.loop.init_state` makes for B rows under `plan` in `ctx`, as
    jax.ShapeDtypeStructs (traced, not run: nothing is compiled or allocated). sliding "ring": the
    caches decode builds (rings of window + plan.step_tokens slots on sliding layers); "dense":
    sliding layers with full-length buffers too, for comparison. Kept for the last few (configs,
    dtypes, B, plan, sliding): the shapes depend on nothing else (not on the layout)."""
    if sliding not in SLIDING:
        raise ValueError(f"sliding: {sliding!r}, expected one of {SLIDING}")
    models = (target, draft if plan.depth else None)
    key = tuple((m.config, jnp.dtype(m.dtype)) for m in models if m is not None) + (B, plan, sliding)
    if key not in _SHAPES:
        _SHAPES[key] = _state_shapes(models, B, plan, sliding, ctx)
        while len(_SHAPES) > 32:
            _SHAPES.popitem(last=False)
    return _SHAPES[key]


def _state_shapes(models, B, plan, sliding, ctx):
    target, draft = models

    def init(tokens, lengths):
        return spec_loop.init_state(models, tokens, lengths, jnp.int32(BUDGET), jnp.full((EOS_SLOTS,), -1, jnp.int32),
                                    jnp.float32(1.0), jax.random.key(0), None, plan, ctx)

    shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((B, 1), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    if sliding == "dense":
        def full(init_cache, model):
            return jax.eval_shape(lambda: init_cache(model, B, plan.cache_len, max_step_tokens=plan.cache_len))

        shapes = shapes.replace(target_cache=full(gpt_oss.init_cache, target),
                                draft_cache=full(eagle3.init_cache, draft) if plan.depth else None)
    return shapes


def noisy_states(target, draft, B, context, plan, sliding="ring", ctx=parallel.ONE_DEVICE):
    """A function of no arguments that makes a fresh `DecodeState` of `state_shapes` at context
    `context` each call, by one compiled program: caches of plan.cache_len positions filled with noise
    (N(0, 0.25), the same values for caches of one shape, seed 0), no slot done, no budget or eos
    that could end one, laid out over ctx's mesh as decode lays it out (`spec.loop.layout`). Peak
    memory: the state's own bytes and a noise draw of a cache's size. B must be a multiple of the
    mesh's data axis (ValueError)."""
    mesh = ctx.mesh
    if mesh is not None and B % mesh.shape["data"]:
        raise ValueError(f"batch {B}: not a multiple of the mesh's data axis ({mesh.shape['data']}), over which "
                         "the timed state's rows are split")
    return jax.jit(functools.partial(_noisy, state_shapes(target, draft, B, plan, sliding, ctx), context, mesh))


def _noisy(shapes, context, mesh):
    key = jax.random.key(0)
    drawn = {}

    def noise(s):
        if (s.shape, s.dtype) not in drawn:
            drawn[s.shape, s.dtype] = (jax.random.normal(key, s.shape, jnp.float32) * 0.5).astype(s.dtype)
        return drawn[s.shape, s.dtype]

    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         shapes.replace(target_cache=None, draft_cache=None, h_root=None, key=None))
    B, h = shapes.lengths.shape[0], shapes.h_root
    state = state.replace(
        target_cache=jax.tree.map(noise, shapes.target_cache),
        draft_cache=None if shapes.draft_cache is None else jax.tree.map(noise, shapes.draft_cache),
        h_root=None if h is None else jax.random.normal(key, h.shape, h.dtype),
        lengths=jnp.full((B,), context, jnp.int32), root=jnp.arange(B, dtype=jnp.int32) + 7,
        budget=jnp.int32(BUDGET), eos_ids=jnp.full(shapes.eos_ids.shape, -1, jnp.int32),
        temperature=jnp.float32(1.0), key=key)
    return spec_loop.layout(state, mesh)


def state_bytes(target, draft, B, context, plan, sliding="ring", mesh=None):
    """Bytes of the arrays of a state `noisy_states(target, draft, B, context, plan, sliding)` makes
    (caches first of all), from shapes alone: nothing is allocated. With `mesh`: the bytes each device
    holds, laid out as `spec.loop.layout` lays the state out (the target's caches over data x model,
    the draft's caches and the per-row fields over data, the rest whole; B a multiple of the data
    axis). `state_sizes` gives the same for any B from one trace."""
    del context  # the caches' length is plan.cache_len
    return state_sizes(target, draft, plan, sliding, mesh)(B)


def state_sizes(target, draft, plan, sliding="ring", mesh=None):
    """B -> `state_bytes(target, draft, B, ..., plan, sliding, mesh)`: each field's bytes are a fixed
    part plus a part per row, read from the state's shapes at 1 and 2 rows."""
    def fields(B):
        shapes = state_shapes(target, draft, B, plan, sliding)
        return {f.name: sum(int(np.prod(a.shape)) * getattr(a.dtype, "itemsize", 0)
                            for a in jax.tree.leaves(getattr(shapes, f.name)))
                for f in dataclasses.fields(shapes)}

    one, two = fields(1), fields(2)
    split = {}
    if mesh is not None:
        data, model = mesh.shape["data"], mesh.shape["model"]
        split = {"target_cache": data * model, "draft_cache": data, **{f: data for f in spec_loop.PER_ROW}}
    return lambda B: sum((2 * one[f] - two[f] + B * (two[f] - one[f])) // split.get(f, 1) for f in one)


def step_plan(draft, shape, context, proposal="deterministic"):
    """The `Plan` of a speculative step of `shape` (parse_shape's dict) timed at context `context`: room
    for the step's writes past it, 8 output columns."""
    depth, topk, N = shape["depth"], shape["topk"], shape["num_nodes"]
    return Plan(cache_len=context + 2 * N + depth + 8, out_len=8, chunk=1, greedy=proposal != "sample", depth=depth,
                branching=topk, num_nodes=N, feature_ids=tuple(draft.config.feature_layers), proposal=proposal)


def baseline_plan(context):
    """The `Plan` of a baseline (greedy, no draft) step timed at context `context`."""
    return Plan(cache_len=context + 8, out_len=8, chunk=1, greedy=True)


def same_context(new, old):
    """The state after a step with the context, output count and done mask put back, so that every
    iteration of a timing loop sees the same work."""
    return new.replace(lengths=old.lengths, n_out=old.n_out, done=old.done)


def decode_step(plan):
    """The body of decode's loop under `plan`, the context kept (`same_context`): a timed function
    (models, state, ctx) -> state."""
    def body(models, state, ctx):
        return same_context(spec_loop.layout(spec_step.step(models, state, plan, ctx), ctx.mesh), state)

    return body


# -- the step, its parts and the baseline ----------------------------------------------------------

@dataclasses.dataclass
class _Timings:
    """What the timings of one `time_step` share: the models split, the plan and run context, a maker
    of fresh states (`noisy_states`), and the figures so far by name."""
    graphdef: object
    params: object
    plan: Plan
    ctx: parallel.RunContext
    fresh: object
    iters: int
    profile: bool
    seconds: dict = dataclasses.field(default_factory=dict)
    kernels: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)

    def timed(self, name, fn, carry, *args, runner=None):
        """`loop_time` of fn over `carry`, recorded under `name`."""
        self.memory[name] = {}
        self.seconds[name], self.kernels[name] = loop_time(self.graphdef, self.params, fn, carry, self.iters,
                                                           self.profile, args=args, memory=self.memory[name],
                                                           ctx=self.ctx, runner=runner)

    def once(self, fn, *args, donate=()):
        return once(self.graphdef, self.params, fn, *args, donate=donate, ctx=self.ctx)


def time_step(target, draft, B, shape, context, iters=10, parts=True, profile=False, proposal="deterministic",
              sliding="ring", ctx=None):
    """Seconds of one speculative step (`eagle3_jax.spec.step.step`, as decode's loop runs it) over B
    sequences at context `context` (caches filled with noise), and with `parts` each of its parts
    alone: draft (`propose`), verify (`verify` + `choose`), accept (`accept` + `path_tokens`), rewind
    (trees), extend. ctx: the run context (None: `run_context(target)`, decode's). Returns a dict:
    batch, context, the shape's keys, proposal, "seconds" {name: seconds per iteration}, "memory"
    {name: loop_time's memory dict}; with `parts` also sum_of_parts and step_over_parts; with
    `profile`, "kernels" {name: device kernel seconds per iteration by kernel family}.
    proposal "deterministic" runs greedy (argmax choices); "sample" draws the drafts at temperature 1
    and its accept part is `accept_sampled` (the target's softmax + `accept_sample`). sliding: the
    caches' layout (`state_shapes`). Every timing gets a fresh state (its loop takes the arrays over),
    built after the previous one is freed: one state is live at a time."""
    ctx = run_context(target) if ctx is None else ctx
    plan = step_plan(draft, shape, context, proposal)
    t = _Timings(*nnx.split((target, draft)), plan, ctx, noisy_states(target, draft, B, context, plan, sliding, ctx),
                 iters, profile)
    step = {}
    t.timed("step", decode_step(plan), t.fresh(), runner=step)
    out = dict(batch=B, context=context, **shape, proposal=proposal, seconds=t.seconds, memory=t.memory)
    if profile:
        out["kernels"] = t.kernels
    if parts:
        _time_parts(t, B, step["run"])
        total = sum(v for k, v in t.seconds.items() if k != "step")
        out.update(sum_of_parts=total, step_over_parts=t.seconds["step"] / total)
    return out


def _time_parts(t: _Timings, B, run_step):
    """Times the step's parts alone into `t`: draft, verify, accept, rewind (trees) and extend, each on
    what the part before it made. run_step: the timed step loop (`loop_time`'s runner)."""
    plan = t.plan

    def part_draft(m, st, ctx):
        tokens, parents, bits, positions, q = spec_step.propose(m[1], st, plan, ctx)
        used = tokens[:, -1] + positions[:, -1] + parents[:, -1] + bits[:, -1, 0].astype(jnp.int32)
        return st.replace(root=used + (0 if q is None else (q[:, 0, 0] > 2).astype(jnp.int32)))

    t.timed("draft", part_draft, t.fresh())
    tokens, parents, mask, positions, q = _time_verify(t, B, _step_trees(t, run_step))

    def verify_once(m, st, tokens, positions, mask, ctx):
        logits, feats, tc = spec_step.verify(m[0], st, tokens, positions, mask, plan, ctx)
        return logits, feats, st.replace(target_cache=tc)

    logits, feats, st = t.once(verify_once, t.fresh(), tokens, positions, mask, donate=(0,))
    known = (st.key, st.temperature, logits, q, tokens, parents)  # what accept reads
    del st, logits, q
    nxt, path, acc = _time_accept(t, B, known)
    del known
    if plan.branching > 1:
        def part_rewind(m, st, path, acc, ctx):
            return st.replace(target_cache=spec_step.rewind(st.target_cache, st.lengths, path, acc, plan, ctx))

        t.timed("rewind", part_rewind, t.fresh(), path, acc)

    def part_extend(m, st, nxt, feats, path, acc, ctx):
        dc, h = spec_step.extend(m[1], st, nxt, feats, path, acc, plan, ctx)
        return st.replace(draft_cache=dc, h_root=st.h_root + h)

    t.timed("extend", part_extend, t.fresh(), nxt, feats, path, acc)


def _step_trees(t: _Timings, run_step):
    """What `iters` steps from a fresh state propose in turn: (tokens, parents, mask, positions, q),
    each [iters, B, ...] (q None but for proposal "sample"). The steps run in the timed step loop's
    executable (`run_step`, one iteration a call), the proposals in a program of `propose` alone."""
    plan = t.plan

    def propose(ctx, params, state):
        return spec_step.propose(nnx.merge(t.graphdef, params)[1], state, plan, ctx)

    state = t.fresh()
    propose = compile_call(propose, t.ctx, t.params, state)
    trees = []
    for _ in range(t.iters):
        trees.append(propose(t.ctx, t.params, state))
        state = run_step(state, 1)
    del state
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _time_verify(t: _Timings, B, trees):
    """Times verify (and the target's choice at every node) over the step's own sequence of `trees`,
    so that its MoE routing is the step's; returns the first tree (tokens, parents, mask, positions, q)."""
    plan, iters = t.plan, t.iters
    all_tokens, all_parents, all_mask, all_pos, all_q = trees

    def part_verify(m, c, all_tokens, all_pos, all_mask, ctx):
        i = c["i"] % iters
        logits, feats, tc = spec_step.verify(m[0], c["s"], all_tokens[i], all_pos[i], all_mask[i], plan, ctx)
        if plan.proposal == "sample":
            used = (logits[:, :, 0] > 1e30).sum(-1)
        else:
            used = jnp.sum(spec_step.choose(logits, c["s"].key, c["s"].temperature, plan, ctx), -1)
        used = used + (feats[:, 0, 0] > 1e30)  # so that no output is dead code
        return dict(s=c["s"].replace(target_cache=tc), i=c["i"] + 1, used=c["used"] + used)

    t.timed("verify", part_verify, dict(s=t.fresh(), i=jnp.int32(0), used=jnp.zeros((B,), jnp.int32)),
            all_tokens, all_pos, all_mask)
    return all_tokens[0], all_parents[0], all_mask[0], all_pos[0], None if all_q is None else all_q[0]


def _time_accept(t: _Timings, B, known):
    """Times accept (`choose` + `accept`, or `accept_sampled`) and `path_tokens` on `known` (key,
    temperature, logits, q, tokens, parents); returns the step's (tokens, path, accepted drafts)."""
    plan = t.plan

    def accept_once(m, key, temperature, logits, q, tokens, parents, ctx):
        if plan.proposal == "sample":
            return spec_step.accept_sampled(m[1], logits, tokens, parents, q, key, temperature, plan, ctx)
        return spec_step.accept(tokens, parents, spec_step.choose(logits, key, temperature, plan, ctx), plan, ctx)

    def part_accept(m, acc, key, temperature, logits, q, tokens, parents, ctx):
        a, path, bonus = accept_once(m, jax.random.fold_in(key, acc[0]), temperature, logits, q, tokens, parents,
                                     ctx)
        nxt = spec_step.path_tokens(tokens, path, a, bonus)
        return acc + a + path[:, 0] + nxt[:, 0]

    t.timed("accept", part_accept, jnp.zeros((B,), jnp.int32), *known)
    acc, path, bonus = t.once(accept_once, *known)
    return spec_step.path_tokens(known[4], path, acc, bonus), path, acc


def time_baseline(target, B, context, iters=10, memory=None, sliding="ring", kernels=None, ctx=None):
    """Seconds of one baseline decode step (`step` with no draft: one token per sequence, the target's
    argmax, the commit) at context `context`, caches laid out as `sliding` says (`state_shapes`), in
    the run context `ctx` (None: `run_context(target)`). With `memory` (a dict): filled as `loop_time`
    fills it; with `kernels` (a dict): filled with the device seconds a step of each kernel family,
    summed over the devices, and "launches" (kernels a step over the devices): `loop_time`'s
    profile, {} where there is none (CPU)."""
    ctx = run_context(target) if ctx is None else ctx
    plan = baseline_plan(context)
    graphdef, params = nnx.split((target, None))
    state = noisy_states(target, None, B, context, plan, sliding, ctx)()
    t, groups = loop_time(graphdef, params, decode_step(plan), state, iters, profile=kernels is not None,
                          memory=memory, ctx=ctx)
    if kernels is not None:
        kernels.update(groups)
    return t


def preset_config(name: str, layers: int | None = None) -> GptOssConfig:
    """GptOssConfig.preset(name), with `layers` layers where given: a smaller model of the preset's
    widths, its sliding and full layers in the preset's pattern (ValueError for an unknown preset)."""
    cfg = GptOssConfig.preset(name)
    return cfg if layers is None else cfg.replace(num_hidden_layers=layers, layer_types=())


def target_flags(default: str = "gpt-oss-120b") -> None:
    """Defines --preset and --layers, the target a benchmark builds (`target_config`), both checked when
    flags are parsed; idempotent."""
    if "preset" in flags.FLAGS:
        return
    flags.DEFINE_string("preset", default, "target GptOssConfig preset")
    flags.DEFINE_integer("layers", None, "target layers (default: the preset's): fewer make a smaller model of the "
                         "preset's widths, its sliding and full layers in the preset's pattern (e.g. a quick CPU run)",
                         lower_bound=1)
    cli.check_with(["preset", "layers"], lambda v: preset_config(v["preset"], v["layers"]))


def target_config() -> GptOssConfig:
    """The target of --preset and --layers (`target_flags`)."""
    return preset_config(flags.FLAGS.preset, flags.FLAGS.layers)


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
