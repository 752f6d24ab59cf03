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
    write_into(folder, write)    write(tmp) fills a folder; each file renamed into `folder` once all can be
    remove_folder(path)          one rename away, then deleted: never half a folder, never through a link
    open_to_append(path)         append to the file named, refusing a link there

A file replaced keeps its permission bits. The private folder's name is bounded in length whatever
the target's (a long target name is shortened and a hash of it added).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

# `.<target name>.tmp-<pid>-<random>`: a private folder of process <pid> (also `.old-` and without the
# random part: the names earlier versions used).
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)(?:-[a-z0-9_]+)?$")


def expand(path) -> Path:
    """A user's path as a shell reads it: '~/out' is in the home folder."""
    return Path(os.fspath(path)).expanduser()


def name_problem(path) -> str | None:
    """Why `path` can name no file (a NUL character, a lone surrogate: text no file name's bytes make),
    or None. Asked before anything else, as the system would refuse the path mid-run, in its own words."""
    text = os.fsdecode(os.fspath(path))
    if "\0" in text:
        return "it holds a NUL character ('\\x00'), which no file name can hold"
    try:
        os.fsencode(text)
    except UnicodeEncodeError as err:
        return (f"it holds {text[err.start]!r}, a lone surrogate, which no file name can hold (text decoded "
                f"with the wrong encoding?)")
    return None


def folder_problem(path) -> str | None:
    """Why no folder can be written at `path` because of what is there already (a file, a device, a link
    to nothing), or None. (A file above it, or a folder without write permission, shows when writing.)"""
    if (problem := name_problem(path)) is not None:
        return problem
    path = expand(path)
    if path.is_symlink() and not path.exists():
        return f"this is a link to {os.readlink(path)}, which does not exist (create that folder, or pick another)"
    if path.exists() and not path.is_dir():
        return "this is a file" if path.is_file() else "this is not a folder (a device, a pipe or a socket)"
    return None


def regular_file(path) -> bool:
    """`path` is itself a regular file: not a link, a folder, a pipe (which would hang a reader) or a device."""
    try:
        return stat.S_ISREG(os.lstat(expand(path)).st_mode)
    except (OSError, ValueError):
        return False


def write_file(path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` writes a file at a private path; it becomes `path` in one rename (an old file there is
    replaced only by a complete one; a link there is replaced, not followed)."""
    path = expand(path)
    with _staging(path.parent, path.name) as stage:
        tmp = stage / path.name
        write(tmp)
        _sync(tmp)
        _keep_mode(tmp, path)
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
        _check_takes(path, folder=True)
        _put(new, path, stage / "old")
    _sync_folder(path.parent)
    return path


def write_into(folder, write: Callable[[Path], None], *, last: str = ".safetensors", keep=()) -> Path:
    """`write(tmp)` fills a private folder inside `folder`; each file it wrote is then renamed into `folder`
    (replacing the one of that name), those ending in `last` after the others: a process killed meanwhile
    leaves every file whole, the old one or the new one. Nothing is renamed until every name is known to
    take what is written there (a folder planted at a file's name is refused): a failure leaves `folder` as
    it was. Files named in `keep` that `folder` already has stay as they are (a user's README.md: peft writes
    a fresh model card into the private folder, which would replace it); a link there is replaced as usual."""
    folder = expand(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _staging(folder, "saving") as stage:
        new = stage / "new"
        new.mkdir()
        write(new)
        for name in keep:
            if regular_file(folder / name) and os.path.lexists(new / name):
                (new / name).unlink()
        _sync_tree(new)
        entries = sorted(new.iterdir(), key=lambda e: e.name.endswith(last))
        for entry in entries:
            _check_takes(folder / entry.name, entry.is_dir())
        for entry in entries:
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
    followed: the file appended to is the one named. Nor is anything but a regular file appended to: opened
    without blocking (a FIFO with no reader would block the open forever), then refused (OSError) for a FIFO,
    a device or a socket put there."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(expand(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | nonblock,
                     0o666)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a FIFO with no reader
            raise OSError(errno.ENXIO, "a pipe (FIFO), not a regular file", str(path)) from err
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a pipe, a device or a socket)", str(path))
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


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
        if (m and (name is None or m["name"] == _short(name)) and entry.is_dir(follow_symlinks=False)
                and int(m["pid"]) != os.getpid() and not running(int(m["pid"]))):
            shutil.rmtree(entry.path, ignore_errors=True)


def _short(name: str) -> str:
    """`name` as it appears in its private folder's name: a long one (up to the system's 255 bytes) is cut,
    and a hash of it added, so that the private folder's name is never too long where the target's is not."""
    if len(os.fsencode(name)) <= 64:
        return name
    return f"{name[:24]}~{hashlib.sha256(os.fsencode(name)).hexdigest()[:16]}"


@contextlib.contextmanager
def _staging(beside: Path, name: str):
    """A fresh private folder in `beside` (the same disk, so renames out of it are atomic), removed at
    the end with whatever it still holds."""
    beside.mkdir(parents=True, exist_ok=True)
    remove_leftovers(beside, name)
    stage = Path(tempfile.mkdtemp(prefix=f".{_short(name)}.tmp-{os.getpid()}-", dir=beside))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _check_takes(dst: Path, folder: bool) -> None:
    """`dst` can be replaced by a file (`folder` False) or a folder: anything there but a real folder takes
    a file (a link is replaced, never followed), and a folder or a link takes a folder."""
    if dst.is_symlink() or not os.path.lexists(dst) or dst.is_dir() == folder:
        return
    what, kind = ("a file", "a folder") if folder else ("a folder", "a file")
    error = NotADirectoryError if folder else IsADirectoryError
    raise error(f"{dst} is {what}, where {kind} of that name is to be written: move it away (or delete it) and "
                f"save again. Nothing was written there.")


def _keep_mode(new: Path, old: Path) -> None:
    """A file replaced keeps its permission bits (a file made private stays private)."""
    try:
        st = os.lstat(old)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        os.chmod(new, stat.S_IMODE(st.st_mode))


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
    if not src.is_dir():
        _keep_mode(src, dst)
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
