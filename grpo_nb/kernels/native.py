"""Small C / C++ libraries compiled on the user's machine into grpo-nb's cache folder, loaded with ctypes.

Three live here: the CPU decode step's attention (`cpu_attention.c`) and few-row bf16 products (`cpu_linear.c`),
and the memory simulation's counting allocator (`simulate/counting_allocator.cpp`). Each is compiled once per
source, compiler and whatever else its code depends on (`tag`: the CPU's flags for `-march=native`, torch's version
for torch's headers), under a name that carries a hash of them, beside a digest of the library its build wrote:
a library cut short or replaced would crash the process that loads it, so one whose digest differs is built again,
and one the loader refuses all the same is deleted and built again (`load`). A compiler still busy after
`BUILD_SECONDS` is stopped with its whole process group.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

BUILD_SECONDS = 60  # a compiler still busy after this is stopped (each build takes a second or a few)


def cpu_tag() -> str:
    """What `-march=native` compiles for: the CPU's model and flags (a cache folder may be shared by machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(sorted({line for line in f if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        info = platform.processor()
    return f"{platform.machine()}|{info}"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compiler(variable: str, names: tuple[str, ...]) -> list[str]:
    """The compiler command: $`variable` (split as a shell would: `CC="ccache gcc"`), else the first of `names` on
    the PATH; raises where there is none."""
    command = shlex.split(os.environ.get(variable, ""))
    if not command:
        found = next((shutil.which(name) for name in names if shutil.which(name)), None)
        if found is None:
            raise RuntimeError(f"no {' / '.join(names)} on the PATH (or ${variable})")
        command = [found]
    return command


def _run(command: list, timeout: float) -> tuple[int, str]:
    """Run the compiler in its own process group, which is stopped whole if it outlives `timeout`."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise RuntimeError(f"{command[0]} was still compiling after {timeout:.0f} s (stopped)") from None
    return process.returncode, output


def build(source: Path, folder: Path, command: list[str], variants: list[list[str]], after: list[str] = (),
          tag: str = "", headers: tuple[Path, ...] = ()) -> Path:
    """The path of `source` compiled into a shared library in `folder` - `command`, then the first of `variants`
    (argument lists: a compiler without -march=native may still build it without) that builds, the source,
    `-o` the library, `after` (libraries to link) - unless a library with the digest its build recorded is there.
    `headers`: the files it includes, part of what names the library. Raises with the compiler's last words where
    no variant builds."""
    stem = source.name.rsplit(".", 1)[0]
    text = b"".join(path.read_bytes() for path in (source, *headers))
    how = repr((command, variants, list(after), tag)).encode()  # a changed flag builds a new library
    key = hashlib.sha256(text + how).hexdigest()[:16]
    path, recorded = folder / f"{stem}-{key}.so", folder / f"{stem}-{key}.sha256"
    try:
        if path.is_file() and recorded.read_text().strip() == digest(path):
            return path
    except OSError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / path.name
        errors = ""
        for flags in variants:
            code, output = _run([*command, *flags, str(source), "-o", str(out), *after], BUILD_SECONDS)
            if code == 0 and out.is_file():
                break
            errors = output.strip()[-300:] or (f"exit status {code}" if code else "it wrote no library")
        else:
            raise RuntimeError(f"{os.path.basename(command[0])} could not build {source.name}: {errors}")
        written = Path(tmp) / recorded.name
        written.write_text(digest(out))
        out.replace(path)  # atomic: a concurrent build never loads half a library
        written.replace(recorded)  # after the library: a digest always describes a whole file
    return path


def load(source: Path, folder: Path, command: list[str], variants: list[list[str]], after: list[str] = (),
         tag: str = "", headers: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """`build`'s library, loaded. A library the loader refuses (a cache folder copied from elsewhere, a file
    replaced with its digest) is deleted and built once more."""
    path = build(source, folder, command, variants, after, tag, headers)
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        for stale in (path.with_suffix(".sha256"), path):  # the digest first: a whole library always has one
            stale.unlink(missing_ok=True)
        return ctypes.CDLL(str(build(source, folder, command, variants, after, tag, headers)))
