"""Checkpoint folders written whole or not at all.

Every writer (`save_gpt_oss`, `save_eagle3`, `save_checkpoint`, the trainers' outputs) writes
through `staged(path, writer, overwrite)`: the files go into a fresh hidden folder beside `path`
(same parent, so renaming is atomic), `.<name>.eagle3_jax-partial-<random>`, are flushed to disk
(fsync), and the folder is then moved into place. An existing folder is swapped with the new one in
one step where the system allows it (Linux `renameat2` RENAME_EXCHANGE), else moved aside to
`.<name>.eagle3_jax-previous-<random>` just before the new one is renamed in, and deleted after.
A process killed at any moment leaves `path` holding the old checkpoint or the new one, never a
mix (with the fallback, possibly neither for the instant between the two renames, the old one then
in the `-previous-` folder, which the loaders' error names). Leftover hidden folders are never read
as checkpoints (`open_checkpoint` refuses their names); delete them at will.

A folder that is not empty is refused unless `overwrite=True` (ValueError naming the folder and
what it holds, the kind of checkpoint included). overwrite=True replaces all of its checkpoint
files (`is_checkpoint_entry`: config.json, every *.safetensors and its index, pytorch_model*.bin,
eagle3_jax.json and the orbax `state` folder), whatever kind they are of: no stale shard or index
survives. Other files (a README, tokenizer.json, train_log.json, ...) are kept, as transformers'
`save_pretrained` keeps them, unless the writer writes a file of the same name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import json
import os
import re
import secrets
import shutil

from eagle3_jax.checks import ArgumentError

PARTIAL, PREVIOUS = "eagle3_jax-partial", "eagle3_jax-previous"
TEMPORARY = re.compile(rf"^\..*\.(?:{PARTIAL}|{PREVIOUS})-[0-9a-f]+$")
CHECKPOINT_NAMES = ("config.json", "eagle3_jax.json", "state")
# weight files; each may have an index beside it, named after it with ".index" and ".json" added
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def is_checkpoint_entry(name: str) -> bool:
    """Whether a folder entry belongs to a checkpoint (what overwrite=True replaces): CHECKPOINT_NAMES,
    weight files (WEIGHT_PATTERNS) and their indexes."""
    stem, ext = os.path.splitext(name)
    if ext == ".json" and stem.endswith(".index"):
        name = stem[:-len(".index")]
    return name in CHECKPOINT_NAMES or any(fnmatch.fnmatchcase(name, p) for p in WEIGHT_PATTERNS)


def is_temporary(path: str | os.PathLike) -> bool:
    """Whether `path` names a writer's unfinished or replaced folder (never a checkpoint)."""
    return bool(TEMPORARY.match(os.path.basename(os.path.normpath(os.fspath(path)))))


