"""Step-time tables for depth="auto" (spec/adaptive.py): data, one JSON file per device kind in
eagle3_jax/assets/cost_tables/ (h100, h200, cpu), measured by experiments/cost_table.py.

A file: {"format": 1, "device_kind": str, "tables": [table, ...]}. A table:
  "model": {"target": {GptOssConfig field: value}, "draft": {Eagle3Config field: value}, "dtype":
      name}: the pair it was measured with (it serves a pair with every value listed);
  "proposal" (optional): "deterministic" or "sample"; "greedy" (optional): true or false;
  "batches": [int, ...] and "contexts": [int, ...] (tokens: the rows' mean length), increasing, at
      most adaptive.CONTEXT_POINTS contexts;
  "seconds": {option name: [[seconds a step, or null] per context] per batch}, option names
      "chain{d}" (d drafts; chain0: the target alone) and "tree{depth}x{branching}n{nodes}";
  "source": where each figure came from (text, or a dict by option name); other keys are kept as notes.
`resolve` picks for a call the device kind's file (a device_kind naming H100 or H200, else the cpu
file on a CPU), then its first table whose model matches, preferring one measured with the call's
proposal, then its greedy flag. For each option each batch row is filled over the context points
(linear between its values, constant beyond), then taken to the call's batch: linear between rows,
beyond the largest row extended along the last two rows' slope (never decreasing), below the
smallest row that row's values. An option without values is unavailable (never chosen); a table
with none of the call's options available is a ValueError.
"""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import numpy as np

from eagle3_jax.spec.adaptive import CONTEXT_POINTS, Table

DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "cost_tables")
SUFFIX = ".json"
KINDS = ("h100", "h200")  # a device_kind naming one of these (any case) reads that file; a CPU reads "cpu"
TARGET_FIELDS = ("num_hidden_layers", "hidden_size", "num_local_experts", "num_experts_per_tok", "vocab_size",
                 "num_attention_heads", "num_key_value_heads", "head_dim")
DRAFT_FIELDS = ("hidden_size", "intermediate_size", "draft_vocab_size")
MEASURE = "python experiments/cost_table.py --out table" + SUFFIX


def option_name(option) -> str:
    """(depth, branching, num_nodes) -> "chain{depth}" (branching 1) or "tree{depth}x{branching}n{num_nodes}"."""
    d, k, n = option
    return f"chain{d}" if k == 1 else f"tree{d}x{k}n{n}"


def parse_option(name: str):
    """An option name -> (depth, branching, num_nodes); ValueError for anything else."""
    m = re.fullmatch(r"chain(0|[1-9]\d*)|tree([1-9]\d*)x([1-9]\d*)n([1-9]\d*)", name)
    if m is None:
        raise ValueError(f"option {name!r}: expected chain<d> or tree<depth>x<branching>n<nodes>")
    return (int(m[1]), 1, int(m[1]) + 1) if m[1] is not None else (int(m[2]), int(m[3]), int(m[4]))


def auto_options(depth: int, branching: int, num_nodes: int) -> tuple:
    """decode(depth="auto")'s options for the configured shape: chains of 0 .. depth drafts (a chain
    config: 0 .. num_nodes - 1 at most), then the configured tree where branching > 1."""
    if branching == 1:
        return tuple((d, 1, d + 1) for d in range(min(depth, num_nodes - 1) + 1))
    return tuple((d, 1, d + 1) for d in range(depth + 1)) + ((depth, branching, num_nodes),)


def model_fields(target_config, draft_config, dtype) -> dict:
    """The "model" entry of a table measured with this pair."""
    return dict(target={f: getattr(target_config, f) for f in TARGET_FIELDS},
                draft={f: getattr(draft_config, f) for f in DRAFT_FIELDS}, dtype=jnp.dtype(dtype).name)


def device_file(device) -> str | None:
    """The shipped file for a jax device (its device_kind, or the cpu platform); None: no such kind."""
    kind = next((k for k in KINDS if k in device.device_kind.lower()), None)
    kind = "cpu" if kind is None and device.platform == "cpu" else kind
    return None if kind is None else os.path.join(DIR, kind + SUFFIX)


def matches(model, target_config, draft_config, dtype) -> bool:
    """Whether a table's "model" entry (a dict; {} matches every pair) describes this pair: each value
    it lists equals the config field of that name, its dtype this dtype."""
    if not isinstance(model, dict) or set(model) - {"target", "draft", "dtype"}:
        return False
    missing = object()
    for part, config in (("target", target_config), ("draft", draft_config)):
        listed = model.get(part, {})
        if not isinstance(listed, dict) or any(getattr(config, k, missing) != v for k, v in listed.items()):
            return False
    return model.get("dtype", jnp.dtype(dtype).name) == jnp.dtype(dtype).name


