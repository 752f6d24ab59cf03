"""One run per output_dir: the lock file a run holds while it writes there (`output_dir_lock`), so that a second
run - another process, notebook or thread - is refused with a message naming the first, and the lock of a process
that died is taken over."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from . import atomic_files
from .checkpoint_schema import CheckpointError, Refused, check_lock
from .checkpointing import read_file

LOCK = ".grpo_nb.lock"

_HELD: set[str] = set()  # lock files this process holds


@contextlib.contextmanager
def output_dir_lock(output_dir, enabled: bool = True):
    """Hold `output_dir/.grpo_nb.lock` while a run writes there: a second run (another process, another
    notebook, another thread) is refused with a message naming the first. The lock of a process that
    died (killed, a crashed kernel) is taken over."""
    if not enabled:
        yield
        return
    path = Path(output_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    key = str(path.resolve())
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            owner = _lock_owner(path, output_dir)
            if owner is not None and not _stale(owner, key):
                raise RuntimeError(
                    f"output_dir={str(output_dir)!r} is in use by another training run: process {owner['pid']} on "
                    f"{owner['host']}, started {owner['started']}. Two runs writing one folder would mix "
                    f"their checkpoints. Wait for it to finish, stop it, or pass another output_dir. If that run is "
                    f"gone (e.g. on another machine sharing this disk), delete {path}.")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        break
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads(read_file(path, cap=2**16)[0])
            if isinstance(owner, dict) and owner.get("pid") == os.getpid():
                path.unlink()


def _lock_owner(path: Path, output_dir) -> dict | None:
    """The run holding the lock file `path`, as it wrote itself there (checked: checkpoint_schema.check_lock);
    None when the file is gone, or empty: its writer was killed between creating and writing it."""
    deadline = time.monotonic() + 2  # a clock skewed on a shared disk could make an mtime look young forever
    try:
        while True:
            try:
                text, info = read_file(path, cap=2**16)  # a lock is one line: a FIFO or /dev/zero is refused
            except FileNotFoundError:  # its run ended just now
                return None
            if text or time.time() - info.st_mtime >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # created a moment ago: its run is writing it now
        if not text:
            return None
        owner = json.loads(text)
        check_lock(owner)
    except (OSError, ValueError, RecursionError, Refused) as err:  # not a file, not JSON, or not a lock grpo-nb writes
        raise CheckpointError(
            f"output_dir={str(output_dir)!r}: damaged or foreign lock file {path} ({err}). A running grpo-nb "
            f"run keeps its process id there, so this one cannot tell whether another run uses the folder. If "
            f"none does, delete {path}, then run again.") from None
    return owner


def _stale(owner: dict, key: str) -> bool:
    """The lock's process (checked by _lock_owner) is gone: dead on this host, or this very process holding
    it no longer."""
    if owner["host"] != socket.gethostname():
        return False  # another machine's process cannot be checked: assume it runs
    if owner["pid"] == os.getpid():
        return key not in _HELD  # left behind by an earlier run in this process that could not clean up
    return not atomic_files.running(owner["pid"])
