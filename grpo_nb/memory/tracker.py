"""Memory measured during training, by category (`memory.accounting`): `train()` calls the phase methods around
the rollout and the update, and each step's record carries `breakdown()`.

On CUDA the allocator's peaks per phase; on the CPU (Linux) the process's peak resident set size per phase (VmHWM,
reset through /proc/self/clear_refs). Weights, adapters, optimizer states and gradients are counted from the tensors
themselves; the KV cache and the log-prob scratch from their shapes; activations are what the update phase's peak
holds above its starting level beyond gradients and scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import lora
from ..attachments import attachments, base_model, text_config
from .accounting import (CATEGORIES, current_memory_bytes, kv_cache_bytes, model_bytes, optimizer_bytes,
                         peak_memory_bytes, reset_peak_memory, sampling_bytes, step_peak)

# --------------------------------------------------------------------------------------
# Measurement during training


@dataclass
class MemoryTracker:
    """Per-step memory by category; `train()` calls the phase methods, records carry `breakdown()`."""

    model: object
    optimizer: object
    device: torch.device
    _phase: dict = field(default_factory=dict)

    def start_rollout(self) -> None:
        self._phase = {}
        lora.last_merged_bytes = 0  # set by this rollout if it merges the adapters (the CPU: grpo_nb.lora)
        reset_peak_memory(self.device)

    def end_rollout(self, batch_size: int, seq_len: int) -> None:
        cfg = text_config(self.model)
        # The cache is in the compute dtype, which the (never quantised) output head carries.
        base = base_model(self.model)
        dtype_bytes = base.get_output_embeddings().weight.element_size()
        self._phase["rollout_peak"] = peak_memory_bytes(self.device)
        # (on the CPU the rollout's merged LoRA weights with it: rollout-only copies, gone when it ends)
        self._phase["kv_cache"] = (kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes)
                                   + sampling_bytes(cfg.vocab_size, batch_size) + lora.last_merged_bytes)

    def start_update(self) -> None:
        offloader = attachments(self.model).offloader
        if offloader is not None:
            offloader.reset_stats()  # its peak is then this update's
        self._phase["update_start"] = current_memory_bytes(self.device)
        reset_peak_memory(self.device)

    def end_update(self, *, gradients: int, logprob_scratch: int) -> None:
        self._phase["update_peak"] = peak_memory_bytes(self.device)
        self._phase["gradients"] = gradients
        self._phase["logprob_scratch"] = logprob_scratch

    def breakdown(self) -> dict:
        ph = self._phase
        out = dict.fromkeys(CATEGORIES, 0)
        out.update(model_bytes(self.model))
        out["optimizer"] = optimizer_bytes(self.optimizer)
        out["gradients"] = ph.get("gradients", 0)
        out["logprob_scratch"] = ph.get("logprob_scratch", 0)
        out["kv_cache"] = ph.get("kv_cache", 0)
        update_peak = ph.get("update_peak", 0)
        rise = max(0, update_peak - ph.get("update_start", update_peak))
        out["activations"] = max(0, rise - out["gradients"] - out["logprob_scratch"])
        peak = max(ph.get("rollout_peak", 0), update_peak)
        out["other"] = max(0, peak - step_peak(out))  # `other` is 0 until here
        out["peak"] = peak
        # What stays allocated between steps (CUDA allocated / CPU resident): flat over a healthy run.
        out["current"] = current_memory_bytes(self.device)
        out["rollout_peak"] = ph.get("rollout_peak", 0)
        out["update_peak"] = update_peak
        if self.device.type == "cuda":
            out["reserved_peak"] = int(torch.cuda.max_memory_reserved(self.device))
        offloader = attachments(self.model).offloader
        if offloader is not None:
            out["offloaded_peak"] = int(offloader.stats()["peak_offloaded_bytes"])  # in CPU RAM, not in `peak`
        return out

