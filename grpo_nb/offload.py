"""Offloaded gradient checkpointing: each decoder layer's input waits in pinned CPU memory.

Plain gradient checkpointing keeps one tensor per decoder layer on the GPU (the layer's
input, `batch x seq x hidden`), so activation memory still grows with layers and sequence
length. Here that input is copied to pinned host memory on a side CUDA stream while the
layer runs, and freed on the GPU. In backward, layer i needs its input back: it was usually
prefetched while layer i+1 was being recomputed, and layer i starts the copy of layer i-1's
input before its own recompute, so host-to-device copies overlap compute as well.

The seam is the per-layer attribute `_gradient_checkpointing_func` of transformers'
`GradientCheckpointingLayer` (every decoder layer of a transformers model): when checkpointing
is on and the layer is in training mode, the layer calls `_gradient_checkpointing_func(fn,
hidden_states)` with everything else bound in `fn`. We install our function there.

`OffloadedCheckpoint` is a reentrant-style autograd Function: forward runs the layer without
grad; backward restores the input, recomputes the layer with the forward's RNG and autocast
state and returns gradients for the input and for the layer's trainable parameters, which are
passed in as explicit inputs (so LoRA weights get gradients even when the layer input does not
require grad, and it works under `.backward()`, `torch.autograd.grad` and a GradScaler alike).

Off CUDA (the CPU, or `storage_device` tests) the same code runs with the stream, pinning and
events as no-ops: the "offload" is a detached copy to `storage_device`.

Limits: a graph can be backpropagated once (inputs are freed after their layer's backward,
so `retain_graph=True` followed by a second backward raises); double backward is unsupported;
tensors that require grad must reach the layer positionally (transformers passes the hidden
states positionally; tensors bound as keyword arguments are checked and refused).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from .attachments import attachments, base_model

__all__ = [
    "ActivationOffloader",
    "OffloadedCheckpoint",
    "disable_offloaded_checkpointing",
    "enable_offloaded_checkpointing",
    "find_checkpointing_layers",
]

# Float tensors below this size are kept where they are: copying them would save nothing.
DEFAULT_MIN_OFFLOAD_BYTES = 1024


class _Entry:
    """What one layer call saved for its backward: kept args and offloaded copies.

    `prev` is the entry of the previous checkpointed layer of the same forward pass, the one
    the backward pass needs next, so this entry's backward can prefetch it.
    """

    __slots__ = ("offloader", "layer_index", "slots", "prev", "nbytes", "prefetched", "released", "__weakref__")

    def __init__(self, offloader, layer_index, slots, prev, nbytes):
        self.offloader = offloader
        self.layer_index = layer_index
        # Per positional arg: ("keep", value) or ("off", stored_tensor, device, copy_event).
        self.slots = slots
        self.prev = prev
        self.nbytes = nbytes
        self.prefetched = None  # {arg position: (device tensor, event)} once a prefetch was issued
        self.released = False

    def release(self):
        if self.released:
            return
        self.released = True
        self.slots = None
        self.prefetched = None
        self.offloader._forget(self.nbytes)

    def __del__(self):  # a forward whose graph was dropped without backward
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass


class _HostCopies:
    """Copies without streams: the CPU path (and any non-CUDA device). Events are None."""

    def __init__(self, storage_device):
        self.storage_device = torch.device(storage_device)

    def copy_out(self, x):
        return x.detach().to(self.storage_device, copy=True), None

    def copy_in(self, stored, device, prefetch, after):
        return stored.to(device), None

    def ready(self, tensor, event):
        pass


class _CudaCopies:
    """Device-to-host copies into pinned memory and prefetches back, on one side stream.

    Pinned buffers come from PyTorch's caching host allocator (`pin_memory=True`), which
    reuses them across steps and records the copies' events before handing a block out again.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def copy_out(self, x):
        compute = torch.cuda.current_stream(x.device)
        self.stream.wait_stream(compute)  # x is written by work already queued on the compute stream
        with torch.cuda.stream(self.stream):
            buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            buf.copy_(x.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # The compute stream may free x as soon as the layer is done; the allocator must not
        # hand its memory out again before the side stream has read it.
        x.record_stream(self.stream)
        return buf, event

    def copy_in(self, stored, device, prefetch, after):
        if prefetch:
            # Same stream as the device-to-host copy, so it runs after that copy finished.
            with torch.cuda.stream(self.stream):
                tensor = stored.to(device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            return tensor, event
        compute = torch.cuda.current_stream(device)
        if after is not None:
            compute.wait_event(after)  # the pinned buffer is complete only once its copy ran
        return stored.to(device, non_blocking=True), None

    def ready(self, tensor, event):
        if event is None:
            return
        compute = torch.cuda.current_stream(tensor.device)
        compute.wait_event(event)
        tensor.record_stream(compute)  # allocated on the side stream, used and freed on compute


def _autocast_state(device_type):
    return dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                dtype=torch.get_autocast_dtype(device_type), cache_enabled=torch.is_autocast_cache_enabled())


def _flatten_outputs(outputs, spec):
    if isinstance(outputs, torch.Tensor):
        spec["kind"] = "tensor"
        return (outputs,)
    if isinstance(outputs, (tuple, list)):
        spec["kind"] = type(outputs)
        spec["items"] = [None if isinstance(o, torch.Tensor) else ("const", o) for o in outputs]
        tensors = tuple(o for o in outputs if isinstance(o, torch.Tensor))
        if tensors:
            return tensors
    raise TypeError(f"offloaded checkpointing: a layer returned {type(outputs).__name__}; expected a tensor or a "
                    "tuple holding at least one tensor")


def _unflatten_outputs(flat, spec):
    if spec["kind"] == "tensor":
        return flat[0]
    it = iter(flat)
    items = [next(it) if item is None else item[1] for item in spec["items"]]
    return items if spec["kind"] is list else tuple(items)


def _recompute_outputs(outputs):
    if isinstance(outputs, torch.Tensor):
        return (outputs,)
    return tuple(o for o in outputs if isinstance(o, torch.Tensor))


class OffloadedCheckpoint(torch.autograd.Function):
    """Reentrant checkpoint of one layer call whose tensor inputs wait off the device.

    apply(offloader, layer_index, function, spec, n_args, *args, *params): `args` are the
    layer's positional args, `params` its trainable parameters. Returns the flat tuple of the
    output's tensors; `spec` (a dict filled in forward) rebuilds the output's structure.
    """

    @staticmethod
    def forward(ctx, offloader, layer_index, function, spec, n_args, *inputs):
        args = inputs[:n_args]
        ctx.offloader, ctx.function, ctx.n_args = offloader, function, n_args
        ctx.devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor)
                              and a.device.type == "cuda"})
        device_types = {a.device.type for a in args if isinstance(a, torch.Tensor)} | {"cpu"}
        ctx.autocast = [_autocast_state(t) for t in sorted(device_types) if t in ("cpu", "cuda")]
        if offloader.preserve_rng_state:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.save_for_backward(*inputs[n_args:])  # the parameters (leaves: no memory)
        # Start the copy off the device first, so it overlaps this layer's compute.
        ctx.entry = offloader._save(layer_index, args)
        ctx.set_materialize_grads(False)
        outputs = function(*args)
        flat = _flatten_outputs(outputs, spec)
        not_diff = [o for o in flat if not (o.is_floating_point() or o.is_complex())]
        if not_diff:
            ctx.mark_non_differentiable(*not_diff)
        return flat

    @staticmethod
    def backward(ctx, *grad_outputs):
        offloader, entry, n_args = ctx.offloader, ctx.entry, ctx.n_args
        if entry is None or entry.released:
            raise RuntimeError("offloaded checkpointing frees each layer's saved input after its backward: a second "
                               "backward through the same graph (retain_graph=True) is not supported")
        args = offloader._restore(entry)
        offloader._prefetch(entry.prev)  # overlaps with the recompute below
        needs = ctx.needs_input_grad[5:]
        arg_needs, param_needs = needs[:n_args], needs[n_args:]
        params = ctx.saved_tensors
        inputs = [a.detach().requires_grad_(bool(need)) if isinstance(a, torch.Tensor) and
                  (a.is_floating_point() or a.is_complex()) else a for a, need in zip(args, arg_needs)]
        offloader._trace("recompute", entry.layer_index)
        with contextlib.ExitStack() as stack:
            if offloader.preserve_rng_state:
                stack.enter_context(torch.random.fork_rng(devices=ctx.devices, enabled=True, device_type="cuda"))
                torch.set_rng_state(ctx.cpu_rng)
                for d, state in zip(ctx.devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, d)
            for kwargs in ctx.autocast:
                stack.enter_context(torch.autocast(**kwargs))
            with torch.enable_grad():
                outputs = _recompute_outputs(ctx.function(*inputs))
        entry.release()  # the restored inputs live on in `inputs` until this returns
        ctx.entry = None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
        wrt = [x for x, need in zip(inputs, arg_needs) if need] + [p for p, need in zip(params, param_needs) if need]
        if pairs and wrt:
            grads = list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        else:
            grads = [None] * len(wrt)
        grads.reverse()
        result = [grads.pop() if need else None for need in needs]
        return (None, None, None, None, None, *result)


