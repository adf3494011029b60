"""The command-line shell of every script in experiments/: `run(main)` instead of `absl.app.run(main)`.

- Bad input ends in one line, `error: <message>`, on stderr and exit status 1 (`run`'s
  `error_exitcode`): the library raises ValueError (`eagle3_jax.checks.ArgumentError` included)
  naming the problem, and a missing or unreadable file raises FileNotFoundError / PermissionError /
  IsADirectoryError / NotADirectoryError. `--traceback` shows the whole traceback instead. Genuine
  bugs (AssertionError, a TypeError that is not an ArgumentError, ...) and Ctrl-C keep theirs;
  absl's own flag errors (validators, UsageError) print as absl prints them.
- Outputs are checked before main runs: a flag named in OUTPUT_FILES (--out, --json_out, --plot)
  or OUTPUT_FOLDERS (--out_dir, --ckpt_dir) whose path cannot be written (its folder neither exists
  nor can be made, or refuses a new file) ends the script at once, in one line (`check_outputs`),
  not after the work. Nothing is created by the check.
- Several processes (`setup_devices` with --coordinator_address): a process that never joins ends
  the others after --join_timeout seconds, one that dies (killed, out of memory, an error) ends the
  others after --heartbeat_timeout seconds, wherever they wait (a collective included): JAX's
  coordination service stops them with a message naming the dead process.
- JAX's INFO line "Unable to initialize backend 'tpu'", logged while it probes for backends on a
  machine without a TPU, is filtered out (that record only: any other backend's failure, and
  every warning, still shows; JAX_PLATFORMS is left alone, so CUDA is picked where present).
- `progress_flag()` defines `--progress/--noprogress`; `bar(iterable, desc)` is a tqdm bar on
  stderr (tqdm.auto: a widget in notebooks) that the flag switches off; `write(msg)` prints a line
  above a running bar without breaking it.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS

# Bad input, as opposed to a bug: what `run` turns into one line.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
OUTPUT_FILES = ("out", "json_out", "plot")  # flags that name a file a script writes
OUTPUT_FOLDERS = ("out_dir", "ckpt_dir")  # flags that name a folder a script writes into


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


def check_output(name: str, path: str, folder: bool = False) -> None:
    """Raises ValueError naming flag --`name` unless `path` can be written: a file path (a folder
    with `folder`) that is not a folder (not a file), whose folder exists or can be made, and where
    the nearest folder that exists takes a new file (tried: a temporary file made and removed)."""
    full = os.path.abspath(os.path.expanduser(path))
    if not folder and os.path.isdir(full):
        raise ValueError(f"--{name} {path}: is a folder, expected a file path")
    if folder and os.path.exists(full) and not os.path.isdir(full):
        raise ValueError(f"--{name} {path}: is a file, expected a folder")
    base = full if folder else os.path.dirname(full)
    while not os.path.lexists(base):
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        raise ValueError(f"--{name} {path}: cannot be written: {base} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".write_check_"):
            pass
    except OSError as e:
        raise ValueError(f"--{name} {path}: cannot be written: no file can be made in {base} "
                         f"({e.strerror or e})") from e
    if not folder and os.path.exists(full) and not os.access(full, os.W_OK):
        raise ValueError(f"--{name} {path}: cannot be written: the file is read-only")


def check_outputs() -> None:
    """`check_output` on each flag of OUTPUT_FILES and OUTPUT_FOLDERS that is defined and has a value."""
    for names, folder in ((OUTPUT_FILES, False), (OUTPUT_FOLDERS, True)):
        for name in names:
            if name in FLAGS and FLAGS[name].value:
                check_output(name, FLAGS[name].value, folder)


def guard(main, error_exitcode: int = 1):
    """main, with its outputs checked first (`check_outputs`) and bad input (USER_ERRORS) printed as
    one line `error: <message>` on stderr and `sys.exit(error_exitcode)`; anything else raised goes
    on as it is."""

    def guarded(argv):
        try:
            check_outputs()
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
    flags.DEFINE_integer("join_timeout", 120, "with --coordinator_address: seconds a process waits for all "
                         "--num_processes to join before it ends with an error", lower_bound=1)
    flags.DEFINE_integer("heartbeat_timeout", 60, "with --coordinator_address: seconds without a heartbeat after "
                         "which a process counts as dead and JAX's coordination service ends the others",
                         lower_bound=1)
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


def initialize_distributed(address: str, num_processes: int, process_id: int, join_timeout: int,
                           heartbeat_timeout: int) -> None:
    """jax.distributed.initialize with bounded waits. Not all processes joined after `join_timeout`
    seconds: this one prints `error: ...` (one line, naming the address and the count) and exits with
    status 1 (a watchdog thread: JAX's own timeout ends the process later, with a stack dump). After
    joining, a process whose heartbeat stops for `heartbeat_timeout` seconds (it died, or hangs
    without its runtime) is reported dead by JAX's coordination service, which ends every other
    process with a message naming it (a fatal log, status 134 from SIGABRT), wherever it waits: a
    collective that would wait for the dead process forever included."""
    import jax

    start = time.monotonic()

    def not_joined():
        sys.stdout.flush()
        print(f"error: jax.distributed: process {process_id} of {num_processes} waited "
              f"{time.monotonic() - start:.0f} s at {address} and not every process joined (--join_timeout "
              f"{join_timeout}); start all {num_processes} with the same --coordinator_address and "
              "--num_processes, each its own --process_id", file=sys.stderr, flush=True)
        os._exit(1)

    watchdog = threading.Timer(join_timeout, not_joined)
    watchdog.daemon = True
    watchdog.start()
    try:  # JAX's own limit a little later: the watchdog speaks first
        jax.distributed.initialize(address, num_processes, process_id, initialization_timeout=join_timeout + 30,
                                   heartbeat_timeout_seconds=heartbeat_timeout)
    finally:
        watchdog.cancel()


def setup_devices():
    """jax.distributed.initialize where --coordinator_address is given (`initialize_distributed`:
    --join_timeout, --heartbeat_timeout), then the mesh --mesh names (None without --mesh; --experts
    given without it: ValueError): in one process over its first M*D devices (model=2 on a host of
    4 GPUs: GPUs 0 and 1), over several processes over all of theirs."""
    import jax

    if FLAGS.coordinator_address:
        if FLAGS.num_processes is None or FLAGS.process_id is None:
            raise ValueError("--coordinator_address needs --num_processes and --process_id")
        if FLAGS.process_id >= FLAGS.num_processes:
            raise ValueError(f"--process_id {FLAGS.process_id}: expected an index in [0, --num_processes "
                             f"{FLAGS.num_processes})")
        initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, FLAGS.join_timeout,
                               FLAGS.heartbeat_timeout)
    if not FLAGS.mesh:
        if FLAGS["experts"].present:
            raise ValueError(f"--experts {FLAGS.experts}: splits the experts over a mesh; pass --mesh")
        return None
    from eagle3_jax import parallel

    sizes = parse_mesh(FLAGS.mesh)
    n = sizes.get("model", 1) * sizes.get("data", 1)
    devices = jax.devices()[:n] if jax.process_count() == 1 and n <= jax.device_count() else None
    return parallel.make_mesh(**sizes, devices=devices)
