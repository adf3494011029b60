"""Step times of decode(depth="auto")'s options, measured through decode itself (cost_table.py, eval_auto.py).

One executable per (draft configuration, proposal mode, batch, prompt length): decode(depth="auto")
with a table that has one option only runs that option at every step (the table is an argument of
the program, so forcing each option in turn compiles nothing). Seconds a step of an option =
(run seconds of `tokens` new tokens - run seconds of `short` new tokens) / (their difference in
steps), each the median of `repeats` runs (run seconds: the executable's call, compile excluded),
`short` the fewest tokens whose cache and output buffers are those of `tokens` (the same executable:
checked), so prefill and the call's own cost cancel.
"""

from __future__ import annotations

import statistics

from eagle3_jax.spec import cost_table, decode
from eagle3_jax.spec.decode import plan_lengths
from eagle3_jax.spec.state import Plan

ATTEMPTS = 3  # measurements of an option before its figure is left out
MODES = {"greedy": dict(temperature=0.0, proposal="deterministic"),
         "deterministic": dict(temperature=1.0, proposal="deterministic"),
         "sample": dict(temperature=1.0, proposal="sample")}  # proposal modes: one executable each


def forced(name: str) -> dict:
    """A table with one option, `name`: decode(depth="auto") then runs it at every step."""
    return {"batches": [1], "contexts": [0], "seconds": {name: [[1.0]]}}


def options_of(kw: dict) -> list[str]:
    """The option names decode(depth="auto", **kw) chooses among (kw: num_spec_tokens, branching,
    num_draft_tokens)."""
    shape = (kw["num_spec_tokens"], kw.get("branching", 1), kw["num_draft_tokens"])
    return [cost_table.option_name(o) for o in cost_table.auto_options(*shape)]


def short_budget(target, prompts, tokens: int, kw: dict) -> int:
    """The fewest new tokens (>= 1) whose run shares the executable of a `tokens` run (the same cache
    and output lengths); ValueError if that leaves fewer than tokens // 2 tokens between them."""
    shape = (kw["num_spec_tokens"], kw.get("branching", 1), kw["num_draft_tokens"])
    slack = Plan(0, 0, 0, True, depth=shape[0], branching=shape[1], num_nodes=shape[2],
                 auto=cost_table.auto_options(*shape)).slack
    want = plan_lengths(target.config, prompts, tokens, None, None, slack)
    short = next(n for n in range(1, tokens + 1) if plan_lengths(target.config, prompts, n, None, None, slack) == want)
    if tokens - short < tokens // 2:
        raise ValueError(f"{tokens} new tokens sit near a cache bucket's edge (the shortest run sharing their "
                         f"program has {short}); choose another token count")
    return short


def run_seconds(target, draft, prompts, n: int, kw: dict, repeats: int):
    """(median run seconds, the first call's metrics) of `repeats` decode calls."""
    outs = [decode(target, draft, prompts, n, **kw).metrics for _ in range(repeats)]
    return statistics.median(m["seconds"] for m in outs), outs[0]


def option_seconds(target, draft, prompts, tokens: int, kw: dict, repeats: int, names=None, seed: int = 0,
                   short: int | None = None) -> dict:
    """{option name: {"seconds": a step (None where ATTEMPTS measurements gave none above 0), "steps":
    steps of the long run, "tau": its tokens a slot-step,
    "compile_seconds": of its first call (0 after the first option)}} for each option of
    decode(depth="auto", **kw) (or of `names`), each forced in turn; kw: decode's shape keywords,
    temperature, proposal, eos_ids, ... short: the short run's tokens (None: `short_budget`)."""
    short = short_budget(target, prompts, tokens, kw) if short is None else short
    out = {}
    for name in names or options_of(kw):
        call = dict(kw, depth="auto", cost_table=forced(name), seed=seed)
        first = decode(target, draft, prompts, tokens, **call).metrics  # compiles on the first option only
        for _ in range(ATTEMPTS):  # a busy machine can make the short run the slower: measure again
            long_s, long_m = run_seconds(target, draft, prompts, tokens, call, repeats)
            short_s, short_m = run_seconds(target, draft, prompts, short, call, repeats)
            if short_m["compile_seconds"] or long_m["compile_seconds"]:
                raise RuntimeError(f"the {short}-token run compiled a program of its own")
            more = long_m["steps"] - short_m["steps"]
            seconds = (long_s - short_s) / more if more > 0 else None
            if seconds is not None and seconds > 0:
                break
        else:
            seconds = None
        out[name] = dict(seconds=seconds, steps=long_m["steps"], tau=long_m["mean_accept_length"],
                         compile_seconds=first["compile_seconds"])
    return out
