"""Every kernel a simulated step launches, with its work: what `time.py` prices on a card.

`OpRecorder` is a `TorchDispatchMode`: it sees each ATen op the step runs on the meta device, forward and
backward, after autograd has decided what to run. For each op that would launch a kernel it keeps the FLOPs
(torch's own formulas in `torch.utils.flop_counter` for matmuls and attention; one per output element for
the rest, which are memory-bound anyway), the bytes read and written (each operand once, broadcast
dimensions not counted, views free), the dtype, and where in the step it ran:

    stage    prefill | decode | reference log-probs | old log-probs | forward (the decoder) | log-probs (the head)
             | loss | backward | optimizer
    unit     which model call of the rollout it belongs to (a decode step is one unit: the model call and the
             sampling after it), so that a rollout simulated for a few tokens can be priced at its full length

A decode step on a growing (dynamic) KV cache is marked `eager` in the trace: no CUDA graph can replay it (the
graph's shapes would change every step), whatever the pricing assumes of the static cache's steps. A rollout that
decodes every token (an episode's dynamic cache) can be recorded at every `decode_every`-th step of each piece:
the steps between, not recorded, are the same kernels on a cache a few columns longer (`spread_decode_steps`).

A dispatch mode changes how autograd runs in-place ops, so the recorder runs in a pass of its own, never in the
pass that counts memory (`SimulatedStep.time` runs it). What the dispatcher never sees is reported by the code
that does it: kernels the meta device does not launch (the Triton log-prob kernels, `kernel()`), bitsandbytes'
dequantisation that the simulated device stands in for, and host<->device copies of offloaded activations
(`transfer()`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..rollout.lean_forward import observing
from ..rollout.static_cache import _StaticKV, in_graphed_step

_ACTIVE: list = []  # the OpRecorders entered, innermost last

# Ops that launch no kernel: metadata, allocation without initialisation, values the host reads.
_FREE = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "_local_scalar_dense", "sym_size",
         "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "lift_fresh", "_to_copy_meta", "set_",
         "resize_", "record_stream", "detach", "alias", "_unsafe_view", "view", "_reshape_alias", "_assert_async",
         "_assert_scalar", "_functional_assert_async", "copy_meta"}
# Ops that read only the rows they gather from their first operand (a table, a cache) ...
_GATHERS = {"embedding", "index_select", "gather", "index", "take"}
# ... and ops that write only the rows they are given into it, in place.
_SCATTERS = {"index_copy_", "index_put_", "index_add_", "scatter_", "scatter_add_", "index_fill_", "_index_put_impl_"}
# Code whose work is the log-prob computation (the memory report's "log-prob scratch" reads the same list)
LOGPROB_CODE = ("grpo_nb/logprobs.py", "grpo_nb/kernels/", "trl/kernels/", "trl/trainer/utils.py")


@dataclass(frozen=True)
class Op:
    """One kernel: its name, work and place in the step. `shape` is (M, N, K) for a matmul-like op."""

    name: str
    stage: str
    unit: int
    flops: int
    bytes: int
    dtype: torch.dtype
    kind: str = "other"      # matmul | attention | gemm_4bit | dequantize_4bit | kernel | transfer | other
    shape: tuple = ()
    in_model: bool = False   # launched inside a model call (what a CUDA graph of the decode step holds)
    graphed: bool = False    # in work a CUDA graph replays (a static decode step: its forward, its sampling)


@dataclass
class OpTrace:
    """What one step launched, in order; the rollout's model calls (unit -> (kind, rows, piece)); and how many
    decode steps of the whole rollout each recorded one stands for (unit -> count; 1 where not given)."""

    ops: list = field(default_factory=list)
    calls: dict = field(default_factory=dict)
    repeats: dict = field(default_factory=dict)
    eager: set = field(default_factory=set)  # decode units on a growing cache (no CUDA graph replays them)

    def decode_units(self) -> dict:
        """piece -> its decode steps' units, in order."""
        out: dict = {}
        for unit, (kind, rows, piece) in self.calls.items():
            if kind == "decode":
                out.setdefault(piece, []).append(unit)
        return out

    def repeat_first_decode_step(self, decode_steps: int) -> None:
        """Each piece decodes `decode_steps` steps of the same shapes (a static KV cache), of which a few were
        recorded: its first recorded step stands for the ones not recorded."""
        for piece, units in self.decode_units().items():
            self.repeats[units[0]] = max(1, decode_steps - len(units) + 1)

    def spread_decode_steps(self) -> None:
        """Each piece's recorded decode steps stand for all of its decode steps, in equal shares (a recorder with
        `decode_every` > 1 kept every so many of them; a step's cost grows linearly with the cache) - except its
        last, which the recorder always keeps, and which stands for itself: what ends the piece (its batch, an
        episode's turn settled) is launched after it, once."""
        recorded = {op.unit for op in self.ops if op.stage == "decode"}
        for units in self.decode_units().values():
            kept = [u for u in units if u in recorded]
            if len(kept) > 1 and kept[-1] == units[-1]:
                self.repeats[units[-1]] = 1
                units, kept = units[:-1], kept[:-1]
            for unit in kept:
                self.repeats[unit] = len(units) / len(kept)

    def stages(self) -> dict:
        """stage -> (kernels, FLOPs, bytes)."""
        out: dict = {}
        for op in self.ops:
            n, f, b = out.get(op.stage, (0, 0, 0))
            out[op.stage] = (n + (op.kind != "transfer"), f + op.flops, b + op.bytes)
        return out


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an op touches of `t`: its elements, broadcast (stride 0) dimensions counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _mnk(name: str, args, out) -> tuple:
    """(rows, columns, inner) of a matmul-like op, for the card's choice of kernel."""
    try:
        if name in ("mm", "addmm"):
            a = args[-2]
            return (a.shape[0], args[-1].shape[1], a.shape[1])
        if name in ("bmm", "baddbmm"):
            a = args[-2]
            return (a.shape[0] * a.shape[1], args[-1].shape[2], a.shape[2])
    except (AttributeError, IndexError):
        pass
    return ()


