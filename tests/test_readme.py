"""README.md's Python blocks run as written: every block fenced ```python (not ```python no-run or
any other info string), in order, in one namespace, like the cells of a notebook, from an empty
working directory. On CPU (the suite's default) the embedded pair runs in float32, where the
README's claim that greedy `decode` equals `generate` holds token for token; it is checked too.

A failing block fails the test with its number, its line in README.md and its first line; the
traceback's README.md lines are the README's own (each block is compiled at its line offset).
"""

import os
import re
import traceback

import jax
import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
# a fence at the start of a line, its info string, the body, the closing fence
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, int, str]]:
    """(block number from 1, README line of the block's first code line, code) of each block
    whose info string is exactly `python`."""
    out = []
    for m in FENCE.finditer(text):
        if m.group(1).strip() == "python":
            line = text.count("\n", 0, m.start(2)) + 1
            out.append((len(out) + 1, line, m.group(2)))
    return out


def test_python_blocks_are_found():
    with open(README) as f:
        blocks = python_blocks(f.read())
    assert len(blocks) >= 5, f"only {len(blocks)} ```python blocks in {README}"
    # the no-run ones stay out
    assert not any("/path/to/" in code for _, _, code in blocks), "a block that names /path/to/ is not fenced no-run"


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path, monkeypatch):
    with open(README) as f:
        blocks = python_blocks(f.read())
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__readme__"}
    for n, line, code in blocks:
        first = code.strip().splitlines()[0] if code.strip() else ""
        error = None
        try:
            exec(compile("\n" * (line - 1) + code, README, "exec"), ns)
        except Exception:
            error = traceback.format_exc()
        if error is not None:  # failed outside the except clause: no "during handling" chain in the report
            pytest.fail(f"README.md python block {n} (line {line}: {first!r}) failed:\n{error}", pytrace=False)
    if jax.default_backend() == "cpu":  # float32: the blocks print this; hold them to it
        assert ns["out"].tokens == ns["base"].tokens == ns["tree"].tokens
        assert ns["out"].metrics["mean_accept_length"] > 1.5, ns["out"].metrics
