"""experiments/results/README.md is the index that experiments/results_index.py writes from the JSON
files beside it: the committed one is current, and the check names what is stale when it is not.
Plain Python: no JAX, well under a second."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "results_index.py")
RESULTS = os.path.join(ROOT, "experiments", "results")


def _module():
    spec = importlib.util.spec_from_file_location("results_index", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_index_is_current():
    message = _module().check(RESULTS)
    assert message is None, message


def test_check_names_stale_entries(tmp_path):
    mod = _module()
    results = tmp_path / "results"
    results.mkdir()
    names = sorted(n for n in os.listdir(RESULTS) if n.endswith(".json"))[:3]
    for n in names:
        shutil.copy(os.path.join(RESULTS, n), results / n)
    assert "is missing" in mod.check(str(results))
    assert mod.main(["--results_dir", str(results)]) == 0
    assert mod.check(str(results)) is None
    text = (results / "README.md").read_text()
    assert all(f"[{n}]({n})" in text for n in names)

    # a JSON added: its row is missing
    (results / "new_h200.json").write_text(json.dumps({
        "command": "python experiments/bench.py --scenarios single --out x.json", "device": "NVIDIA H200",
        "jax_version": "0.11.2", "date": "2026-12-01", "rows": [{"ms_per_token": 2.5}]}))
    message = mod.check(str(results))
    assert message is not None and "no row for new_h200.json" in message and "\n" not in message, message
    assert mod.main(["--results_dir", str(results), "--check"]) == 1
    assert mod.main(["--results_dir", str(results)]) == 0
    row = next(line for line in (results / "README.md").read_text().splitlines() if "new_h200.json" in line)
    assert "| bench.py | NVIDIA H200 | 2026-12-01 | 0.11.2 |" in row and "`rows[0].ms_per_token` = 2.5" in row, row

    # a JSON removed: its row is left over
    os.remove(results / names[0])
    message = mod.check(str(results))
    assert message is not None and f"no longer there: {names[0]}" in message, message

    # a JSON changed in place: its row is stale
    mod.main(["--results_dir", str(results)])
    (results / "new_h200.json").write_text(json.dumps({"device": "cpu"}))
    message = mod.check(str(results))
    assert message is not None and "stale rows: new_h200.json" in message, message
    row = next(line for line in mod.render(str(results)).splitlines() if "new_h200.json" in line)
    assert row == "| [new_h200.json](new_h200.json) | - | cpu | - | - | - | - |", row


def test_command_line_check(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "a_cpu.json").write_text(json.dumps({"command": "python eval_pair.py " + "--x 1 " * 40}))
    run = lambda *args: subprocess.run([sys.executable, SCRIPT, "--results_dir", str(results), *args],
                                       capture_output=True, text=True, timeout=60)
    r = run("--check")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "is missing" in r.stderr, r
    assert run().returncode == 0
    r = run("--check")
    assert r.returncode == 0 and not r.stderr, r
    text = (results / "README.md").read_text()
    assert "| eval_pair.py |" in text and "…`" in text  # the command truncated in the table
    assert max(len(line) for line in text.splitlines() if line.startswith("| [")) < 200