class OpRecorder(TorchDispatchMode):
    """Record the kernels run inside the block (see the module docstring). `phase` is a callable that names the
    step's current phase (the AllocationTracker's), `oracle` the SimulatedDevice, told to sample a rollout piece's
    first tokens again at each prefill, so that every piece shows its decode step. `decode_every`: record only
    every so many decode steps of a piece (its first, then each `decode_every`-th; see `OpTrace.spread_decode_steps`)."""

    def __init__(self, phase=lambda: "step", oracle=None, decode_every: int = 1):
        super().__init__()
        self.trace = OpTrace()
        self._phase = phase
        self._oracle = oracle
        self._unit = 0
        self._call_kind = "prefill"
        self._pieces = 0
        self._decode_every, self._decode_index, self._skipping = max(1, int(decode_every)), 0, False
        self._held: list = []  # the ops of the decode step left unrecorded so far: kept if it was its piece's last
        self._depth = 0  # model / decoder calls entered and not returned

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    # -- where in the step ------------------------------------------------------------------------
    def watch(self, model) -> list:
        """Hook `model` (a causal LM) and its decoder stack; returns the handles to remove."""
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        # Watching hooks: a CPU rollout's lean forward (no module calls) calls them itself instead of refusing
        return [model.register_forward_pre_hook(observing(self._model_call), with_kwargs=True),
                decoder.register_forward_pre_hook(observing(self._entered), with_kwargs=True),
                model.register_forward_hook(observing(self._returned), with_kwargs=True),
                decoder.register_forward_hook(observing(self._returned), with_kwargs=True)]

    def _entered(self, module, args, kwargs) -> None:
        self._depth += 1

    def _returned(self, module, args, kwargs, output) -> None:
        self._depth = max(0, self._depth - 1)

    def _model_call(self, module, args, kwargs) -> None:
        """In the rollout each call of the model starts a unit: the prefill of a piece, or a decode step."""
        self._depth += 1
        if self._phase() != "rollout":
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        length = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1
        self._call_kind = "prefill" if length > 1 else "decode"
        self._release_held(keep=self._call_kind == "prefill")
        if self._call_kind == "prefill":
            self._pieces += 1
            self._decode_index = 0
            if self._oracle is not None:
                self._oracle.restart_sampling()
        self._unit += 1
        rows = ids.shape[0] if isinstance(ids, torch.Tensor) else 0
        self.trace.calls[self._unit] = (self._call_kind, rows, self._pieces)
        self._skipping = False
        if self._call_kind == "decode":
            self._skipping = self._decode_index % self._decode_every != 0
            self._decode_index += 1
            if not any(isinstance(v, _StaticKV) for v in list(kwargs.values()) + list(args)):
                self.trace.eager.add(self._unit)

    def stage(self) -> str:
        phase = self._phase()
        if phase == "rollout":
            return self._call_kind
        if phase in ("reference log-probs", "old log-probs"):
            return phase
        if phase == "optimizer step":
            return "optimizer"
        if phase != "policy update":
            return "setup"  # building the batch, the optimizer's first moments: not part of a step
        if torch._C._current_autograd_node() is not None:
            return "backward"
        if self._depth > 0:
            return "forward"
        frame = sys._getframe(2)
        while frame is not None:
            if any(c in frame.f_code.co_filename.replace("\\", "/") for c in LOGPROB_CODE):
                return "log-probs"
            frame = frame.f_back
        return "loss"

    def _skipped(self) -> bool:
        """In a decode step that `decode_every` leaves unrecorded."""
        return self._skipping and self._phase() == "rollout"

    def _release_held(self, keep: bool) -> None:
        """The held step's ops: recorded (`keep`: it was its piece's last decode step) or dropped."""
        if keep:
            self.trace.ops.extend(self._held)
        self._held = []

    def finish(self) -> OpTrace:
        """The trace, with a last decode step still held recorded."""
        self._release_held(keep=True)
        return self.trace

    def add(self, name, flops, nbytes, dtype, kind="other", shape=()) -> None:
        op = Op(name, self.stage(), self._unit, int(flops), int(nbytes), dtype, kind, tuple(shape), self._depth > 0,
                in_graphed_step())
        if self._skipped():  # held until the next model call says whether the piece goes on
            self._held.append(op)
            return
        self._release_held(keep=True)  # the rollout ended after the held step
        self.trace.ops.append(op)

    # -- the mode ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _FREE or func.is_view or torch.Tag.view_copy in getattr(func, "tags", ()):
            return out
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if not any(t.device.type == "meta" for t in inputs + outputs):
            return out  # the oracle's CPU shadows of known values: no kernel of the step
        dtype = next((t.dtype for t in inputs + outputs if t.is_floating_point()), (inputs + outputs)[0].dtype)
        if name in _GATHERS:
            nbytes = sum(_nbytes(t) for t in inputs[1:]) + 2 * sum(_nbytes(t) for t in outputs)
        elif name in _SCATTERS:
            nbytes = 2 * sum(_nbytes(t) for t in inputs[1:])
        else:
            nbytes = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        packet = func.overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            kind = "attention" if "attention" in name else "matmul"
            self.add(name, flops, nbytes, dtype, kind, _mnk(name, args, out))
        elif str(func.namespace) == "bitsandbytes":
            self._bitsandbytes(name, args, kwargs, out, nbytes, dtype)
        else:
            self.add(name, sum(t.numel() for t in outputs), nbytes, dtype)
        return out

    def _bitsandbytes(self, name, args, kwargs, out, nbytes, dtype) -> None:
        if name in ("gemm_4bit", "gemv_4bit"):
            a, shape_b = args[0], args[2]
            m, n, k = a.numel() // a.shape[-1], shape_b[0], shape_b[1]
            self.add(name, 2 * m * n * k, nbytes, a.dtype, "gemm_4bit", (m, n, k))
        elif name.startswith("dequantize_4bit"):
            self.add(name, out.numel() if isinstance(out, torch.Tensor) else 0, nbytes, dtype, "dequantize_4bit")
        else:
            self.add(name, 0, nbytes, dtype)


def recording() -> OpRecorder | None:
    return _ACTIVE[-1] if _ACTIVE else None


def kernel(name: str, flops: int, nbytes: int, dtype: torch.dtype) -> None:
    """A kernel the meta device does not launch (a Triton kernel's launch is a no-op there) did this work."""
    recorder = recording()
    if recorder is not None:
        recorder.add(name, flops, nbytes, dtype, "kernel")


def dequantized_4bit(shape, dtype: torch.dtype) -> None:
    """bitsandbytes dequantised a 4-bit weight of `shape` to `dtype` (the simulated device allocates the result
    without running the op): read 4 bits and a share of the block scales per weight, write the weight."""
    recorder = recording()
    if recorder is not None:
        n = int(torch.Size(shape).numel())
        itemsize = torch.empty((), dtype=dtype).element_size()
        recorder.add("dequantize_4bit", n, n // 2 + n // 64 + n * itemsize, dtype, "dequantize_4bit")


def transfer(nbytes: int, direction: str) -> None:
    """A copy between device and (pinned) host memory: an offloaded activation going out or coming back."""
    recorder = recording()
    if recorder is not None:
        recorder.add(f"copy {direction}", 0, nbytes, torch.uint8, "transfer")
