"""The command-line shell of experiments/ (experiments/lib/cli.py) and the loaders' progress bars.

The script runs here fail before anything is compiled: a few seconds each on 2 CPU cores."""

import logging
import os
import re
import sys

import experiment_runner
import jax.numpy as jnp
import pytest

from eagle3_jax import assets
from eagle3_jax.checks import ArgumentError
from eagle3_jax.convert import load_eagle3, load_gpt_oss
from eagle3_jax.convert import safetensors_io as stio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from lib import cli  # noqa: E402


def script(name, *args, jax_platforms="cpu", cwd=None):
    """`python experiments/<name> args` (tests/experiment_runner.py: a fork of its server on CPU, a process
    of its own where JAX's variables differ, e.g. JAX_PLATFORMS unset: jax_platforms None)."""
    env = {k: v for k, v in {**os.environ, **experiment_runner.CPU_ENV}.items() if k != "JAX_PLATFORMS"}
    if jax_platforms is not None:
        env["JAX_PLATFORMS"] = jax_platforms
    return experiment_runner.execute(os.path.join(ROOT, "experiments", name), *args, timeout=120, env=env, cwd=cwd)


def test_nonexistent_target_is_one_line_without_the_tpu_probe(tmp_path):
    # JAX_PLATFORMS unset, as a user runs it: JAX probes every backend (the TPU one logs its failure at
    # INFO, which absl shows); run from another folder: the script still finds experiments/lib
    r = script("decode.py", "--target", "/nonexistent", jax_platforms=None, cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr == ("error: /nonexistent: checkpoint folder not found (expected a folder with config.json "
                        "and *.safetensors files)\n"), r.stderr


def test_library_rejection_of_a_flag_value_is_one_line():
    # decode() refuses it (loads the pair first); a value outside a flag's own bound stops at parse
    r = script("decode.py", "--num_draft_tokens", "50")
    want = "error: num_draft_tokens: 50 outside [2, 4] for depth 3, branching 1\n"
    assert (r.returncode, r.stderr) == (1, want), r.stderr
    r = script("eval_pair.py", "--prompts_file", "/nonexistent/p.json", "--shapes", "chain1")
    assert (r.returncode, r.stderr) == (1, "error: /nonexistent/p.json: No such file or directory\n"), r.stderr


def test_guard_turns_bad_input_into_one_line_and_lets_bugs_through(capsys):
    def raising(e):
        def main(argv):
            raise e
        return main

    for e, msg in ((ValueError("x: must be >= 1\n  got 0"), "x: must be >= 1   got 0"),
                   (ArgumentError("n: expected an integer, got 1.5"), "n: expected an integer, got 1.5"),
                   (FileNotFoundError(2, "No such file or directory", "/a/b.json"), "/a/b.json: No such file or "
                                                                                    "directory")):
        with pytest.raises(SystemExit) as ex:
            cli.guard(raising(e), error_exitcode=2)(["prog"])
        assert ex.value.code == 2 and capsys.readouterr().err == f"error: {msg}\n"
    for e in (TypeError("a bug"), AssertionError("a bug"), KeyError("a bug"), KeyboardInterrupt()):
        with pytest.raises(type(e)):
            cli.guard(raising(e))(["prog"])
    assert cli.guard(lambda argv: 7)(["prog"]) == 7


def test_tpu_probe_record_is_dropped_and_nothing_else():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("jax._src.xla_bridge")
    h, level = Keep(), log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        log.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
        log.info("Unable to initialize backend 'cuda': no GPU")
        log.warning("Unable to initialize backend 'tpu': as a warning it stays")
    finally:
        log.removeHandler(h)
        log.setLevel(level)
    assert seen == ["Unable to initialize backend 'cuda': no GPU", "Unable to initialize backend 'tpu': as a "
                    "warning it stays"]


def test_load_progress_shows_for_big_or_sharded_checkpoints(capsys):
    small = {"a": stio.TensorInfo("m.safetensors", "a", "F32", (4,), 0, 16)}
    assert isinstance(stio.load_progress(small, None, "x"), stio._NoBar)  # the embedded pair, test fixtures
    assert isinstance(stio.load_progress(small, False, "x"), stio._NoBar)
    big = {"a": stio.TensorInfo("m.safetensors", "a", "U8", (2 << 30,), 0, 2 << 30)}
    shards = {**small, "b": stio.TensorInfo("m2.safetensors", "b", "F32", (4,), 0, 16)}
    for tensors in (big, shards):
        with stio.load_progress(tensors, None, "x") as bar:
            assert not isinstance(bar, stio._NoBar) and bar.total == sum(t.nbytes for t in tensors.values())
    capsys.readouterr()
    # the embedded pair: quiet by default, a bar over its bytes when asked
    target = load_gpt_oss(assets.TARGET_DIR, jnp.float32)
    load_eagle3(assets.DRAFT_DIR, target=target)
    assert capsys.readouterr().err == ""
    load_eagle3(assets.DRAFT_DIR, target=target, progress=True)
    err = capsys.readouterr().err
    assert "loading draft" in err and "100%" in err


def test_an_unwritable_output_fails_before_the_run():
    # decode.py would load the pair and decode before writing: the check comes first, nothing else runs
    r = script("decode.py", "--json_out", "/proc/eagle3_jax/out.json")
    assert (r.returncode, r.stdout) == (1, ""), (r.stdout, r.stderr)
    assert r.stderr == ("error: --json_out /proc/eagle3_jax/out.json: cannot be written: no file can be made in "
                        "/proc (No such file or directory)\n"), r.stderr


def test_check_output(tmp_path):
    (tmp_path / "file").write_text("")
    for path, folder, msg in ((tmp_path / "file" / "x.json", False, f"{tmp_path / 'file'} is not a folder"),
                              (tmp_path, False, "is a folder, expected a file path"),
                              (tmp_path / "file", True, "is a file, expected a folder"),
                              ("/proc/x/ckpt", True, "no file can be made in /proc")):
        with pytest.raises(ValueError, match=f"^--out {re.escape(str(path))}: .*{re.escape(msg)}"):
            cli.check_output("out", str(path), folder)
    cli.check_output("out", str(tmp_path / "new" / "deeper" / "x.json"))  # folders made when written
    cli.check_output("out", str(tmp_path / "file"))  # an existing file is replaced
    cli.check_output("out_dir", str(tmp_path / "new"), folder=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the check creates nothing