def pick(data: dict, where: str, pair: tuple, proposal: str, greedy: bool) -> dict:
    """The table of `data` (a file's contents, or one table) for pair = (target config, draft config,
    dtype), this proposal and greedy flag (the module docstring); ValueError naming `where` if none fits."""
    if "tables" not in data:
        tables = [data]
    elif isinstance(data["tables"], list) and data["tables"]:
        tables = data["tables"]
    else:
        raise ValueError(f"{where}: 'tables' must be a non-empty list")
    for i, t in enumerate(tables):
        if not isinstance(t, dict):
            raise ValueError(f"{where}: tables[{i}] is not an object")
    fits = [t for t in tables if matches(t.get("model", {}), *pair)]
    if not fits:
        have = "; ".join(json.dumps(t.get("model")) for t in tables)
        raise ValueError(f"{where}: no table for this pair ({json.dumps(model_fields(*pair))}); it has {have}. "
                         f"Measure one: "
                         f"{MEASURE}, then decode(..., cost_table='table{SUFFIX}')")
    rank = lambda t: (t.get("proposal", proposal) != proposal, t.get("greedy", greedy) != greedy)  # noqa: E731
    return min(fits, key=rank)


def _increasing(where, name, xs, most=None):
    if not (isinstance(xs, list) and xs and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                 and np.isfinite(x) and x >= 0 for x in xs)):
        raise ValueError(f"{where}: {name!r} must be a non-empty list of numbers >= 0, got {xs!r}")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"{where}: {name!r} must increase, got {xs!r}")
    if most is not None and len(xs) > most:
        raise ValueError(f"{where}: {name!r} has {len(xs)} points, at most {most}")
    return np.asarray(xs, np.float64)


def _fill(xs, values):
    """values [len(xs)] with NaN where unknown -> filled: linear between known points, constant beyond;
    None where none is known."""
    known = ~np.isnan(values)
    if not known.any():
        return None
    return np.interp(xs, xs[known], values[known])


def at_batch(batches, rows, batch: int) -> np.ndarray:
    """rows [R, C] (per batch, per context; NaN rows dropped) -> [C] at `batch`: linear between rows,
    beyond the largest along the last two rows' slope (never decreasing), below the smallest that row."""
    keep = ~np.isnan(rows).any(1)
    bs, rows = batches[keep], rows[keep]
    if batch >= bs[-1]:
        if len(bs) == 1:
            return rows[-1]
        slope = np.maximum((rows[-1] - rows[-2]) / (bs[-1] - bs[-2]), 0.0)
        return rows[-1] + slope * (batch - bs[-1])
    return np.array([np.interp(batch, bs, rows[:, c]) for c in range(rows.shape[1])])


def for_call(table: dict, where: str, options, batch: int) -> Table:
    """The device Table of one call: each option's seconds at `batch` over the table's contexts (padded
    to CONTEXT_POINTS, the last value repeated), NaN-free; ValueError for a malformed table or one
    with none of the options."""
    batches = _increasing(where, "batches", table.get("batches"))
    contexts = _increasing(where, "contexts", table.get("contexts"), CONTEXT_POINTS)
    seconds = table.get("seconds")
    if not isinstance(seconds, dict):
        raise ValueError(f"{where}: 'seconds' must be an object of option names")
    for name, rows in seconds.items():
        parse_option(name)
        ok = isinstance(rows, list) and len(rows) == len(batches) and all(
            isinstance(r, list) and len(r) == len(contexts) and all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and v > 0)
                for v in r) for r in rows)
        if not ok:
            raise ValueError(f"{where}: seconds[{name!r}] must be {len(batches)} lists (one per batch) of "
                             f"{len(contexts)} numbers > 0 or null (one per context)")
    cost = np.ones((len(options), CONTEXT_POINTS), np.float32)
    available = np.zeros(len(options), bool)
    for o, option in enumerate(options):
        rows = seconds.get(option_name(option))
        if rows is None:
            continue
        filled = [_fill(contexts, np.array([np.nan if v is None else v for v in r], np.float64)) for r in rows]
        filled = np.array([np.full(len(contexts), np.nan) if f is None else f for f in filled])
        if np.isnan(filled).all():
            continue
        c = at_batch(batches, filled, batch)
        cost[o] = np.concatenate([c, np.full(CONTEXT_POINTS - len(c), c[-1])])
        available[o] = True
    if not available.any():
        raise ValueError(f"{where}: no figures for any of {[option_name(o) for o in options]} (it has "
                         f"{sorted(seconds)})")
    pad = contexts[-1] + 1 + np.arange(CONTEXT_POINTS - len(contexts))
    return Table(cost=cost, contexts=np.concatenate([contexts, pad]).astype(np.float32), available=available)


def resolve(source, device, target_config, draft_config, dtype, proposal: str, greedy: bool, options,
            batch: int) -> tuple[Table, str]:
    """decode's `cost_table` argument -> (the call's Table, where it came from). source: None (the
    device kind's shipped file), a path to a JSON file, or its contents as a dict (a file's, or one
    table's: a table without "model" is taken as it is). ValueError: no shipped file for the device,
    an unreadable file, no matching table, a malformed one."""
    if source is None:
        path = device_file(device)
        if path is None or not os.path.exists(path):
            raise ValueError(f"cost_table: none shipped for device kind {device.device_kind!r}; measure one: "
                             f"{MEASURE}, then decode(..., cost_table='table{SUFFIX}')")
        source = path
    if isinstance(source, (str, os.PathLike)):
        where = f"cost_table {os.fspath(source)!r}"
        try:
            with open(source) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: cannot read it ({e})") from e
    elif isinstance(source, dict):
        where, data = "cost_table", source
    else:
        raise ValueError(f"cost_table: expected None, a path or a dict, got {type(source).__name__}")
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    table = pick(data, where, (target_config, draft_config, dtype), proposal, greedy)
    return for_call(table, where, options, batch), where