class ActivationOffloader:
    """One per model: the side stream, the saved layer inputs and their prefetch chain, statistics.

    Args:
        min_offload_bytes: float tensor args smaller than this stay where they are.
        preserve_rng_state: replay the forward's CPU and CUDA RNG state in the recompute, so
            dropout (e.g. LoRA dropout) draws the same masks; as torch.utils.checkpoint does.
        storage_device: where non-CUDA inputs are copied (the CPU path; tests).

    `host_copies` (an object with `copy_out`, `copy_in` and `ready`, like `_HostCopies`) stores
    the inputs of non-CUDA tensors; the memory simulation (`grpo_nb.simulate`) swaps in copies
    it counts as host memory, so the meta device behaves like a GPU with pinned host buffers.
    """

    def __init__(self, *, min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES, preserve_rng_state: bool = True,
                 storage_device: str | torch.device = "cpu"):
        self.min_offload_bytes = int(min_offload_bytes)
        self.preserve_rng_state = preserve_rng_state
        self.host_copies = _HostCopies(storage_device)
        self._cuda: dict[torch.device, _CudaCopies] = {}
        self._last = None  # weakref to the newest entry: the chain's tail
        # (weak reference to a layer, its previous function); weak, so model and offloader form no cycle
        self._installed: list[tuple[weakref.ref, object]] = []
        self.trace: list | None = None  # set to [] to record ("offload"|"restore"|"prefetch"|"recompute", ...) events
        self._offloaded = 0
        self.reset_stats()

    # -- statistics ---------------------------------------------------------------------
    def reset_stats(self):
        """Zero the counters; the peak restarts from what is offloaded now."""
        self._copies = self._prefetches = self._hits = self._sync = 0
        self._peak = self._offloaded

    def stats(self) -> dict:
        """Bytes offloaded now and at the peak since `reset_stats`, copies off the device,
        prefetches issued, restores served by a prefetch (hits) or copied on demand."""
        return {"offloaded_bytes": self._offloaded, "peak_offloaded_bytes": self._peak, "copies": self._copies,
                "prefetches": self._prefetches, "prefetch_hits": self._hits, "sync_restores": self._sync,
                "layers": len(self._installed)}

    def _forget(self, nbytes):
        self._offloaded -= nbytes

    def _trace(self, *event):
        if self.trace is not None:
            self.trace.append(event)

    # -- copies ---------------------------------------------------------------------------
    def _copier(self, device):
        if device.type != "cuda":
            return self.host_copies
        if device not in self._cuda:
            self._cuda[device] = _CudaCopies(device)
        return self._cuda[device]

    def _save(self, layer_index, args):
        slots, nbytes = [], 0
        for a in args:
            if (isinstance(a, torch.Tensor) and a.is_floating_point()
                    and a.numel() * a.element_size() >= self.min_offload_bytes):
                stored, event = self._copier(a.device).copy_out(a)
                slots.append(("off", stored, a.device, event))
                nbytes += stored.numel() * stored.element_size()
                self._copies += 1
            else:
                slots.append(("keep", a.detach() if isinstance(a, torch.Tensor) else a))
        last = self._last() if self._last is not None else None
        prev = last if last is not None and not last.released and last.layer_index < layer_index else None
        entry = _Entry(self, layer_index, slots, prev, nbytes)
        self._last = weakref.ref(entry)
        self._offloaded += nbytes
        self._peak = max(self._peak, self._offloaded)
        self._trace("offload", layer_index, nbytes)
        return entry

    def _prefetch(self, entry):
        if entry is None or entry.released or entry.prefetched is not None:
            return
        entry.prefetched = {}
        for i, slot in enumerate(entry.slots):
            if slot[0] == "off":
                _, stored, device, event = slot
                entry.prefetched[i] = self._copier(device).copy_in(stored, device, True, event)
        self._prefetches += 1
        self._trace("prefetch", entry.layer_index)

    def _restore(self, entry):
        hit = entry.prefetched is not None
        args = []
        for i, slot in enumerate(entry.slots):
            if slot[0] == "keep":
                args.append(slot[1])
                continue
            _, stored, device, event = slot
            copier = self._copier(device)
            if hit:
                tensor, ready = entry.prefetched[i]
            else:
                tensor, ready = copier.copy_in(stored, device, False, event)
            copier.ready(tensor, ready)
            args.append(tensor)
        if hit:
            self._hits += 1
        else:
            self._sync += 1
        self._trace("restore", entry.layer_index, hit)
        return args

    # -- the function installed on each layer ------------------------------------------------
    def checkpoint(self, layer_index: int, layer: torch.nn.Module, function, *args, **kwargs):
        """Run `function(*args, **kwargs)` (one call of `layer`) under offloaded checkpointing.

        `layer` (a module, or a weak reference to one) supplies the trainable parameters.
        """
        if isinstance(layer, weakref.ref):
            layer = layer()
        if kwargs:
            kwargs.pop("use_reentrant", None)
            kwargs.pop("preserve_rng_state", None)
            if kwargs:
                function = functools.partial(function, **kwargs)
        if not torch.is_grad_enabled():
            return function(*args)
        params = [p for p in layer.parameters() if p.requires_grad]
        if not params and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function(*args)  # nothing to differentiate: nothing to save
        _refuse_bound_grad_tensors(function, layer)
        spec: dict = {}
        flat = OffloadedCheckpoint.apply(self, layer_index, function, spec, len(args), *args, *params)
        return _unflatten_outputs(flat, spec)

    def remove(self):
        """Put back each layer's previous checkpointing function (plain checkpointing stays on)."""
        for ref, previous in self._installed:
            layer = ref()
            if layer is None:
                continue
            if previous is None:
                layer.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                layer._gradient_checkpointing_func = previous
        self._installed = []


