"""The optimizer's state parked in host memory while it is not needed (`GRPOConfig.park_optimizer_state`).

AdamW's moments are read once a step, by the optimizer step, yet they would sit on the device through the rollout
(beside the KV cache) and the policy update (beside the activations). Parked, they wait in host memory - pinned on
CUDA, so the copies run asynchronously - from the end of one optimizer step to the start of the next:
`step.apply_update` calls `restore()` right before `optimizer.step()`, after the last micro-batch's backward has
freed its activations, and `park()` right after it. A step's peak then holds them only in the optimizer step,
beside the gradients (`memory.step_peak`), instead of in every phase. The values are copies: equal results.

What is parked: every tensor of `optimizer.state` on the parameters' device - torch AdamW's exp_avg / exp_avg_sq
(and, fused, its step counts), bitsandbytes' 8-bit states, their absmax and quantization maps (a map its
parameters share is copied once). Left where they are:
* bitsandbytes' paged tensors (`is_paged`: its paged optimizers' states of 1e5 values and more). They live in CUDA
  managed memory, which the driver already moves to the host when the device runs short, outside torch's
  allocator and its counts, and bitsandbytes' page manager keeps references to them: a copy would take them out of
  paging and out of its prefetching. So "auto" leaves paged optimizers alone; True parks their smaller, unpaged
  tensors.
* sharded states (FSDP's DTensors): each rank holds its shard only, tied to the device mesh.
* tensors already in host memory (torch AdamW's unfused step counts live on the CPU).

Gradients: none to park. `apply_update` ends with `zero_grad(set_to_none=True)`, so no gradient exists from one
optimizer step to the next policy update's backward.

The copy back is not overlapped with the last micro-batch's backward on a side stream: started during it, the
state would be on the device at the backward's peak, the moment parking exists to free. It is queued on the compute
stream instead, right before the optimizer's kernels (from pinned memory: no host wait). Priced by the simulation,
both ways for Qwen2.5-1.5B's LoRA (148 MB) take 39 ms over a T4's host link: 0.2% of its 21 s step at 8 x (256 + 1024)
tokens, for 0.14 GiB off the step's peak. (Parked right after the step on a side stream instead, the state would
still be on the device when the rollout allocates its KV cache.)

Checkpoints: `optimizer.state_dict()` of a parked state holds the host copies - the same values (a state-dict hook
waits for the copies to land). Loading one (resume) puts the state on the parameters' device; `park()` parks it
again (`resume.restore_state`).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .lora import available_host_bytes  # 0 where the system says nothing: then "auto" parks

PARKING_SETTINGS = ("auto", True, False)


def parks(setting, device, optim: str = "adamw_torch") -> bool:
    """Whether `park_optimizer_state=setting` parks a state on `device`: True / False as given; "auto" on CUDA for
    an optimizer that is not paged (a paged one's state the driver moves already), off on the CPU, where host memory
    is the device's memory and a parked copy would only add to it."""
    if setting == "auto":
        return torch.device(device).type == "cuda" and not optim.startswith("paged_")
    return bool(setting)


class OptimizerParking:
    """Moves `optimizer`'s state between `device` (the parameters') and `host`, keeping one host copy of each state
    tensor from step to step (pinning memory is slow; it is reused).

    `budget`: the most bytes "auto" parks; a state larger than that stays on the device (one warning): Colab's 12.7
    GB of RAM holds a LoRA's moments easily, not a full fine-tune's. `host` may be `device` itself (the CPU, the meta
    device): the same code path, tested on the CPU and counted by the simulation.
    """

    def __init__(self, optimizer, device, host="cpu", *, budget: int | None = None):
        self._optimizer = weakref.ref(optimizer)  # the registry below is keyed on the optimizer: no strong cycle
        self.device, self.host = torch.device(device), torch.device(host)
        self.pinned = self.device.type == "cuda" and self.host.type == "cpu"
        self.budget = budget
        self.enabled = True
        self._twins: dict = {}  # (id(param), state key) -> its host copy
        self._twin_ids: set = set()  # ids of the host copies: a state holding one is parked
        self._copied = None  # a CUDA event after the copies to the host: they land before the host reads them
        optimizer.register_state_dict_pre_hook(lambda _: self.wait())

    @property
    def parked(self) -> bool:
        """Whether the state is in host memory now (False while it is on the device, or when it has none yet)."""
        optimizer = self._optimizer()
        return optimizer is not None and any(id(v) in self._twin_ids for s in optimizer.state.values()
                                             for v in s.values())

    def park(self) -> None:
        """The state's device tensors copied to their host copies, which the state then holds."""
        optimizer = self._optimizer()
        if optimizer is None or not self.enabled:
            return
        todo = [(param, state, key, value) for param, state in optimizer.state.items() for key, value in state.items()
                if self._parkable(value)]
        if not todo:
            return
        if self.budget is not None:
            size = sum({id(v): v.numel() * v.element_size() for *_, v in todo}.values())
            if size > self.budget:
                self.enabled = False
                warnings.warn(f"park_optimizer_state='auto' keeps the optimizer's state ({size / 2**30:.2f} GiB) on "
                              f"the device: it would take more than half the host memory available "
                              f"({2 * self.budget / 2**30:.2f} GiB). park_optimizer_state=True parks it anyway.",
                              stacklevel=3)
                return
        moved, used = {}, set()  # id(device tensor) -> its host copy: a tensor states share is copied once
        for param, state, key, value in todo:
            twin = moved.get(id(value))
            if twin is None:
                twin = self._twins.get((id(param), key))
                if twin is None or twin.shape != value.shape or twin.dtype != value.dtype or id(twin) in used:
                    twin = self._host_tensor(value)  # (a copy shared before, its tensors now apart: one each)
                self._copy(twin, value, "to host")
                moved[id(value)] = twin
                used.add(id(twin))
            self._twins[(id(param), key)] = twin
            state[key] = twin  # the device tensor's last reference goes: its memory is free for the rollout
        self._twin_ids = {id(t) for t in self._twins.values()}
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def restore(self) -> None:
        """The parked state back on the device: fresh device tensors copied from the host copies (kept for the next
        park)."""
        optimizer = self._optimizer()
        if optimizer is None:
            return
        back = {}  # id(host copy) -> its device tensor: a shared one comes back shared
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and id(value) in self._twin_ids:
                    if id(value) not in back:
                        back[id(value)] = self._device_tensor(value)
                    state[key] = back[id(value)]

    def wait(self) -> None:
        """Until the copies to the host have landed (before anything reads them there: a checkpoint)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _parkable(self, value) -> bool:
        return (isinstance(value, torch.Tensor) and value.device == self.device and id(value) not in self._twin_ids
                and not getattr(value, "is_paged", False) and not hasattr(value, "to_local"))  # paged, DTensor

    # The three places memory moves: the simulation counts them (simulate.step.CountedParking)
    def _host_tensor(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(like, device=self.host, pin_memory=self.pinned)

    def _device_tensor(self, twin: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(twin, device=self.device)
        self._copy(out, twin, "to device")
        return out

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        # on CUDA queued on the current stream: the optimizer's kernels (restore) or whatever next uses the freed
        # device memory (park) come after the copy in the stream's order
        dst.copy_(src, non_blocking=self.pinned)


# One parking per optimizer, kept beside it rather than stamped on it (as `attachments` does for models).
_PARKING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(optimizer, parking: OptimizerParking | None) -> OptimizerParking | None:
    """Park `optimizer`'s state between its steps with `parking` (None: keep it on the device)."""
    if parking is None:
        _PARKING.pop(optimizer, None)
    else:
        _PARKING[optimizer] = parking
    return parking


def parking_for(optimizer, setting, device, optim: str = "adamw_torch") -> OptimizerParking | None:
    """The parking `park_optimizer_state=setting` asks for, on `device`, or None. "auto" parks at most half of the
    host memory available now."""
    if not parks(setting, device, optim):
        return None
    budget = (available_host_bytes() or 2**62) // 2 if setting == "auto" else None
    return OptimizerParking(optimizer, device, budget=budget)


def of(optimizer) -> OptimizerParking | None:
    return _PARKING.get(optimizer)


def park(optimizer) -> None:
    """Park `optimizer`'s state if it parks (see `attach`); else nothing."""
    if (parking := _PARKING.get(optimizer)) is not None:
        parking.park()


def restore(optimizer) -> None:
    """Bring `optimizer`'s parked state back to the device; nothing if it is not parked."""
    if (parking := _PARKING.get(optimizer)) is not None:
        parking.restore()
