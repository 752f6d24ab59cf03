"""Every storage a device allocates, counted by an allocator registered for that device.

`AllocationTracker` counts the meta device's storages (the simulation) or the CPU's (the
honesty check: the same step run for real). The counting is done by a small C++ allocator
(`counting_allocator.cpp`), compiled once per torch version into grpo-nb's cache folder and
registered with `c10::SetAllocator`: it sees what C++ kernels allocate inside themselves,
which no Python-level hook does, and it changes nothing about how ops run (a
`TorchDispatchMode` would: with a mode active, autograd takes its out-of-place branches).

While counting, each allocation and free goes to an event log; `report()` replays it into
the peak, the bytes live per phase, and the largest allocations live at the peak, named by
where in the code they were made (allocations of at least `label_bytes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("counting_allocator.cpp")
_DEVICES = {"meta": 0, "cpu": 1}
_LIBRARY = None
_LOCK = threading.Lock()


class _Event(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int64), ("bytes", ctypes.c_int64), ("label", ctypes.c_int32),
                ("phase", ctypes.c_int32), ("host", ctypes.c_int32), ("device", ctypes.c_int32)]


_LABELER_TYPE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64)


def _library():
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is None:
            from ..kernels import native
            from ..models import cache_dir

            try:
                command = native.compiler("CXX", ("g++", "c++", "clang++"))
            except RuntimeError:
                raise RuntimeError("grpo-nb's memory simulation compiles a small C++ allocator once, and no "
                                   "C++ compiler was found: install one (e.g. `apt-get install g++`) or set $CXX."
                                   ) from None
            root = Path(torch.__file__).parent
            abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
            flags = ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}"]
            try:
                lib = native.load(_SOURCE, cache_dir() / "simulate", command, [flags],
                                  [f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}"],
                                  torch.__version__ + sys.version)
            except RuntimeError as e:
                raise RuntimeError(f"compiling grpo-nb's counting allocator (the memory simulation's) failed: {e}"
                                   ) from None
            for name, res in (("grpo_nb_live", ctypes.c_int64), ("grpo_nb_peak", ctypes.c_int64),
                              ("grpo_nb_event_count", ctypes.c_int64)):
                getattr(lib, name).restype = res
            lib.grpo_nb_set_labeler.argtypes = [_LABELER_TYPE, ctypes.c_int64]
            lib.grpo_nb_copy_events.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
            _LIBRARY = lib
    return _LIBRARY


# Frames from these packages are where an allocation is attributed; torch's own frames are
# skipped (the interesting line is the model's or ours that called into torch).
_NAMED_PACKAGES = ("grpo_nb", "transformers", "peft", "trl", "bitsandbytes", "accelerate")


# the simulation's own plumbing (the op recorder's dispatch among it), never the answer
_MACHINERY = ("simulate/tracker.py", "simulate/device.py", "simulate/ops.py")


def _code_location(frame) -> str:
    """The innermost frame of a named package (else of any code outside torch) that led to this allocation."""
    outer = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.endswith(_MACHINERY):
            parts = Path(path).parts
            hit = next((i for i, p in enumerate(parts) if p in _NAMED_PACKAGES), None)
            if hit is not None:
                return f"{'/'.join(parts[hit:])}:{frame.f_lineno} ({frame.f_code.co_name})"
            if outer is None and "torch" not in parts:
                outer = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return outer or "?"


@dataclass
class Allocation:
    bytes: int
    phase: str
    where: str
    host: bool = False


@dataclass
class TrackerReport:
    """What one counting session saw. Bytes are storage bytes as the code asked for them."""

    peak: int                      # device bytes live at the worst moment
    peak_phase: str                # the phase that moment fell in
    host_peak: int                 # host (pinned) bytes at their worst moment
    phase_peaks: dict              # phase -> device bytes live at its worst moment
    phase_start: dict              # phase -> device bytes live when it began
    live_at_peak: list = field(default_factory=list)   # every device allocation live at the peak
    live_at_phase_peak: dict = field(default_factory=dict)  # phase -> allocations live at its own peak
    end: int = 0                   # device bytes still live when counting stopped
    events: int = 0

    def by_location(self, top: int = 12, phase: str | None = None) -> list[tuple[str, int, int]]:
        """(phase: location, bytes, count) of what was live at the peak (or at `phase`'s peak), largest first."""
        groups: dict = {}
        for a in (self.live_at_peak if phase is None else self.live_at_phase_peak.get(phase, [])):
            key = f"{a.phase}: {a.where}"
            b, n = groups.get(key, (0, 0))
            groups[key] = (b + a.bytes, n + 1)
        return sorted(((k, b, n) for k, (b, n) in groups.items()), key=lambda x: -x[1])[:top]


class AllocationTracker:
    """Count the storages `device` ("meta" or "cpu") allocates inside `with tracker:`.

        tracker = AllocationTracker("meta")
        with tracker:
            with tracker.phase("update"):
                ...
        report = tracker.report()

    Only one tracker counts at a time (one allocator per device per process). Storages that
    existed before counting started are not counted, nor is their release.
    """

    _active = None

    def __init__(self, device: str = "meta", *, label_bytes: int = 64 * 2**10):
        if device not in _DEVICES:
            raise ValueError(f"AllocationTracker counts the meta device or the CPU, not {device!r}")
        self.device = device
        self.label_bytes = int(label_bytes)
        self._lib = _library()
        self._phases: list[str] = ["setup"]
        self._labels: list[str] = []
        self._label_ids: dict[str, int] = {}
        self._callback = _LABELER_TYPE(self._label)
        self._events = None

    # -- counting --------------------------------------------------------------------------
    def __enter__(self):
        if AllocationTracker._active is not None:
            raise RuntimeError("another AllocationTracker is already counting")
        AllocationTracker._active = self
        self._lib.grpo_nb_install(_DEVICES[self.device])
        self._lib.grpo_nb_set_labeler(self._callback, self.label_bytes)
        self._lib.grpo_nb_start(_DEVICES[self.device])
        return self

    def __exit__(self, *exc):
        self._lib.grpo_nb_stop()
        self._lib.grpo_nb_set_labeler(_LABELER_TYPE(), 0)
        self._events = self._read_events()
        AllocationTracker._active = None
        return False

    def _label(self, nbytes: int) -> int:
        try:
            where = _code_location(sys._getframe(1))
            node = torch._C._current_autograd_node()
            if node is not None:
                where = f"backward of {node.name()} <- {where}"
        except Exception:  # a label must never break the step it describes
            where = "?"
        if where not in self._label_ids:
            self._label_ids[where] = len(self._labels)
            self._labels.append(where)
        return self._label_ids[where]

    @contextlib.contextmanager
    def phase(self, name: str):
        """Attribute what is allocated (and the peak) inside the block to `name`."""
        previous = self._current_phase
        self._phases.append(name)
        self._current_phase = len(self._phases) - 1
        self._lib.grpo_nb_set_phase(self._current_phase)
        try:
            yield
        finally:
            self._current_phase = previous
            self._lib.grpo_nb_set_phase(previous)

    _current_phase = 0

    def phase_name(self) -> str:
        """The phase allocations are attributed to now."""
        return self._phases[self._current_phase]

    @contextlib.contextmanager
    def host(self):
        """Count what is allocated inside the block as host memory (offloaded copies), not device memory."""
        self._lib.grpo_nb_set_host(1)
        try:
            yield
        finally:
            self._lib.grpo_nb_set_host(0)

    @contextlib.contextmanager
    def paused(self):
        """Nothing allocated inside the block is counted (nor its release)."""
        self._lib.grpo_nb_pause(1)
        try:
            yield
        finally:
            self._lib.grpo_nb_pause(-1)

    @contextlib.contextmanager
    def outputs_only_meta_kernels(self, scratch=None):
        """Count only the outputs of the meta kernels written in Python (and the working memory `scratch` names).

        PyTorch implements many meta kernels (all of `torch._meta_registrations`) as Python
        reference decompositions, which allocate temporaries a device kernel never makes: a bf16
        multiply by a Python float computes through fp32 copies of its inputs. Inside the block
        each of them runs with counting paused, and each output that is not an input's storage
        is replaced by a fresh tensor of the same layout, allocated while counting.

        A meta kernel's outputs depend only on its inputs' layouts and its other arguments, and
        a step repeats the same few hundred calls (every layer, every tile, every micro-batch):
        the layouts of a functional kernel's fresh outputs are remembered per call signature (for
        the process), so only the first call of each runs the Python decomposition.

        `scratch(op, args)`: the (shape, dtype) pairs of the buffers a device kernel allocates for itself
        beside its outputs and frees before it returns (FlashAttention's backward accumulators), or None.
        They are allocated after the outputs and freed at once: the peak sees them, nothing else does.
        """
        import torch._meta_registrations as registrations
        from torch._decomp import global_decomposition_table
        from torch.utils._pytree import tree_flatten, tree_map

        registered = registrations._meta_lib_dont_use_me_use_register_meta._op_impls
        table: dict = {}
        for kind in ("meta", "post_autograd", "pre_autograd"):  # torch's own precedence (activate_meta)
            for op, fn in global_decomposition_table[kind].items():
                table.setdefault(op, fn)
        tracker = self
        layouts = _KERNEL_LAYOUTS
        if len(layouts) > 100_000:
            layouts.clear()

        def outputs_only(op, fn):
            memoizable = not op._schema.is_mutable

            def kernel(*args, **kwargs):
                out = outputs(*args, **kwargs)
                if scratch is not None:  # allocated together beside the outputs, then freed
                    buffers = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in scratch(op, args) or ()]
                    buffers.clear()
                return out

            def outputs(*args, **kwargs):
                key = _signature((args, kwargs)) if memoizable else None
                if key is not None:
                    # a factory given no dtype makes the default one, which from_config sets to the model's dtype
                    # while it builds: an fp32 simulation's RMSNorm weights are not a later fp16 one's
                    key = (key, torch.get_default_dtype())
                    known = layouts.get((op, key))
                    if known is not None:
                        spec, leaves = known
                        return spec.unflatten([
                            torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device=leaf[4])
                            if type(leaf) is tuple and leaf and leaf[0] is _LAYOUT else leaf for leaf in leaves])
                with tracker.paused():
                    out = fn(*args, **kwargs)
                inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}
                leaves, spec = tree_flatten(out)
                aliased = any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in inputs for t in leaves)
                if key is not None and not aliased:
                    layouts[(op, key)] = (spec, [(_LAYOUT, tuple(t.shape), t.stride(), t.dtype, t.device)
                                                 if isinstance(t, torch.Tensor) else t for t in leaves])
                fresh = lambda t: t if not isinstance(t, torch.Tensor) or t.untyped_storage()._cdata in inputs \
                    else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)  # noqa: E731
                return tree_map(fresh, out)
            return kernel

        library = torch.library.Library("aten", "IMPL", "Meta")
        try:
            for op, fn in table.items():
                if isinstance(op, torch._ops.OpOverload) and f"{op.name().replace('::', '/')}/Meta" in registered:
                    library.impl(op, outputs_only(op, fn), "Meta")
            yield
        finally:
            library._destroy()  # torch's own Python meta kernels are back

    @property
    def live(self) -> int:
        return int(self._lib.grpo_nb_live(0))

    @property
    def peak(self) -> int:
        return int(self._lib.grpo_nb_peak(0))

    # -- the report ------------------------------------------------------------------------
    def _read_events(self):
        n = int(self._lib.grpo_nb_event_count())
        buf = (_Event * n)()
        if n:
            self._lib.grpo_nb_copy_events(ctypes.addressof(buf), 0, n)
        return buf

    def report(self) -> TrackerReport:
        """Replay the event log: the peak, per-phase peaks and what was live at each."""
        if self._events is None:
            raise RuntimeError("report() is available once the `with tracker:` block has ended")
        now = host_now = host_peak = 0
        peak, peak_at = 0, -1
        phase_peak: dict = {}   # phase index -> (bytes, event index)
        phase_start: dict = {}
        last_phase = None
        for i, e in enumerate(self._events):
            if e.phase != last_phase:
                phase_start.setdefault(e.phase, now)
                last_phase = e.phase
            if e.host:
                host_now += e.bytes
                host_peak = max(host_peak, host_now)
                continue
            now += e.bytes
            if now > phase_peak.get(e.phase, (-1, -1))[0]:
                phase_peak[e.phase] = (now, i)
            if now > peak:
                peak, peak_at = now, i
        name = lambda p: self._phases[p]  # noqa: E731
        peaks_by_name: dict = {}
        for p, (b, i) in phase_peak.items():
            if b > peaks_by_name.get(name(p), (-1, -1))[0]:
                peaks_by_name[name(p)] = (b, i)
        peak_phase = self._events[peak_at].phase if peak_at >= 0 else 0
        return TrackerReport(
            peak=peak, peak_phase=name(peak_phase), host_peak=host_peak,
            phase_peaks={k: b for k, (b, _) in peaks_by_name.items()},
            phase_start=_by_name(phase_start, name, min),
            live_at_peak=self._live_at(peak_at),
            live_at_phase_peak={k: self._live_at(i) for k, (_, i) in peaks_by_name.items()},
            end=now, events=len(self._events))

    def _live_at(self, index: int) -> list[Allocation]:
        """Device allocations live just after event `index`, largest first."""
        live = {}
        for i in range(index + 1):
            e = self._events[i]
            if e.host:
                continue
            if e.bytes > 0:
                live[e.id] = e
            else:
                live.pop(e.id, None)
        return [Allocation(e.bytes, self._phases[e.phase], self._labels[e.label] if e.label >= 0 else "(unnamed)")
                for e in sorted(live.values(), key=lambda e: -e.bytes)]


def _by_name(values: dict, name, pick) -> dict:
    out: dict = {}
    for p, b in values.items():
        out[name(p)] = pick(out[name(p)], b) if name(p) in out else b
    return out


_KERNEL_LAYOUTS: dict = {}  # (op, signature) -> (output tree spec, [layout or value per leaf]), for the process
_LAYOUT = object()  # marks a remembered output layout among a kernel's remembered outputs
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _signature(value):
    """A hashable description of a kernel call's arguments (tensor layouts, plain values), or None.

    None when an argument is of a kind whose effect on the outputs is not plainly its layout
    or value (a real tensor, symbolic sizes, opaque objects): such calls always run the kernel.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            return None  # a real tensor's values can decide the output's shape (a boolean index)
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device.type,
                value.requires_grad)
    if isinstance(value, _PLAIN):
        return (type(value), value)  # 1 and 1.0 and True differ for a kernel
    if isinstance(value, (tuple, list)):
        items = tuple(_signature(v) for v in value)
        return None if None in items else (type(value), items)
    if isinstance(value, dict):
        items = tuple((k, _signature(v)) for k, v in sorted(value.items()))
        return None if any(v is None for _, v in items) else ("D", items)
    return None