def _refuse_bound_grad_tensors(function, layer):
    """Tensors bound into `function` that require grad would get no gradient from a reentrant recompute."""
    while isinstance(function, functools.partial):
        values = list(function.args) + list(function.keywords.values())
        for v in values:
            items = v if isinstance(v, (tuple, list)) else v.values() if isinstance(v, dict) else (v,)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in items):
                raise RuntimeError(
                    f"offloaded checkpointing: {type(layer).__name__} got a keyword tensor that requires grad; only "
                    "positional inputs receive gradients. Use gradient_checkpointing=True for this model.")
        function = function.func


def find_checkpointing_layers(model) -> list:
    """The transformers `GradientCheckpointingLayer`s of a model (plain or peft-wrapped), in order."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as err:  # transformers < 4.52
        raise RuntimeError("offloaded checkpointing needs transformers' GradientCheckpointingLayer "
                           "(transformers >= 4.52); use gradient_checkpointing=True") from err
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_offloaded_checkpointing(model, **offloader_kwargs) -> ActivationOffloader:
    """Turn on offloaded gradient checkpointing for every decoder layer of `model`.

    Works on a transformers model or a peft model wrapping one. Turns transformers'
    (non-reentrant) checkpointing on first when no layer has it, then replaces each
    checkpointed layer's `_gradient_checkpointing_func`. Checkpointing, offloaded or not,
    acts only in training mode. Keyword arguments go to `ActivationOffloader`.
    Returns the offloader, also kept as `attachments(model).offloader`.
    """
    layers = find_checkpointing_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no transformers GradientCheckpointingLayer, so its layers cannot "
                         "be checkpointed with offloading; use gradient_checkpointing=True (or False)")
    hf = base_model(model)
    previous = attachments(model).offloader
    if previous is not None:
        previous.remove()
    if not any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.2x name
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(hf, "gradient_checkpointing_enable"):
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ValueError(f"{type(hf).__name__} has no gradient_checkpointing_enable(); enable transformers' "
                             "gradient checkpointing on its layers before enable_offloaded_checkpointing()")
    offloader = ActivationOffloader(**offloader_kwargs)
    index = 0
    for layer in layers:
        if not getattr(layer, "gradient_checkpointing", False):
            continue  # e.g. every_n_layers > 1: this layer keeps its activations
        if not hasattr(layer, "_gradient_checkpointing_func"):
            raise RuntimeError(f"{type(layer).__name__} does not use `_gradient_checkpointing_func`; this transformers "
                               "version is not supported by offloaded checkpointing: use gradient_checkpointing=True")
        offloader._installed.append((weakref.ref(layer), layer.__dict__.get("_gradient_checkpointing_func")))
        # A weak reference: the layer holding a strong one to itself would need the cyclic GC to be freed.
        layer._gradient_checkpointing_func = functools.partial(offloader.checkpoint, index, weakref.ref(layer))
        index += 1
    attachments(model).offloader = offloader
    return offloader


def disable_offloaded_checkpointing(model) -> None:
    """Back to plain checkpointing (the function transformers installed); a no-op if offloading is off."""
    offloader = attachments(model).offloader
    if offloader is not None:
        offloader.remove()
        attachments(model).offloader = None