def previous_versions(path: str | os.PathLike) -> list[str]:
    """The `-previous-` folders an interrupted replacement of `path` left beside it."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    return sorted(os.path.join(parent, e) for e in entries if e.startswith(f".{name}.{PREVIOUS}-"))


def checkpoint_kind(path: str | os.PathLike) -> str | None:
    """What checkpoint the folder holds, in words ("a GPT-OSS checkpoint", "an EAGLE-3 draft
    checkpoint", "an orbax checkpoint of a GPT-OSS", ...), None when it holds no checkpoint file."""
    path = os.fspath(path)
    entries = os.listdir(path)
    if "eagle3_jax.json" in entries or "state" in entries:
        try:
            with open(os.path.join(path, "eagle3_jax.json")) as f:
                kind = json.load(f).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        return {"gpt_oss": "an orbax checkpoint of a GPT-OSS"}.get(kind, "an orbax checkpoint")
    if "config.json" in entries:
        try:
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            return "a checkpoint with an unreadable config.json"
        if not isinstance(cfg, dict):
            return "a checkpoint with an unreadable config.json"
        arch = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
        if "eagle_config" in cfg or "draft_vocab_size" in cfg or any(
                "eagle" in str(a).lower() or "speculator" in str(a).lower() for a in arch):
            return "an EAGLE-3 draft checkpoint"
        if cfg.get("model_type") == "gpt_oss":
            return "a GPT-OSS checkpoint"
        return f"a checkpoint of model_type {cfg['model_type']!r}" if cfg.get("model_type") else "a checkpoint"
    if any(is_checkpoint_entry(e) for e in entries):
        return "checkpoint weights without a config.json"
    return None


def describe(path: str) -> str:
    """The folder's kind of checkpoint (if any) and its entries, for error messages."""
    entries = sorted(os.listdir(path))
    shards = [e for e in entries if e.endswith(".safetensors")]
    if len(shards) > 2:
        entries = [e for e in entries if e not in shards] + [f"{len(shards)} *.safetensors files"]
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    kind = checkpoint_kind(path)
    return f"{kind} ({shown})" if kind else shown


def check_target(path: str | os.PathLike, writer: str, overwrite: bool, flag: str = "overwrite=True") -> str:
    """The absolute real path a writer will fill, once checked; nothing is created. Raises
    ValueError (starting with `writer`) when `path` is a file, a mount point, a folder that is not
    empty while overwrite is False (naming what it holds, and `flag`, what to pass to replace it),
    or a place this process cannot write."""
    path = os.path.realpath(os.fspath(path))
    if not isinstance(overwrite, bool):
        raise ArgumentError(f"{writer}: overwrite: expected True or False, got {overwrite!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{writer}: {path} is a file, expected a folder to write the checkpoint into")
    if os.path.ismount(path):
        raise ValueError(f"{writer}: {path} is a mount point, which cannot be replaced by renaming (a checkpoint is "
                         "written beside its folder and renamed into place): write into a folder inside it")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ValueError(f"{writer}: {path} is not empty: it holds {describe(path)}; pass {flag} to replace its "
                         "checkpoint files (other files are kept)")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{writer}: cannot write {path}: {parent} is not a writable folder")
    return path


@contextlib.contextmanager
def staged(path: str | os.PathLike, writer: str, overwrite: bool = False, flag: str = "overwrite=True"):
    """Yields a new empty folder beside `path` to write a checkpoint into; when the block ends
    without an exception, moves it into place as the module docstring says (the other files of a
    replaced folder carried over), else deletes it and leaves `path` as it was. `check_target`
    runs first (same errors, before anything is created)."""
    path = check_target(path, writer, overwrite, flag)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = _new_folder(parent, f".{name}.{PARTIAL}-")
    try:
        if os.path.isdir(path):
            shutil.copymode(path, tmp)
        yield tmp
        if os.path.isdir(path):
            _carry_others(path, tmp)
        _sync_tree(tmp)
        _move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync(parent)


def _new_folder(parent: str, prefix: str) -> str:
    while True:
        tmp = os.path.join(parent, prefix + secrets.token_hex(6))
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def _carry_others(old: str, new: str) -> None:
    """Hard-links (copies where links are refused) the non-checkpoint entries of `old` into `new`,
    except names the writer wrote itself."""
    for e in os.listdir(old):
        src, dst = os.path.join(old, e), os.path.join(new, e)
        if is_checkpoint_entry(e) or os.path.lexists(dst):
            continue
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: str) -> None:
    """fsync every file and folder under `root` (the data on disk before the rename publishes it)."""
    for folder, _, files in os.walk(root):
        for f in files:
            if not os.path.islink(os.path.join(folder, f)):
                _sync(os.path.join(folder, f))
        _sync(folder)


def _move_into_place(tmp: str, path: str) -> None:
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now the old folder
    else:
        parent, name = os.path.split(path)
        aside = os.path.join(parent, f".{name}.{PREVIOUS}-{secrets.token_hex(6)}")
        os.rename(path, aside)
        os.rename(tmp, path)
        shutil.rmtree(aside)


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where the system or
    file system does not offer it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a, b)
