"""The command-line shell of every script in experiments/: `run(main)` instead of `absl.app.run(main)`.

- Bad input ends in one line, `error: <message>`, on stderr and exit status 1 (`run`'s
  `error_exitcode`): the library raises ValueError (`eagle3_jax.checks.ArgumentError` included)
  naming the problem, and a missing or unreadable file raises FileNotFoundError / PermissionError /
  IsADirectoryError / NotADirectoryError. `--traceback` shows the whole traceback instead. Genuine
  bugs (AssertionError, a TypeError that is not an ArgumentError, ...) and Ctrl-C keep theirs;
  absl's own flag errors (validators, UsageError) print as absl prints them.
- JAX's INFO line "Unable to initialize backend 'tpu'", logged while it probes for backends on a
  machine without a TPU, is filtered out (that record only: any other backend's failure, and
  every warning, still shows; JAX_PLATFORMS is left alone, so CUDA is picked where present).
- `progress_flag()` defines `--progress/--noprogress`; `bar(iterable, desc)` is a tqdm bar on
  stderr (tqdm.auto: a widget in notebooks) that the flag switches off; `write(msg)` prints a line
  above a running bar without breaking it.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags

FLAGS = flags.FLAGS

# Bad input, as opposed to a bug: what `run` turns into one line.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class _NoTpuProbe(logging.Filter):
    """Drops the INFO record `jax._src.xla_bridge` logs when its TPU probe finds no libtpu."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and
                    record.getMessage().startswith("Unable to initialize backend 'tpu'"))


_TPU_FILTER = _NoTpuProbe()
logging.getLogger("jax._src.xla_bridge").addFilter(_TPU_FILTER)  # at import: before any backend starts

if "traceback" not in FLAGS:
    flags.DEFINE_bool("traceback", False, "on bad input (ValueError, a missing file), print the whole "
                      "traceback instead of one 'error: ...' line")


def error_message(e: BaseException) -> str:
    """One line for a user error: OSErrors as 'file: reason', others as their message."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    msg = str(e).strip() or type(e).__name__
    return " ".join(msg.splitlines())


def guard(main, error_exitcode: int = 1):
    """main, with bad input (USER_ERRORS) printed as one line `error: <message>` on stderr and
    `sys.exit(error_exitcode)`; anything else raised goes on as it is."""

    def guarded(argv):
        try:
            return main(argv)
        except USER_ERRORS as e:
            if FLAGS["traceback"].value:
                raise
            sys.stdout.flush()
            print(f"error: {error_message(e)}", file=sys.stderr, flush=True)
            sys.exit(error_exitcode)

    return guarded


def run(main, *, error_exitcode: int = 1, argv=None) -> None:
    """`absl.app.run(main)`, bad input raised by main ending in one line (`guard`)."""
    app.run(guard(main, error_exitcode), argv=argv)


# -- progress --------------------------------------------------------------------------------------

def progress_flag() -> None:
    """Defines --progress (default on; --noprogress switches the bars off). Idempotent: scripts that
    tests import side by side may each call it."""
    if "progress" not in FLAGS:
        flags.DEFINE_bool("progress", True, "progress bars on stderr while long work runs (--noprogress: off)")


def progress_on() -> bool:
    return bool(FLAGS["progress"].value) if "progress" in FLAGS else True


def load_progress() -> bool | None:
    """The loaders' `progress` under the flag: None (a bar for checkpoints worth waiting for) or False."""
    return None if progress_on() else False


