"""The notebooks (notebooks/*.ipynb) run top to bottom in a Jupyter kernel, on CPU, with small parameters.

Each notebook asserts its own results (decode == generate, coverage growing with k, tau >= 1, the
saved draft reloading unchanged); nbclient raises CellExecutionError on any exception. The small
parameters are appended to the cell tagged `parameters` (what papermill would inject), and a last
cell, added here only, reports the kernel's Python and a few results as JSON.
"""

import json
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
CELL_TIMEOUT = 300  # seconds a cell may take (compiling dominates; a busy 2-core CPU is slow)


def run_notebook(name: str, overrides: str, report: str) -> tuple[dict, list]:
    """Executes notebooks/`name` with `overrides` appended to its parameters cell; returns the JSON
    printed by the `report` expression in an added last cell, and the executed cells."""
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{name}: expected one cell tagged 'parameters', found {len(params)}"
    params[0].source += "\n# overrides of tests/test_notebooks.py\n" + overrides
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import json as _json, sys as _sys\nprint(_json.dumps(dict(prefix=_sys.prefix, **({report}))))"))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT, startup_timeout=120,
                                     resources={"metadata": {"path": NOTEBOOKS}})
    client.execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    got = json.loads(text.strip().splitlines()[-1])
    assert os.path.realpath(got.pop("prefix")) == os.path.realpath(sys.prefix), "the kernel runs another Python"
    return got, nb.cells


def stdout_of(cells, cell_id: str) -> str:
    cell = next(c for c in cells if c.get("id") == cell_id)
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.fixture(autouse=True)
def kernel_env(monkeypatch):
    """The kernel inherits this environment: CPU, and matplotlib's inline backend (ipykernel's
    default when MPLBACKEND is unset), so the plots render to PNG outputs."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)


@pytest.mark.slow
def test_quickstart_notebook():
    got, cells = run_notebook("quickstart.ipynb", "MAX_NEW_TOKENS = 16",
                              "dict(n=[len(t) for t in base.tokens], same=chain.tokens == tree.tokens == base.tokens, "
                              "tau=[chain.metrics['mean_accept_length'], tree.metrics['mean_accept_length']])")
    assert got["n"] == [16, 16] and got["same"], got
    assert all(t >= 1.0 for t in got["tau"]), got
    assert "decode == generate, token for token" in stdout_of(cells, "decode")


@pytest.mark.slow
def test_fr_spec_notebook():
    got, cells = run_notebook(
        "fr_spec.ipynb", "KS = [64, 2048]\nNUM_PROMPTS = 2\nMAX_NEW_TOKENS = 16\nCORPUS_FILES = 20",
        "dict(rows=[{k: r[k] for k in ('k', 'corpus', 'coverage', 'tau')} for r in rows])")
    rows = got["rows"]
    assert sorted({r["k"] for r in rows}) == [64, 2048] and len(rows) == 4, rows
    for corpus in {r["corpus"] for r in rows}:
        small, full = sorted((r for r in rows if r["corpus"] == corpus), key=lambda r: r["k"])
        assert 0 < small["coverage"] < full["coverage"] <= 1, rows
        assert 1.0 <= small["tau"] and 1.0 <= full["tau"], rows
    plots = next(c for c in cells if c.get("id") == "plots")
    assert any("image/png" in o.get("data", {}) for o in plots.outputs), "the plot cell drew no figure"
    assert "round trip ok: k=64, d2t equal" in stdout_of(cells, "roundtrip")
