"""Writing files beside their target and renaming them into place, never through a link.

Everything grpo-nb saves (checkpoints, the adapter, a merged model, a GGUF file, tracker files) is
written into a fresh private folder beside its target: `tempfile.mkdtemp` makes it with a new
name, mode 0700, and fails rather than reuse anything already there, so no link can be waiting at
any name inside it, whatever the library writing into it opens. The files are flushed to disk
(fsync), then renamed into place. A rename replaces whatever is at the target - a link included -
instead of writing through it, so a link planted at a name grpo-nb writes (to a file elsewhere, to
a folder, dangling) is replaced and its target never changed. A failure removes only the private
folder; a process killed meanwhile leaves it hidden, and the next write beside it removes it.

    write_file(path, write)      write(tmp) makes one file; renamed to `path`
    write_folder(path, write)    write(tmp) fills a folder; renamed to `path`, replacing one there whole
    write_into(folder, write)    write(tmp) fills a folder; each file renamed into `folder`
    remove_folder(path)          one rename away, then deleted: never half a folder, never through a link
    open_to_append(path)         append to the file named, refusing a link there
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

# `.<target name>.tmp-<pid>-<random>`: a private folder of process <pid> (also `.old-` and without the
# random part: the names earlier versions used).
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)(?:-[a-z0-9_]+)?$")


def expand(path) -> Path:
    """A user's path as a shell reads it: '~/out' is in the home folder."""
    return Path(os.fspath(path)).expanduser()


def write_file(path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` writes a file at a private path; it becomes `path` in one rename (an old file there is
    replaced only by a complete one; a link there is replaced, not followed)."""
    path = expand(path)
    with _staging(path.parent, path.name) as stage:
        tmp = stage / path.name
        write(tmp)
        _sync(tmp)
        os.replace(tmp, path)
    _sync_folder(path.parent)
    return path


def write_folder(path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a private folder; it becomes `path` in one rename, so a folder at `path` is always
    complete: the old one (replaced whole) or the new one."""
    path = expand(path)
    with _staging(path.parent, path.name) as stage:
        new = stage / "new"
        new.mkdir()  # inside the private folder, with the usual permissions
        write(new)
        _sync_tree(new)
        _put(new, path, stage / "old")
    _sync_folder(path.parent)
    return path


def write_into(folder, write: Callable[[Path], None], *, last: str = ".safetensors") -> Path:
    """`write(tmp)` fills a private folder inside `folder`; each file it wrote is then renamed into `folder`
    (replacing the one of that name), those ending in `last` after the others: a process killed meanwhile
    leaves every file whole, the old one or the new one."""
    folder = expand(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _staging(folder, "saving") as stage:
        new = stage / "new"
        new.mkdir()
        write(new)
        _sync_tree(new)
        for entry in sorted(new.iterdir(), key=lambda e: e.name.endswith(last)):
            _put(entry, folder / entry.name, stage / f"old-{entry.name}")
    _sync_folder(folder)
    return folder


def remove_folder(path) -> None:
    """Delete the folder `path` by one rename into a private folder beside it, then remove that: a process
    killed meanwhile leaves the folder whole or gone, never half deleted. A link at `path` is refused
    (NotADirectoryError), so what it points to is never touched."""
    path = expand(path)
    if path.is_symlink() or not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder (a link is never deleted through)")
    with _staging(path.parent, path.name) as stage:
        os.replace(path, stage / path.name)


def open_to_append(path):
    """`path` opened to append text (created if missing). A link at `path` is refused (OSError ELOOP), not
    followed: the file appended to is the one named."""
    fd = os.open(expand(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    return os.fdopen(fd, "a", encoding="utf-8")


def open_to_read(path):
    """`path` opened to read bytes, refusing a link at `path` (OSError ELOOP)."""
    return os.fdopen(os.open(expand(path), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def remove_leftovers(folder, name: str | None = None) -> None:
    """The private folders that processes killed mid-write left in `folder` (those for target `name`, or
    all). Only real folders are removed, never a link, and never one of a process still running."""
    try:
        entries = list(os.scandir(folder))
    except OSError:  # not there (yet), or unreadable: nothing of ours to remove
        return
    for entry in entries:
        m = _STAGING.match(entry.name)
        if (m and (name is None or m["name"] == name) and entry.is_dir(follow_symlinks=False)
                and int(m["pid"]) != os.getpid() and not running(int(m["pid"]))):
            shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def _staging(beside: Path, name: str):
    """A fresh private folder in `beside` (the same disk, so renames out of it are atomic), removed at
    the end with whatever it still holds."""
    beside.mkdir(parents=True, exist_ok=True)
    remove_leftovers(beside, name)
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=beside))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _put(src: Path, dst: Path, aside: Path) -> None:
    """Rename `src` to `dst`. A file or a link at `dst` is replaced (a link is never followed); a folder
    there is first moved `aside`, as a folder cannot be renamed over a non-empty one, and moved back if
    the rename fails."""
    if src.is_dir() and dst.is_symlink():
        dst.unlink()  # the link only, not what it points to
    elif src.is_dir() and dst.is_dir():
        os.replace(dst, aside)
        try:
            os.replace(src, dst)
        except BaseException:
            os.replace(aside, dst)
            raise
        return
    os.replace(src, dst)


def _sync(path: Path) -> None:
    """Flush a file's data to disk before it is renamed into place, so that a crash (a power cut) after
    the rename cannot leave an empty file under the new name; for a folder, its entries (the rename itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # where the system can open a folder to sync it
        _sync(folder)


def _sync_tree(folder: Path) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            if not os.path.islink(os.path.join(root, name)):
                _sync(Path(root, name))


def running(pid: int) -> bool:
    """Whether process `pid` is alive on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, running
        return True
    return True