def bar(iterable=None, desc: str | None = None, total: int | None = None, **kw):
    """A tqdm.auto bar over `iterable` (on stderr), off under --noprogress."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=not progress_on(), dynamic_ncols=True, **kw)


def write(msg: str) -> None:
    """print(msg) to stdout, above any running bar."""
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


# -- devices ---------------------------------------------------------------------------------------

def check_with(name: str | list[str], parse) -> None:
    """Validator: flag `name` is good where parse(value) raises no ValueError; its message becomes the
    flag's parse error (the script stops when flags are parsed). With a list of names, parse gets a
    dict of their values."""
    def check(value):
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from e
        return True

    if isinstance(name, str):
        flags.register_validator(name, check)
    else:
        flags.register_multi_flags_validator(name, check)


def positive_ints(*names, empty: bool = False, least: int = 1) -> None:
    """Validators: each of these list flags holds integers >= `least` (default: positive), at least
    one unless `empty` (where an empty list means "none"); a bad one stops the script when flags are
    parsed."""
    what = "positive integers" if least == 1 else f"integers >= {least}"
    for name in names:
        flags.register_validator(
            name, lambda xs: (empty or len(xs) > 0) and all(x.isdigit() and int(x) >= least for x in xs),
            f"expected {'' if empty else 'a non-empty list of '}{what}")


def message_flags() -> None:
    """Defines --tp, --rows and --hidden, the all-reduce benchmarks' message sizes (bench_allreduce.py,
    bench_reduce_norm.py): devices of the reduction, [rows, hidden] messages."""
    flags.DEFINE_list("tp", ["2", "4"], "devices of the reduction (the first n; more than there are: skipped)")
    flags.DEFINE_list("rows", ["1", "4", "16", "64"], "message rows (decode: B, verify: B x draft tokens)")
    flags.DEFINE_integer("hidden", 2880, "message width (gpt-oss: 2880)", lower_bound=1)
    positive_ints("tp", "rows")


def mesh_flags() -> None:
    """Defines --mesh, --experts and the jax.distributed flags (idempotent)."""
    if "mesh" in FLAGS:
        return
    flags.DEFINE_string("mesh", None, "devices as model=M,data=D: a (data, model) mesh (eagle3_jax.parallel) over "
                        "the first M*D devices of one process, or every device of every process "
                        "(--coordinator_address); default: one device")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0: run as one of --num_processes "
                        "processes through jax.distributed.initialize (e.g. one a host, or one a GPU)")
    flags.DEFINE_integer("num_processes", None, "processes of the run (with --coordinator_address)", lower_bound=1)
    flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)", lower_bound=0)
    flags.DEFINE_enum("experts", "tensor", ["tensor", "expert"], "with --mesh: how it splits the target's experts "
                      "over 'model' (parallel.split_experts): every expert's units, or whole experts a device")


def parse_mesh(text: str) -> dict:
    """'model=2,data=1' -> {"model": 2, "data": 1} (either may be left out: 1)."""
    sizes = {}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        if key not in ("model", "data") or not eq or not value.strip().isdigit() or int(value) < 1 or key in sizes:
            raise ValueError(f"--mesh: {text!r}, expected model=M,data=D with integers >= 1 (each at most once)")
        sizes[key] = int(value)
    return sizes


def setup_devices():
    """jax.distributed.initialize where --coordinator_address is given, then the mesh --mesh names
    (None without --mesh; --experts given without it: ValueError): in one process over
    its first M*D devices (model=2 on a host of 4 GPUs: GPUs 0 and 1), over several processes over
    all of theirs."""
    import jax

    if FLAGS.coordinator_address:
        if FLAGS.num_processes is None or FLAGS.process_id is None:
            raise ValueError("--coordinator_address needs --num_processes and --process_id")
        jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    if not FLAGS.mesh:
        if FLAGS["experts"].present:
            raise ValueError(f"--experts {FLAGS.experts}: splits the experts over a mesh; pass --mesh")
        return None
    from eagle3_jax import parallel

    sizes = parse_mesh(FLAGS.mesh)
    n = sizes.get("model", 1) * sizes.get("data", 1)
    devices = jax.devices()[:n] if jax.process_count() == 1 and n <= jax.device_count() else None
    return parallel.make_mesh(**sizes, devices=devices)
