"""Bytes by category: what a step's memory holds, counted from the tensors and shapes themselves.

The categories (`CATEGORIES`) are shared by the measurement during training (`memory.tracker`), the estimate
before it (`memory.estimate`) and the simulation (`grpo_nb.simulate`), so any of them lays next to another:

    base_weights     frozen weights (4-bit packed + quantisation constants under QLoRA), buffers
    trainable        the parameters being trained (LoRA adapters, fp32 under peft)
    optimizer        AdamW's two moments (parked in host memory between optimizer steps,
                     `grpo_nb.parking`: then on the device in the optimizer step only)
    gradients        the trainable parameters' gradients at the end of backward
    activations      what the policy update holds for backward beyond the above: checkpointed
                     layer inputs, one layer's recompute, the final hidden states
    logprob_scratch  the log-prob/loss computation's working memory (chunk x vocab logits)
    kv_cache         the KV cache and sampling buffers while generating
    other            the rest of the peak: allocator cache and fragmentation, and on the CPU the
                     Python/torch runtime itself

Rollout and policy update never overlap, so a step's peak holds the static categories plus the larger of the two
phases (`step_peak`); a parked optimizer state (`grpo_nb.parking`) is a third phase, beside the gradients.
"""

from __future__ import annotations

import resource
import sys

import torch

from ..attachments import text_config
from ..logprobs import default_chunk_size
CATEGORIES = ("base_weights", "trainable", "optimizer", "gradients", "activations", "logprob_scratch",
              "kv_cache", "other")
GiB = 2**30


def step_peak(categories: dict, *, parked: bool = False) -> int:
    """A step's peak from its categories: the static ones (weights, adapters, optimizer, other) plus the larger
    phase - the rollout's KV cache, or the update's gradients, activations and log-prob scratch. `parked`: the
    optimizer's state waits in host memory between steps (grpo_nb.parking), so it is not static but a phase of its
    own, the optimizer step."""
    c = categories
    static = c["base_weights"] + c["trainable"] + c.get("other", 0)
    update = c["gradients"] + c["activations"] + c["logprob_scratch"]
    if parked:  # on the device in the optimizer step only, beside the gradients
        return static + max(c["kv_cache"], update, c["gradients"] + c["optimizer"])
    return static + c["optimizer"] + max(c["kv_cache"], update)


# --------------------------------------------------------------------------------------
# Peaks


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_memory_bytes(torch.device("cpu"))


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak. False where the OS keeps the process's lifetime peak on the CPU (no /proc/self/clear_refs,
    or a sandbox such as gVisor that accepts the write and ignores it): peaks read after it are then upper bounds."""
    device = torch.device(device)  # "cpu", "cuda:0" as torch's own functions take them
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # high-water mark := current RSS
    except OSError:
        return False
    hwm = _vm_hwm_bytes()
    return hwm is not None and hwm <= _rss_bytes() + 2**20  # the RSS may grow a little between the two reads


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def current_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _rss_bytes()


# --------------------------------------------------------------------------------------
# Tensor bookkeeping


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: its shard of an FSDP-sharded (DTensor) one."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    """One key per storage (tied weights share it); unlike data_ptr, also distinct on the meta device."""
    return _local(t).untyped_storage()._cdata


def model_bytes(model) -> dict:
    """Frozen weights and buffers vs trainable parameters, counted once each (tied weights too).

    bitsandbytes' 4-bit weights count their packed bytes plus their quantisation constants.
    """
    seen, frozen, trainable = set(), 0, 0
    for p in model.parameters():
        key = _storage_key(p)
        if key in seen:
            continue
        seen.add(key)
        n = _nbytes(p)
        quant_state = getattr(p, "quant_state", None)
        if quant_state is not None:
            n += sum(_nbytes(t) for t in _quant_state_tensors(quant_state))
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
    frozen += sum(_nbytes(b) for b in model.buffers() if _storage_key(b) not in seen)
    return {"base_weights": frozen, "trainable": trainable}


def _quant_state_tensors(state):
    for name in ("absmax", "code"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(nested)


def optimizer_bytes(optimizer) -> int:
    return sum(_nbytes(v) for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1)


def gradient_bytes(params) -> int:
    return sum(_nbytes(p.grad) for p in params if p.grad is not None)




def kv_cache_bytes(config, batch_size: int, seq_len: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for `batch_size` sequences of `seq_len` tokens."""
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return 2 * cfg.num_hidden_layers * batch_size * seq_len * kv_heads * head_dim * dtype_bytes


def sampling_bytes(vocab_size: int, batch_size: int) -> int:
    """generate()'s per-step buffers: the last position's logits in fp32, processed and softmaxed."""
    return 3 * batch_size * vocab_size * 4


def logprob_scratch_bytes(rows: int, vocab_size: int, hidden_size: int, *, chunk_size: int | None = None,
                          backend: str = "torch", dtype_bytes: int = 4) -> int:
    """Working memory of the log-prob computation for `rows` completion tokens.

    grpo-nb's chunked path ("torch") holds a chunk's fp32 logits, their softmax and their
    gradient; its Triton kernels ("triton") an fp32 gradient buffer for the hidden states. TRL
    1.16's fused LM head ("trl") a [min(rows, 4096), 32768] logits tile in the compute dtype, the
    completion positions' hidden states gathered, and an fp32 gradient for them.
    """
    if backend == "trl":
        return min(rows, 4096) * 32768 * dtype_bytes + rows * hidden_size * (dtype_bytes + 4)
    if backend == "triton":
        return rows * hidden_size * 4
    chunk = min(rows, chunk_size or default_chunk_size(vocab_size))
    return 3 * chunk * vocab_size * 4

